"""Replay throughput: prompts per minute of greedy replay, one prompt at a time vs batched.

Replay (drelay_model/decoding/replay.py) is what `drelay eval`, `drelay compare` and training's
validation spend their time in. This script decodes the target's greedy continuations once (AR, the
project's engine, batched), then replays them with each method at `--batch-sizes` (1 = one prompt
at a time), checks that every batch size gives the same counters as batch size 1,
and prints prompts/minute and the speed-up over batch size 1, measured in this one run.

Run:  .venv/bin/python benchmarks/bench_replay.py                       # 16 MT-Bench prompts × 128 tokens
      .venv/bin/python benchmarks/bench_replay.py --quick               # 4 prompts × 32 tokens
Results go to --out (JSON) and MLflow (experiment `drelay-benchmarks`) unless --no-mlflow.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from drelay_model.decoding import GenerationConfig, SpeculativeEngine, replay  # noqa: E402
from cli import guarded  # noqa: E402

EXPERIMENT = "drelay-benchmarks"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--checkpoint", default=None, help="drafter checkpoint (default: the bundled one)")
    p.add_argument("--benchmark", default="mt_bench")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default="native,drelay")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 prompts × 32 tokens")
    p.add_argument("--out", default=str(REPO / "outputs" / "bench_replay.json"))
    p.add_argument("--no-mlflow", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens = 4, 32
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if any(b < 1 for b in args.batch_sizes) or args.prompts < 1 or args.max_new_tokens < 1:
        p.error("--batch-sizes, --prompts and --max-new-tokens must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from pipelines.common.methods import load_method, load_target_spec, resolve_method
    from pipelines.data.eval_sets import load_benchmark
    from pipelines.eval.prompts import encoder_for

    target = load_target_spec(args.target)
    encoder = encoder_for(target)
    prompts = [encoder.encode(p.turns[:1], []) for p in load_benchmark(args.benchmark, limit=args.prompts)]
    t0 = time.perf_counter()
    conts = SpeculativeEngine(target).generate(prompts, GenerationConfig(max_new_tokens=args.max_new_tokens)).tokens
    print(f"greedy continuations: {len(prompts)} prompts, {sum(map(len, conts))} tokens in {time.perf_counter() - t0:.1f}s")
    results = {}
    for method in args.methods.split(","):
        drafter, selector = load_method(resolve_method(method, target_spec=args.target, checkpoint=args.checkpoint), target)
        ref = None
        for bs in tqdm(args.batch_sizes, desc=f"replay {method}"):
            t0 = time.perf_counter()
            stats = replay(target, drafter, prompts, conts, selector=selector, batch_size=bs)
            wall = time.perf_counter() - t0
            key = (stats.rounds, stats.committed, stats.accept_hist.tolist())
            ref = ref or key
            results[f"{method}/bs{bs}"] = {
                "prompts_per_min": 60 * len(prompts) / wall,
                "wall_s": wall,
                "tau": stats.tau,
                "same_as_bs1": key == ref,
            }
    base = {m: results[f"{m}/bs{args.batch_sizes[0]}"]["prompts_per_min"] for m in args.methods.split(",")}
    print(f"{'variant':<16}{'prompts/min':>12}{'× bs' + str(args.batch_sizes[0]):>10}{'tau':>8}  same counters")
    for name, r in results.items():
        r["speedup"] = r["prompts_per_min"] / base[name.split("/")[0]]
        print(f"{name:<16}{r['prompts_per_min']:>12.1f}{r['speedup']:>10.2f}{r['tau']:>8.3f}  {r['same_as_bs1']}")
    out = {"args": {k: v for k, v in vars(args).items()}, "threads": torch.get_num_threads(), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    if not args.no_mlflow:
        from pipelines.common.tracking import tracked_run

        params = {"benchmark": args.benchmark, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens}
        with tracked_run(EXPERIMENT, run_name="bench_replay", params=params) as run:
            run.log_metrics(
                {f"{k.replace('/', '_')}_{m}": v for k, r in results.items() for m, v in r.items() if isinstance(v, float)}
            )
    if not all(r["same_as_bs1"] for r in results.values()):
        print("error: batched replay disagrees with batch size 1", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main, "bench_replay"))
