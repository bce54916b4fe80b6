"""Ray Serve LLM (`ray.serve.llm`: `LLMConfig` + `build_openai_app`) with vLLM and an exported DFlash
drafter, run with the vLLM venv's Python (`make vllm-env`); `drelay serve --config
platform/serve/*-vllm.yaml` starts it (deploy/vllm/serve.py) and it blocks until SIGINT/SIGTERM.

    .venv-vllm/bin/python deploy/vllm/serve_llm.py SPEC.json

SPEC (written by deploy/vllm/serve.py from the validated serve config): model_id, model_source (HF
dir), draft (exported DFlash dir or null), num_speculative_tokens, dtype, max_model_len,
kv_cache_gib, accelerator ("cpu" | "gpu"), num_replicas, ray_num_cpus, host, port, drelay_plugin
(true: the replica runs with VLLM_PLUGINS=drelay and the draft directory holds `drelay_selector/`, so
this project's vLLM plugin chooses the drafts). It imports only Ray and the standard library (vLLM
is imported by Ray Serve LLM inside the replica). With a draft, every response carries vLLM's
per-request acceptance (`metrics.speculative_decoding`: mean_acceptance_length, …).
"""

from __future__ import annotations

import json
import signal
import sys
import threading


def llm_config(spec: dict):
    from ray.serve.llm import LLMConfig

    engine = {"dtype": spec["dtype"], "max_model_len": spec["max_model_len"], "disable_log_stats": False}
    if spec.get("draft"):
        engine["speculative_config"] = {
            "method": "dflash",
            "model": spec["draft"],
            "num_speculative_tokens": spec["num_speculative_tokens"],
        }
        engine["per_request_spec_decode_metrics"] = "summary"
    env = {"VLLM_CPU_KVCACHE_SPACE": str(spec["kv_cache_gib"])} if spec["accelerator"] == "cpu" else {}
    if spec.get("drelay_plugin"):
        env["VLLM_PLUGINS"] = "drelay"  # vLLM loads only this project's plugin (deploy/vllm/plugin.py)
    extra = {"accelerator_config": {"kind": "cpu"}} if spec["accelerator"] == "cpu" else {}
    return LLMConfig(
        model_loading_config={"model_id": spec["model_id"], "model_source": spec["model_source"]},
        deployment_config={"autoscaling_config": {"min_replicas": spec["num_replicas"], "max_replicas": spec["num_replicas"]}},
        engine_kwargs=engine,
        runtime_env={"env_vars": env},
        log_engine_metrics=True,
        **extra,
    )


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: serve_llm.py SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(open(argv[0]).read())
    import ray
    from ray import serve
    from ray.serve.llm import build_openai_app

    # A Ray instance of its own: the LLM server's placement group takes 2 logical CPUs on CPU, the
    # ingress one more.
    ray.init(address="local", num_cpus=spec["ray_num_cpus"], log_to_driver=False, include_dashboard=False)
    serve.start(http_options={"host": spec["host"], "port": spec["port"]})
    serve.run(build_openai_app({"llm_configs": [llm_config(spec)]}), name="drelay-vllm", route_prefix="/", blocking=False)
    print(f"ready: http://{spec['host']}:{spec['port']}/v1", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
