"""End-to-end speedup S on the eight benchmarks: fixed vs cost-aware verification length.

Batch 1, greedy, the bundled drafter, one engine for AR and speculative decoding. Every prompt is
decoded by each contender back to back, `--repeats` times in mirrored order (A B C … C B A: a
machine speeding up or slowing down steadily shifts every contender's mean time alike; the first
contender rotates per prompt), so a busy machine slows all of them alike. S per prompt = AR seconds
÷ method seconds, summed over the repeats (the outputs are identical — lossless — and the script
checks it), and S per benchmark is the median of these paired ratios, with their min–max. The other processes' CPU share during the run is printed and logged.

Intervals: the mean over benchmarks of each benchmark's mean paired ratio, with a 95% stratified
bootstrap over prompts within benchmark (`pipelines/common/intervals.py`), for each contender against
AR and for each speculative contender against the first one at the same length (DRelay ÷ native:
native seconds ÷ DRelay seconds, paired by prompt). One prompt per benchmark gives no interval, two a wide one;
`--limit 4` or more resolves a few percent.

The cost curve for cost-aware length is the one `drelay costs` measures and caches (per target,
checkpoint, method, threads, device and its processor model, packed linears and what the drafter runs
below float32: `drelay_model.decoding.cost_policy.cache`); --remeasure redoes it.

Run:  .venv/bin/python benchmarks/bench_speedup.py                         # 2 prompts × 8 benchmarks × 128 tokens
      .venv/bin/python benchmarks/bench_speedup.py --limit 1 --max-new-tokens 64 --benchmarks gsm8k,mt_bench
Results go to --out (JSON) and MLflow (experiment `drelay-benchmarks`) unless --no-mlflow.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from drelay_model.decoding import DecodeStats, GenerationConfig  # noqa: E402
from cli import guarded  # noqa: E402

ALL = "gsm8k,math500,aime25,humaneval,mbpp,livecodebench,mt_bench,alpaca"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--checkpoint", default=None, help="drafter checkpoint (default: the bundled one)")
    p.add_argument("--benchmarks", default=ALL)
    p.add_argument("--limit", type=int, default=2, help="prompts per benchmark")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="decodes per prompt and contender, in mirrored order")
    p.add_argument("--methods", default="native,drelay")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--remeasure", action="store_true", help="measure the cost curve again")
    p.add_argument("--out", default=str(REPO / "outputs" / "bench_speedup.json"))
    p.add_argument("--no-mlflow", action="store_true")
    args = p.parse_args(argv)
    if args.limit < 1 or args.max_new_tokens < 1 or args.threads < 1 or args.repeats < 1:
        p.error("--limit, --max-new-tokens, --repeats and --threads must be positive")
    return args


def timed(engine, prompt, max_new: int):
    """(tokens, seconds, τ, stats) of one decode."""
    t0 = time.perf_counter()
    res = engine.generate([prompt], GenerationConfig(max_new_tokens=max_new))
    return res.tokens[0], time.perf_counter() - t0, res.stats.tau, res.stats


# a benchmark of one prompt has no spread to resample: its interval would have zero width
MIN_PROMPTS_FOR_INTERVAL = 2


def paired_intervals(seconds: dict[str, dict[str, list[float]]], names: list[str]) -> dict:
    """seconds[benchmark][contender] per prompt (names[0] is AR) → {"A ÷ B": Interval} of the mean over
    benchmarks of each benchmark's mean paired ratio (B's seconds ÷ A's: A's speedup over B), for
    every contender over AR and every speculative one over the first at the same length. Empty when
    a benchmark holds fewer than MIN_PROMPTS_FOR_INTERVAL prompts."""
    import numpy as np

    if any(len(per[names[0]]) < MIN_PROMPTS_FOR_INTERVAL for per in seconds.values()):
        return {}

    from pipelines.common.intervals import paired_bootstrap

    first = names[1].split("/")[0]  # the first speculative method (native by default)
    pairs = [(n, names[0]) for n in names[1:]]
    pairs += [(n, f"{first}/{n.split('/')[1]}") for n in names[1:] if not n.startswith(f"{first}/")]

    def mean_of_means(means: list[np.ndarray]) -> np.ndarray:  # per benchmark [..., 1] → [...]
        return sum(m[..., 0] for m in means) / len(means)

    out = {}
    for a, b in pairs:
        groups = [np.asarray([sb / sa for sa, sb in zip(per[a], per[b])]).reshape(-1, 1) for per in seconds.values()]
        out[f"{a} ÷ {b}"] = paired_bootstrap(groups, mean_of_means)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from pipelines.common.engines import build_engine
    from pipelines.common.methods import AR, MethodSpec, load_method, load_target_spec, resolve_method
    from pipelines.eval.timing import CpuMeter
    from pipelines.data.eval_sets import load_benchmark
    from pipelines.eval.prompts import encoder_for

    target = load_target_spec(args.target)
    encoder = encoder_for(target)
    engines = {"ar": build_engine(target, MethodSpec(AR), target_spec=args.target)}
    for method in args.methods.split(","):
        spec = resolve_method(method, target_spec=args.target, checkpoint=args.checkpoint)
        parts = load_method(spec, target)  # one drafter and selector for both lengths
        for length in ("fixed", "cost"):
            engines[f"{method}/{length}"] = build_engine(
                target, spec, length, target_spec=args.target, method=parts, remeasure=args.remeasure
            )
    names = list(engines)
    seconds_by = {b: {n: [] for n in names} for b in args.benchmarks.split(",")}  # per prompt, summed over the repeats
    taus = {b: {n: [] for n in names[1:]} for b in seconds_by}
    decodes = {n: [] for n in names}  # every prompt's DecodeStats, merged for ms per round by phase
    meter, t_start = CpuMeter(), time.perf_counter()
    for bench in seconds_by:
        prompts = [encoder.encode(p.turns[:1], []) for p in load_benchmark(bench, limit=args.limit)]
        for i, prompt in enumerate(tqdm(prompts, desc=bench)):
            order = names[i % len(names) :] + names[: i % len(names)]  # rotate who goes first
            runs = {n: [] for n in names}
            for r in range(args.repeats):  # A B C … then C B A …
                for n in order if r % 2 == 0 else order[::-1]:
                    runs[n].append(timed(engines[n], prompt, args.max_new_tokens))
            seconds = {n: sum(run[1] for run in runs[n]) for n in names}
            for n in names:
                decodes[n].extend(run[3] for run in runs[n])
                seconds_by[bench][n].append(seconds[n])
            for n in names[1:]:
                if any(run[0] != runs["ar"][0][0] for run in runs[n]):
                    print(f"error: {n} output differs from AR on {bench} prompt {i}", file=sys.stderr)
                    return 1
                taus[bench][n].append(runs[n][0][2])
    wall = time.perf_counter() - t_start
    other_pct = 100 * meter.other_share()
    ratios = {b: {n: [a / m for a, m in zip(per["ar"], per[n])] for n in names[1:]} for b, per in seconds_by.items()}
    table = {b: {n: {"S": statistics.median(r), "S_min": min(r), "S_max": max(r), "tau": statistics.mean(taus[b][n])}
                 for n, r in per.items()} for b, per in ratios.items()}  # fmt: skip
    mean = {n: statistics.mean(table[b][n]["S"] for b in table) for n in names[1:]}
    print(f"\nS = AR time ÷ method time, median of paired per-prompt ratios (other processes: {other_pct:.0f}% CPU)")
    print(f"{'benchmark':<14}" + "".join(f"{n:>16}" for n in names[1:]))
    for b, row in table.items():
        print(f"{b:<14}" + "".join(f"{row[n]['S']:>9.2f} τ{row[n]['tau']:<5.2f}" for n in names[1:]))
    print(f"{'mean':<14}" + "".join(f"{mean[n]:>16.2f}" for n in names[1:]))
    intervals = paired_intervals(seconds_by, names)
    if intervals:
        print("\nmean over benchmarks of the mean paired ratio, 95% stratified bootstrap over prompts:")
        for label, iv in intervals.items():
            print(f"  {label:<28} {iv.format(3)}")
    else:
        print(f"\nno intervals: they need --limit ≥ {MIN_PROMPTS_FOR_INTERVAL} (a benchmark of one prompt has no spread)")
    phases = {n: DecodeStats.merged(parts) for n, parts in decodes.items()}
    per_round = {n: st.breakdown_ms_per_step() | {"rounds_per_token": st.steps / max(st.generated, 1),
                                                   "drafted_share": st.drafted_steps / max(st.steps, 1),
                                                   "selector_share": st.selector_steps / max(st.drafted_steps, 1)}
                 for n, st in phases.items()}  # fmt: skip
    print(
        "\nms per round by phase, all prompts (draft = drafter + context extension; other = the engine's own work;"
        " drafted = share of rounds that drafted, selector = share of those that ran the selector)"
    )
    print(
        f"{'engine':<14}"
        + "".join(f"{k:>9}" for k in ("draft", "select", "verify", "other"))
        + f"{'ms/token':>10}{'drafted':>9}{'selector':>9}"
    )
    for n, row in per_round.items():
        ms_token = sum(row[k] for k in ("draft", "select", "verify", "other")) * row["rounds_per_token"]
        print(
            f"{n:<14}"
            + "".join(f"{row[k]:>9.2f}" for k in ("draft", "select", "verify", "other"))
            + f"{ms_token:>10.2f}{row['drafted_share']:>9.0%}{row['selector_share']:>9.0%}"
        )
    out = {"args": vars(args), "table": table, "mean_S": mean, "phases_ms_per_round": per_round,
           "intervals": {k: {"point": v.point, "low": v.low, "high": v.high} for k, v in intervals.items()},
           "other_processes_cpu_pct": other_pct, "wall_s": wall}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    if not args.no_mlflow:
        from pipelines.common.tracking import tracked_run

        params = {k: v for k, v in vars(args).items() if k != "out"}
        with tracked_run("drelay-benchmarks", run_name="bench_speedup", params=params) as run:
            run.log_metrics({f"S_{n.replace('/', '_')}_{b}": row[n]["S"] for b, row in table.items() for n in names[1:]})
            run.log_metrics(
                {f"S_mean_{n.replace('/', '_')}": v for n, v in mean.items()} | {"other_processes_cpu_pct": other_pct}
            )
            for label, iv in intervals.items():
                run.log_metrics(iv.as_dict("ratio_" + label.replace(" ÷ ", "_over_").replace("/", "_")))
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main, "bench_speedup"))
