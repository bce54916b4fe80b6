"""Where a CPU training step's time goes: target features, drafter (+ scout) forward, backward, optimizer.

    .venv/bin/python benchmarks/profile_train_step.py [--anchors 32 64 96] [--threads 1] [--seqs 1]
        [--checkpoint outputs/train/smollm2-135m-base/drafter] [--steps 5]
        [--feature-cache none disk] [--feature-dtypes fp32 bf16] [--step-dtype bf16] [--soft-labels 0 64]
        [--clock wall]

One process, no Ray: the shipped smollm2-135m config's drafter (from --checkpoint if given, else
fresh), random training batches of --seqs sequences, --steps timed steps after 2 warm-up steps, for
each --anchors value, feature precision, label kind (--soft-labels: 0 = hard labels, k = the
target's top-k, `train.soft_labels`) and feature source. The drafter step runs under bfloat16
autocast (`train.bf16: true`) unless --step-dtype fp32. Prints seconds per part and
blocks (anchors) per second — the number that says how much training signal a CPU second buys.

Feature sources: `none` runs the target forward every step (`data.feature_cache: none`); `disk`
first builds the disk cache for exactly the batches the timed steps will read (timed: the build
cost), then times steps that read features (and, with --soft-labels, the target's top-k) from it,
and prints the cache's bytes per token and its projected size and build time for the whole corpus
(`data.regenerated`: every sequence, training and held-out).

`--clock cpu` times with this process's CPU seconds instead of wall seconds: with one thread that is
the wall time of a quiet core, a figure that holds on a machine shared with other work (reads from
the page cache count; waits for a cold disk do not).
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--anchors", type=int, nargs="+", default=[32, 64, 96])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seqs", type=int, default=1, help="sequences per step")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--checkpoint", help="drafter checkpoint to start from (default: a fresh drafter)")
    p.add_argument("--feature-cache", nargs="+", choices=("none", "disk"), default=["none"], help="feature sources to time")
    p.add_argument("--feature-dtypes", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    p.add_argument("--step-dtype", choices=("fp32", "bf16"), default="bf16", help="the drafter step's autocast")
    p.add_argument("--soft-labels", type=int, nargs="+", default=[0], help="0: hard labels; k: the target's top-k (1..64)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall seconds, or this process's CPU seconds")
    p.add_argument("--cache-dir", help="where the fresh disk cache folder goes (default: the system's temporary folder)")
    args = p.parse_args()
    if not all(0 <= k <= 64 for k in args.soft_labels):
        p.error("--soft-labels: each value must be in 0..64 (0: hard labels)")
    return args


def _batches(train: list, seqs: int, steps: int) -> list[list]:
    """The step batches (2 warm-up + timed), the same for every source and precision."""
    rng = random.Random(0)
    return [rng.sample(train, seqs) for _ in range(steps + 2)]


def _build_cache(source, batches: list[list], clock) -> dict[str, float]:
    """Fill the disk cache for `batches` (every sequence once); → its build cost and size per token."""
    seqs = list({s.seq_id: s for batch in batches for s in batch}.values())
    t0 = clock()
    for s in seqs:
        source.batch([s])
    seconds = clock() - t0
    tokens = sum(len(s.input_ids) for s in seqs)
    response = sum(len(s.input_ids) - s.response_start for s in seqs)
    feature_bytes = sum(p.stat().st_size for p in source.dir.glob("*.pt") if ".top" not in p.name)
    top_bytes = sum(p.stat().st_size for p in source.dir.glob("*.top*.pt"))
    return {"seconds_per_token": seconds / tokens, "feature_bytes_per_token": feature_bytes / tokens,
            "top_bytes_per_response_token": top_bytes / response, "response_share": response / tokens}  # fmt: skip


def _report_cache(stats: dict[str, float], corpus: list) -> None:
    tokens = sum(len(s.input_ids) for s in corpus)
    response = sum(len(s.input_ids) - s.response_start for s in corpus)
    size = stats["feature_bytes_per_token"] * tokens + stats["top_bytes_per_response_token"] * response
    per_response = size / response
    print(
        f"  cache: {stats['feature_bytes_per_token']:.0f} B/token features + {stats['top_bytes_per_response_token']:.0f} B/response "
        f"token top-k = {per_response:.0f} B per response token on this corpus; built at {1e3 * stats['seconds_per_token']:.2f} ms/token\n"
        f"  whole corpus ({len(corpus)} sequences, {tokens / 1e6:.2f}M tokens, {response / 1e6:.2f}M response): "
        f"{size / 2**30:.1f} GiB, built in {stats['seconds_per_token'] * tokens / 3600:.1f} h on this thread count",
        flush=True,
    )


def _time_steps(module, optimizer, source, batches, step_cfg, *, clock, step_bf16: bool) -> tuple[list[float], int, float]:
    """→ (seconds per part summed over the timed steps, blocks, share of response positions whose
    top-1 equals the stored label)."""
    from drelay_model.training.step import training_step
    from pipelines.train.data import collate

    gen = torch.Generator().manual_seed(0)
    totals, blocks, agree, counted = [0.0] * 4, 0, 0, 0
    for i, batch in enumerate(batches):
        ids, mask = collate(batch)
        t0 = clock()
        got = source.batch(batch)
        t1 = clock()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=step_bf16):
            out = training_step(module, module, ids, mask, got.features, step_cfg, gen, soft=got.soft)
        t2 = clock()
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        t3 = clock()
        optimizer.step()
        t4 = clock()
        if i >= 2:
            totals = [a + b for a, b in zip(totals, (t1 - t0, t2 - t1, t3 - t2, t4 - t3))]
            blocks += int(out.metrics["anchors"])
        if got.soft is not None:
            agree += int(((got.soft.ids[..., 0] == ids) & mask).sum())
            counted += int(mask.sum())
    return totals, blocks, agree / max(counted, 1)


def main() -> None:
    args = _args()
    torch.set_num_threads(args.threads)

    from drelay_model.target import load_target
    from drelay_model.training.step import DraftTrainModule
    from pipelines.train.config import load_config
    from pipelines.train.features import FeatureSource
    from pipelines.train.model_io import build_module
    from pipelines.train.worker import load_data, step_config

    overrides = [f"drafter.init_checkpoint={args.checkpoint}"] if args.checkpoint else []
    cfg = load_config(ROOT / "platform/experiments/smollm2-135m/train.yaml", overrides)
    target = load_target(cfg.target.spec, dtype=torch.float32)
    train, val = load_data(cfg, target)
    module: DraftTrainModule = build_module(cfg, target, train)
    optimizer = torch.optim.AdamW([q for q in module.parameters() if q.requires_grad], lr=1e-5)
    layers = module.drafter.config.target_layer_ids
    batches = _batches(train, args.seqs, args.steps)
    cache_root = Path(tempfile.mkdtemp(prefix="feature_cache_", dir=args.cache_dir))  # always empty: the build is timed
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(
        f"threads {args.threads}; {args.seqs} sequence(s)/step; step {args.step_dtype}; {args.clock} clock; cache in {cache_root}"
    )
    print("anchors | features | labels | source | features s | forward s | backward s | optimizer s | blocks/s")
    built: set[tuple[str, int]] = set()  # (precision, k): the cache is built, and its build timed, once
    for anchors in args.anchors:
        step_cfg = step_config(cfg.model_copy(update={"train": cfg.train.model_copy(update={"anchors_per_seq": anchors})}), 0.5)
        for dtype, k, kind in itertools.product(args.feature_dtypes, args.soft_labels, args.feature_cache):
            disk = cache_root / f"{dtype}-top{k}" if kind == "disk" else None
            source = FeatureSource(target, layers, disk, bf16=dtype == "bf16", soft_k=k or None)
            stats = None
            if disk is not None and (dtype, k) not in built:
                built.add((dtype, k))
                stats = _build_cache(source, batches, clock)
            totals, blocks, agree = _time_steps(
                module, optimizer, source, batches, step_cfg, clock=clock, step_bf16=args.step_dtype == "bf16"
            )
            parts = " | ".join(f"{x / args.steps:.3f}" for x in totals)
            labels = f"top{k}" if k else "hard"
            print(f"{anchors:>7} | {dtype} | {labels} | {kind} | {parts} | {blocks / sum(totals):.1f}", flush=True)
            if k:
                print(f"  top-1 of the feature forward = the stored greedy label at {100 * agree:.2f}% of response positions")
            if stats is not None:
                _report_cache(stats, train + val)


if __name__ == "__main__":
    from cli import guarded

    raise SystemExit(guarded(main, Path(__file__).name))
