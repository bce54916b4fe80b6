"""Engine benchmark on the CPU target smollm2-135m (greedy decoding, fp32).

What it measures, in one run (a shared 2-core machine is noisy, so every comparison is made side by
side: the two contenders alternate within each repetition and we report medians of paired ratios):
  1. AR tokens/s of our engine vs Hugging Face `generate()`: 8 chat prompts (one per evaluation
     benchmark), 128 new tokens, batch 1 (one prompt at a time, the latency setting) and batched
     (all prompts in one call; HF gets left padding + attention mask). Also checks that our greedy
     tokens equal HF's, token for token. Wall time includes prefill for both.
  2. Verification cost: one target forward of T=16 vs T=1 new tokens on a ~200-token cached context
     (cropped back after every call), median over reps.
  3. Speculative engine overhead per round: an untrained drafter (τ≈1, fine for timing) + the
     `native` selector; ms per step for draft / select / verify / other and
     overhead% = (select + other) / step time.

Run:  .venv/bin/python benchmarks/bench_engine.py               # full run, torch threads = cores
      .venv/bin/python benchmarks/bench_engine.py --threads 1   # ~11-13 min here; see docs/benchmarks.md
      .venv/bin/python benchmarks/bench_engine.py --quick       # smoke run (2 prompts, 32 tokens)
With 2 threads on 2 cores, any other busy process stalls every OpenMP parallel region (5-20x slower
ops), so on a shared machine compare runs with the same --threads and check `other_processes_cpu_pct`.
Figures go to --out (JSON) and to MLflow (experiment `drelay-benchmarks`, via pipelines.common.tracking:
$MLFLOW_TRACKING_URI, else sqlite:///<repo>/outputs/mlflow.db; the run is always ended, FAILED on
error, and tagged with the git commit) unless --no-mlflow.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipelines.common.tracking import git_commit, tracked_run  # noqa: E402

EXPERIMENT = "drelay-benchmarks"
median = statistics.median


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 prompts, 32 new tokens, 1 rep")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--reps", type=int, default=None, help="AR repetitions (default 3; 1 with --quick)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads (default: all cores)")
    p.add_argument("--no-batched", action="store_true", help="skip the batched AR comparison")
    p.add_argument("--out", default=str(REPO / "outputs" / "bench_engine.json"))
    p.add_argument("--no-mlflow", action="store_true")
    args = p.parse_args()
    args.n_prompts, args.max_new_tokens = (2, 32) if args.quick else (8, 128)
    args.reps = args.reps or (1 if args.quick else 3)
    return args


def machine_info(threads: int) -> dict:
    cpu = next(
        (l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name")),
        platform.processor() or "unknown",
    )
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "torch_threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def contention(meter, wall: float) -> dict:
    """Share of the machine's CPU capacity used by *other* processes since `meter` started."""
    return {
        "other_processes_cpu_pct": round(100 * meter.other_share(), 1),
        "loadavg_1min_end": os.getloadavg()[0],
        "bench_wall_s": round(wall, 1),
    }


def chat_prompts(target, n: int) -> list[list[int]]:
    """The first turn of one seeded prompt per benchmark, chat-templated."""
    from pipelines.common.chat import user_prompt
    from pipelines.data.eval_sets import BENCHMARKS, load_benchmark

    return [user_prompt(target.tokenizer, load_benchmark(name, limit=1)[0].turns[0]) for name in BENCHMARKS[:n]]


# ---- 1. AR: ours vs Hugging Face ---------------------------------------------------------------
def run_ours(engine, prompts, max_new: int) -> tuple[list[list[int]], float, object]:
    from drelay_model.decoding import GenerationConfig

    t0 = time.perf_counter()
    res = engine.generate(prompts, GenerationConfig(max_new_tokens=max_new, temperature=0.0))
    return res.tokens, time.perf_counter() - t0, res.stats


def run_hf(target, prompts, max_new: int) -> tuple[list[list[int]], float]:
    """HF greedy generate; several prompts are left-padded. Rows are cut after their first EOS."""
    pad, eos = target.tokenizer.pad_token_id, list(target.eos_token_ids)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = target.hf.generate(
            ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=pad, eos_token_id=eos
        )
    seconds = time.perf_counter() - t0
    rows = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows, seconds


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_ar(target, engine, prompts, max_new: int, reps: int, batched: bool) -> dict:
    """Alternate ours/HF (order flipped every rep); batch 1 runs prompt by prompt."""
    groups = [prompts] if batched else [[p] for p in prompts]
    label = f"AR batch={len(prompts)}" if batched else "AR batch=1"
    per_rep, ours_tokens, hf_tokens, ours_stats = [], [], [], []
    for rep in tqdm(range(reps), desc=label):
        secs, counts = {"ours": 0.0, "hf": 0.0}, {"ours": 0, "hf": 0}
        for group in tqdm(groups, desc="prompts", leave=False):
            order = ("ours", "hf") if rep % 2 == 0 else ("hf", "ours")
            for who in order:
                if who == "ours":
                    toks, s, stats = run_ours(engine, group, max_new)
                    ours_stats.append(stats)
                else:
                    toks, s = run_hf(target, group, max_new)
                secs[who] += s
                counts[who] += sum(len(t) for t in toks)
                if rep == 0:
                    (ours_tokens if who == "ours" else hf_tokens).extend(toks)
        per_rep.append({k: counts[k] / secs[k] for k in secs})
    mismatches = [first_mismatch(a, b) for a, b in zip(ours_tokens, hf_tokens)]
    steps = sum(s.steps for s in ours_stats)
    return {
        "batch_size": len(groups[0]),
        "ours_tok_s": median(r["ours"] for r in per_rep),
        "hf_tok_s": median(r["hf"] for r in per_rep),
        "ratio": median(r["ours"] / r["hf"] for r in per_rep),
        "per_rep_tok_s": per_rep,
        "tokens_equal": [m is None for m in mismatches],
        "first_mismatch": mismatches,
        "ours_ms_verify_per_step": 1e3 * sum(s.time_verify for s in ours_stats) / steps,
        "ours_ms_other_per_step": 1e3 * sum(s.time_other for s in ours_stats) / steps,
    }


# ---- 2. verification cost: T=16 vs T=1 ---------------------------------------------------------
def verify_cost(target, prompts, context: int = 200, reps: int = 20, widths=(1, 16)) -> dict:
    """Median ms of one target forward of T new tokens on a `context`-token cache (A B A B)."""
    ctx = [t for p in prompts * 4 for t in p][:context]
    cache = target.new_cache(1, context + max(widths) + 1)
    target(torch.tensor([ctx]), cache)
    new = torch.tensor([ctx[: max(widths)]])
    times = {w: [] for w in widths}
    for _ in tqdm(range(reps + 2), desc="verify T=1 vs T=16"):
        for w in widths:
            t0 = time.perf_counter()
            target(new[:, :w], cache)
            times[w].append(time.perf_counter() - t0)
            cache.crop(cache.lengths - w)
    ms = {w: 1e3 * median(t[2:]) for w, t in times.items()}  # the first 2 reps are warm-up
    lo, hi = min(widths), max(widths)
    paired = median(b / a for a, b in zip(times[lo][2:], times[hi][2:]))
    return {
        "context": len(ctx),
        "reps": reps,
        **{f"ms_T{w}": v for w, v in ms.items()},
        "ratio": ms[hi] / ms[lo],
        "ratio_paired_median": paired,
    }


# ---- 3. speculative engine overhead ------------------------------------------------------------
def spec_overhead(target, prompts, max_new: int) -> dict:
    """Untrained drafter + native selector, batch 1, summed over prompts."""
    from drelay_model.decoding import SpeculativeEngine
    from drelay_model.drafter import BlockDrafter, DrafterConfig
    from drelay_model.selectors import NativeSelector

    torch.manual_seed(0)
    drafter = BlockDrafter(DrafterConfig.for_target(target), target).eval()
    engine = SpeculativeEngine(target, drafter, NativeSelector())
    run_ours(engine, prompts[:1], 4)  # warm-up
    phases = {"draft": 0.0, "select": 0.0, "verify": 0.0, "other": 0.0}
    steps = committed = rounds = 0
    for p in tqdm(prompts, desc="speculative (native)"):
        _, _, stats = run_ours(engine, [p], max_new)
        for k in phases:
            phases[k] += getattr(stats, f"time_{k}")
        steps, committed, rounds = steps + stats.steps, committed + stats.committed, rounds + stats.rounds
    ms = {f"ms_{k}": 1e3 * v / steps for k, v in phases.items()}
    step_ms = sum(ms.values())
    return {
        "block_size": drafter.config.block_size,
        "steps": steps,
        "tau": committed / rounds,
        **ms,
        "ms_step": step_ms,
        "overhead_pct": 100 * (ms["ms_select"] + ms["ms_other"]) / step_ms,
    }


# ---- reporting ---------------------------------------------------------------------------------
def print_report(r: dict) -> None:
    m = r["machine"]
    print(
        f"\nmachine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads); "
        f"other processes used {m['other_processes_cpu_pct']}% of the CPU during the run"
    )
    for key in ("ar_batch1", "ar_batched"):
        if key in r:
            a = r[key]
            eq = sum(a["tokens_equal"])
            print(
                f"AR batch={a['batch_size']}: ours {a['ours_tok_s']:.1f} tok/s | HF {a['hf_tok_s']:.1f} tok/s | "
                f"ratio {a['ratio']:.2f}x | tokens equal to HF: {eq}/{len(a['tokens_equal'])} "
                f"(first mismatch per prompt: {a['first_mismatch']})"
            )
    v = r["verify"]
    print(
        f"verify on {v['context']} cached tokens: T=1 {v['ms_T1']:.1f} ms | T=16 {v['ms_T16']:.1f} ms | "
        f"ratio {v['ratio']:.2f}x (paired median {v['ratio_paired_median']:.2f}x)"
    )
    s = r["spec_native"]
    print(
        f"speculative (native, untrained drafter, tau {s['tau']:.2f}) ms/step: draft {s['ms_draft']:.1f} | "
        f"select {s['ms_select']:.2f} | verify {s['ms_verify']:.1f} | other {s['ms_other']:.2f} | "
        f"step {s['ms_step']:.1f} | overhead {s['overhead_pct']:.2f}%"
    )


def flat_metrics(d: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_metrics(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = float(v)
        elif isinstance(v, list) and v and all(isinstance(x, bool) for x in v):
            out[f"{prefix}{k}_count"] = float(sum(v))
    return out


def measure(args) -> dict:
    from drelay_model.decoding import SpeculativeEngine
    from drelay_model.target import load_target

    target = load_target(args.target)
    prompts = chat_prompts(target, args.n_prompts)
    print(f"{len(prompts)} prompts, lengths {[len(p) for p in prompts]}, {args.max_new_tokens} new tokens")
    engine = SpeculativeEngine(target)
    run_ours(engine, prompts[:1], 4)  # warm-up
    run_hf(target, prompts[:1], 4)
    report = {"ar_batch1": compare_ar(target, engine, prompts, args.max_new_tokens, args.reps, batched=False)}
    if not args.no_batched:
        report["ar_batched"] = compare_ar(target, engine, prompts, args.max_new_tokens, args.reps, batched=True)
    report["verify"] = verify_cost(target, prompts)
    report["spec_native"] = spec_overhead(target, prompts, args.max_new_tokens)
    return report


def main() -> int:
    from transformers.utils import logging as hf_logging

    args = parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    machine = machine_info(torch.get_num_threads())
    print(f"torch {machine['torch']} | threads {machine['torch_threads']} | CPU {machine['cpu']} ({machine['cores']} cores)")
    params = {
        "target": args.target,
        "quick": args.quick,
        "n_prompts": args.n_prompts,
        "reps": args.reps,
        "max_new_tokens": args.max_new_tokens,
        "batched": not args.no_batched,
    }
    if args.no_mlflow:
        run_and_save(args, machine, params, None)
        return 0
    with tracked_run(
        EXPERIMENT,
        run_name="bench_engine" + ("-quick" if args.quick else ""),
        tags={"git_commit": git_commit(), "benchmark": "engine"},
        params={**params, **machine},
    ) as run:
        run_and_save(args, machine, params, run)
        print(f"MLflow run {run.run_id} in experiment '{EXPERIMENT}'")
    return 0


def run_and_save(args, machine: dict, params: dict, run) -> None:
    """Measure, print, write the JSON and (if `run`) log metrics + the JSON to MLflow."""
    from pipelines.eval.timing import CpuMeter

    meter, t0 = CpuMeter(), time.perf_counter()
    figures = measure(args)
    machine.update(contention(meter, time.perf_counter() - t0))
    report = {"machine": machine, "params": params, **figures}
    print_report(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    if run is not None:
        run.log_metrics(flat_metrics(figures))
        run.log_params({k: machine[k] for k in ("other_processes_cpu_pct", "loadavg_1min_end", "bench_wall_s")})
        run.log_artifact(out)


if __name__ == "__main__":
    from cli import guarded

    raise SystemExit(guarded(main, Path(__file__).name))
