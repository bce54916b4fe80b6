"""Greedy generation through Ray Data LLM (`ray.data.llm`: `vLLMEngineProcessorConfig` +
`build_processor`) with vLLM, run with the vLLM venv's Python (`make vllm-env`); one JSON request in,
one JSONL of results out, appended row by row as Ray Data streams them (so a killed job keeps what it
finished). It imports only Ray, vLLM (inside Ray Data's engine actor) and the standard library, never
drelay; `deploy/vllm/regenerate.py` starts it from our venv.

    .venv-vllm/bin/python deploy/vllm/ray_data_job.py REQUEST.json RESULTS.jsonl

Request: {"model": HF dir, "rows": [{"key": str, "prompt_token_ids": [ids]}, …], "max_new_tokens": N,
          "stop_token_ids": [ids], "batch_size": rows per engine call, "dtype": "float32",
          "max_model_len": 2048, "kv_cache_gib": 2, "ray_num_cpus": 2, "accelerator": "cpu" | "gpu",
          "eager": bool, "concurrency": engine replicas, "ray_address": "local" | a cluster}
Results: one line per row, {"key", "token_ids"} (EOS included when the answer ended), then a last
line {"summary": {"load_and_run_s", "rows", "tokens"}}.

Prompts arrive as token ids (rendered by our chat template in our venv), so chat rendering is the same
on both engines and only decoding differs. On CPU the engine actor asks Ray for CPUs only (a
placement group of one `{"CPU": 1}` bundle); by default Ray Data LLM asks for one GPU per engine.
"""

from __future__ import annotations

import json
import sys
import time


def processor_config(req: dict):
    from ray.data.llm import vLLMEngineProcessorConfig

    engine = {"dtype": req.get("dtype", "float32"), "max_model_len": req.get("max_model_len", 2048), "seed": 0,
              "enforce_eager": bool(req.get("eager", False))}  # fmt: skip
    cpu = req.get("accelerator", "cpu") == "cpu"
    extra = {"placement_group_config": {"bundles": [{"CPU": 1}]}} if cpu else {}
    env = {"VLLM_CPU_KVCACHE_SPACE": str(req.get("kv_cache_gib", 2))} if cpu else {}
    return vLLMEngineProcessorConfig(
        model_source=req["model"],
        engine_kwargs=engine,
        runtime_env={"env_vars": env},
        batch_size=req.get("batch_size", 16),
        concurrency=req.get("concurrency", 1),
        chat_template_stage=False,  # prompts are token ids already
        tokenize_stage=False,
        detokenize_stage=False,
        log_engine_metrics=False,
        **extra,
    )


def run(req: dict, out_path: str) -> dict:
    import ray
    from ray.data.llm import build_processor

    sampling = {"temperature": 0.0, "max_tokens": req["max_new_tokens"], "stop_token_ids": req["stop_token_ids"],
                "detokenize": False}  # fmt: skip
    processor = build_processor(
        processor_config(req),
        preprocess=lambda row: {"key": row["key"], "tokenized_prompt": row["prompt_token_ids"], "sampling_params": sampling},
        postprocess=lambda row: {"key": row["key"], "token_ids": [int(t) for t in row["generated_tokens"]]},
    )
    t0 = time.perf_counter()
    rows = tokens = 0
    with open(out_path, "a", encoding="utf-8") as out:
        for row in processor(ray.data.from_items(req["rows"])).iter_rows():
            out.write(json.dumps({"key": row["key"], "token_ids": row["token_ids"]}) + "\n")
            out.flush()
            rows, tokens = rows + 1, tokens + len(row["token_ids"])
            print(f"ray-data-job: {rows}/{len(req['rows'])} rows", file=sys.stderr, flush=True)
        summary = {"load_and_run_s": time.perf_counter() - t0, "rows": rows, "tokens": tokens}
        out.write(json.dumps({"summary": summary}) + "\n")
    return summary


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: ray_data_job.py REQUEST.json RESULTS.jsonl", file=sys.stderr)
        return 2
    req = json.loads(open(argv[0]).read())
    import ray

    # "local": a Ray instance of its own (never a cluster that happens to run on this machine);
    # a cluster's address (or "auto") runs the job there.
    address = req.get("ray_address", "local")
    cpus = {"num_cpus": req.get("ray_num_cpus", 2)} if address == "local" else {}
    ray.init(address=address, log_to_driver=True, include_dashboard=False, **cpus)
    try:
        run(req, argv[1])
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
