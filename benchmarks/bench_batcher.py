"""The continuous batcher under a closed loop, in-process: what the endpoint's engine delivers
without HTTP, Ray Serve or a client process beside it.

C clients each keep one request in flight: a client submits its next GSM8K chat prompt on its last
request's final update (from the batcher's own callback, as the endpoint's clients do over HTTP), so
requests arrive while others still decode and rows finish at different rounds. Per method and
concurrency: output tokens/s over the whole loop (prefill included), τ, the rounds, the wall
time the batcher spends outside its rounds and admissions (joining and dropping rows, Python), and
the requests' time to first token, p50 / p99, with its parts (queue wait, prefill, first round:
`RequestStats`), the median of --repeats loops. An arm is a method at a prefill budget
(`--prefill-budget`, several to compare: prompt tokens per step, `none` = unbounded); arms alternate
within a repeat and every ratio is an arm ÷ its baseline at the same concurrency, from the same run
(the first method, or with several budgets the same method at the first budget):
tokens/s pooled over the repeats and TTFT p99 averaged over them, each with its paired 95% bootstrap
interval over the repeats (from 3 repeats; `pipelines.common.intervals`).

Run:  .venv/bin/python benchmarks/bench_batcher.py                                    # AR, DRelay; C = 4, 16; 48 requests of 64 tokens
      .venv/bin/python benchmarks/bench_batcher.py --concurrency 16 --requests 48 --repeats 2
      .venv/bin/python benchmarks/bench_batcher.py --methods ar native drelay --max-new-tokens 32
      .venv/bin/python benchmarks/bench_batcher.py --methods ar --concurrency 8 16 --prefill-budget none 512
      .venv/bin/python benchmarks/bench_batcher.py --methods ar --concurrency 16 --threads 1 --duty 0.5
                                  # beside a competitor busy half of every 10 ms (`bench_shared_cpu.py`'s)
Engines are built as the endpoint builds them (`build_engine`: cost-aware verification length,
the auto thread policy unless --threads N). Nothing else may run on the machine. Results: a table,
--out (JSON) and MLflow (experiment `drelay-benchmarks`, run `bench_batcher`) unless --no-mlflow.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cli import guarded  # noqa: E402
from deploy.serve.bench import percentile  # noqa: E402  (serve-bench's nearest-rank rule)
from drelay_model.decoding.admission import DEFAULT_PREFILL_BUDGET, check_budget  # noqa: E402
from drelay_model.errors import DRelayError  # noqa: E402
from pipelines.common.intervals import MIN_PAIRS, Interval, paired_rate_ratio, paired_ratio  # noqa: E402

TTFT_KEYS = ("ttft", "queue", "prefill", "first_round")  # RequestStats' time_to_first_token and its parts


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=["ar", "drelay"], help="ar or a registered selector; ratios ÷ the first")
    p.add_argument("--concurrency", nargs="+", type=int, default=[4, 16], help="clients in the closed loop")
    p.add_argument("--requests", type=int, default=48, help="requests per loop (GSM8K chat prompts)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="loops per (method, concurrency); the median is reported")
    p.add_argument("--threads", default="auto", help="the engine's thread policy: auto or a count")
    p.add_argument(
        "--prefill-budget", nargs="+", default=[str(DEFAULT_PREFILL_BUDGET)],
        help="prompt tokens prefilled per step, or none (unbounded); several: one arm each",
    )  # fmt: skip
    p.add_argument(
        "--duty", type=float, default=None, help="run every loop beside one competing process busy this share of every 10 ms"
    )
    p.add_argument("--out", default=str(REPO / "outputs" / "bench_batcher.json"))
    p.add_argument("--no-mlflow", action="store_true")
    args = p.parse_args(argv)
    for name in ("requests", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if args.duty is not None and not 0 < args.duty <= 1:
        p.error(f"--duty: a share in (0, 1], got {args.duty}")
    for c in args.concurrency:
        if not 1 <= c <= args.requests:
            p.error(f"--concurrency must be between 1 and --requests ({args.requests}), got {c}")
    try:
        args.budgets = [None if b == "none" else check_budget(int(b)) for b in args.prefill_budget]
    except (ValueError, DRelayError):
        p.error(f"--prefill-budget: positive token counts or none, got {' '.join(args.prefill_budget)}")
    return args


def closed_loop(batcher, prompts: list[list[int]], settings, concurrency: int) -> dict:
    """Decode every prompt with `concurrency` of them in flight, each finished request's client
    submitting the next; returns tokens, wall seconds, rounds, the batcher's own phase time, TTFT and
    its parts (p50, p99) and the inter-token latency (p50, p99, max: how long a decoding row waits for
    its next tokens, what a burst's prefill stalls)."""
    queue = list(prompts)
    tokens = 0
    firsts = []  # each request's RequestStats, on its final update
    last_token_at: dict[int, float] = {}  # request id → when its last tokens came out
    gaps = []  # inter-token latency: a decoding row's wait from one step's tokens to its next step's

    def on_update(update):
        nonlocal tokens
        tokens += len(update.new_tokens)
        if update.new_tokens:
            now = time.perf_counter()
            if update.request_id in last_token_at:
                gaps.append(now - last_token_at[update.request_id])
            last_token_at[update.request_id] = now
        if update.finished:
            firsts.append(update.stats)
        if update.finished and queue:
            batcher.submit(queue.pop(0), settings, on_update)

    for _ in range(concurrency):
        batcher.submit(queue.pop(0), settings, on_update)
    t0 = time.perf_counter()
    while not batcher.idle:
        batcher.step()
    wall = time.perf_counter() - t0
    stats = batcher.stats
    out = {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "rounds": stats.steps, "tau": stats.tau,
           "outside_s": wall - stats.time_total, "prefill_s": stats.time_prefill}  # fmt: skip
    parts = {"ttft": "time_to_first_token", "queue": "time_queue", "prefill": "time_prefill", "first_round": "time_first_round"}
    for key, name in parts.items():
        values = sorted(getattr(s, name) for s in firsts)
        out[f"{key}_p50_s"], out[f"{key}_p99_s"] = percentile(values, 50), percentile(values, 99)
    gaps.sort()  # none when every request ends on its first token (--max-new-tokens 1)
    itl = (percentile(gaps, 50), percentile(gaps, 99), gaps[-1]) if gaps else (math.nan,) * 3
    out["itl_p50_s"], out["itl_p99_s"], out["itl_max_s"] = itl
    return out


def competitor(duty: float | None):
    """One competing busy process for the block (`bench_shared_cpu.Competitor`), or nothing."""
    if duty is None:
        return contextlib.nullcontext()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_shared_cpu import Competitor

    return Competitor(duty)


def paired_ratios(runs: dict[str, dict[int, list[dict]]], base_of: dict[str, str]) -> dict[str, dict[int, dict[str, Interval]]]:
    """Each arm ÷ its baseline arm `base_of[arm]` per concurrency, paired by repeat: `tok_s` (Σ tokens ÷
    Σ seconds, the pooled rate) and `ttft_p99` (the mean of the repeats' p99s), each an Interval; its
    bounds are NaN below MIN_PAIRS repeats."""
    out: dict[str, dict[int, dict[str, Interval]]] = {}
    for arm, by_c in runs.items():
        out[arm] = {}
        for c, rs in by_c.items():
            bs = runs[base_of[arm]][c]
            col = lambda loops, k: [r[k] for r in loops]  # noqa: E731
            rate = paired_rate_ratio(col(rs, "tokens"), col(rs, "wall_s"), col(bs, "tokens"), col(bs, "wall_s"))
            ttft = paired_ratio(col(rs, "ttft_p99_s"), col(bs, "ttft_p99_s"))
            if len(rs) < MIN_PAIRS:
                rate, ttft = (Interval(iv.point, math.nan, math.nan) for iv in (rate, ttft))
            out[arm][c] = {"tok_s": rate, "ttft_p99": ttft}
    return out


def _ratio(iv: Interval) -> str:
    return f"{iv.point:.2f}×" if math.isnan(iv.low) else f"{iv.point:.2f}× [{iv.low:.2f}, {iv.high:.2f}]"


def print_table(table: dict, ratios: dict, baseline: str, args: argparse.Namespace) -> None:
    """The medians per arm and concurrency, with ÷ its baseline and the interval (adds each row's
    `ratio`, `ratio_low`, `ratio_high`, `ttft_p99_ratio`, …)."""
    print(f"\n{args.requests} GSM8K prompts, {args.max_new_tokens} tokens, greedy; medians of {args.repeats}; "
          f"ratios ÷ {baseline}, paired over the repeats [95%]")  # fmt: skip
    parts = "".join(f" {k + ' p50/p99':>19}" for k in TTFT_KEYS)
    print(f"{'arm':<12} {'C':>3} {'tok/s':>8} {'tok/s ÷':>22} {'TTFT p99 ÷':>22} {'τ':>5} {'outside s':>10}{parts}"
          f" {'ITL p50/p99/max':>22}")  # fmt: skip
    for arm, by_c in table.items():
        for c, r in by_c.items():
            rate, ttft = ratios[arm][c]["tok_s"], ratios[arm][c]["ttft_p99"]
            r.update(ratio=rate.point, ratio_low=rate.low, ratio_high=rate.high)
            r.update(ttft_p99_ratio=ttft.point, ttft_p99_ratio_low=ttft.low, ttft_p99_ratio_high=ttft.high)
            times = "".join(f" {r[f'{k}_p50_s']:>9.3f}/{r[f'{k}_p99_s']:<9.3f}" for k in TTFT_KEYS)
            print(f"{arm:<12} {c:>3} {r['tok_s']:>8.1f} {_ratio(rate):>22} {_ratio(ttft):>22} {r['tau']:>5.2f} "
                  f"{r['outside_s']:>10.2f}{times} {r['itl_p50_s']:>8.3f}/{r['itl_p99_s']:.3f}/{r['itl_max_s']:.3f}")  # fmt: skip


def main(argv=None) -> int:
    from drelay_model.decoding import GenerationConfig
    from drelay_model.decoding.batcher import ContinuousBatcher
    from drelay_model.kernels.threads import ThreadPolicy
    from drelay_model.target import load_target
    from drelay_model.target.loading import SMOLLM2
    from pipelines.common.engines import build_engine
    from pipelines.common.methods import resolve_method
    from pipelines.data.eval_sets import first_turn_prompts

    args = parse_args(argv)
    threads = ThreadPolicy.parse(args.threads)
    specs = {m: resolve_method(m, target_spec=SMOLLM2) for m in args.methods}  # bad names fail before loading
    target = load_target(SMOLLM2)
    prompts = first_turn_prompts(target.tokenizer, "gsm8k", args.requests)
    engines = {m: build_engine(target, spec, target_spec=SMOLLM2, max_batch=max(args.concurrency), threads=threads)
               for m, spec in specs.items()}  # fmt: skip
    settings = GenerationConfig(max_new_tokens=args.max_new_tokens)
    arms = [(m, b) for m in args.methods for b in args.budgets]
    label = {a: a[0] if len(args.budgets) == 1 else f"{a[0]}/{a[1] or 'none'}" for a in arms}
    runs: dict[str, dict[int, list[dict]]] = {label[a]: {c: [] for c in args.concurrency} for a in arms}
    with competitor(args.duty):
        for rep in range(args.repeats):
            for c in args.concurrency:
                for m, b in arms if rep % 2 == 0 else arms[::-1]:
                    r = closed_loop(ContinuousBatcher(engines[m], max_batch=c, prefill_budget=b), prompts, settings, c)
                    runs[label[m, b]][c].append(r)
                    print(f"repeat {rep + 1} C={c:<3} {label[m, b]:<12} {r['tok_s']:7.1f} tok/s  τ {r['tau']:.2f}  "
                          f"TTFT p50/p99 {r['ttft_p50_s']:.2f}/{r['ttft_p99_s']:.2f} s  ITL p99/max {r['itl_p99_s']:.2f}/{r['itl_max_s']:.2f} s  "
                          f"{r['rounds']} rounds  "
                          f"outside {r['outside_s']:.2f} s", flush=True)  # fmt: skip
    table = {
        m: {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in by_c.items()} for m, by_c in runs.items()
    }
    if len(args.budgets) > 1:
        base_of, baseline = {label[m, b]: label[m, args.budgets[0]] for m, b in arms}, "the same method's first budget"
    else:
        base_of, baseline = {label[a]: label[arms[0]] for a in arms}, label[arms[0]]
    print_table(table, paired_ratios(runs, base_of), baseline, args)
    result = {"args": vars(args), "table": {m: {str(c): r for c, r in by_c.items()} for m, by_c in table.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    if not args.no_mlflow:
        from pipelines.common.tracking import tracked_run

        params = {k: " ".join(map(str, v)) if isinstance(v, list) else v for k, v in vars(args).items()}
        with tracked_run("drelay-benchmarks", run_name="bench_batcher", params=params) as run:
            for m, by_c in table.items():
                for c, r in by_c.items():
                    run.log_metrics({f"{m}_c{c}_{k}": float(v) for k, v in r.items() if math.isfinite(v)})
    print(f"→ {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main, Path(__file__).name))
