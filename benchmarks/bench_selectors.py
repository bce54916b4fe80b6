"""Select-phase cost per round and parameters of every trainable selector head, on one backbone.

Dims of the CPU default (smollm2-135m): D = 576, H = 15 slots, K = 16 candidates. The drafter is the
bundled checkpoint (checkpoints/<target>/, or --checkpoint); each head is built fresh at its default
config (DRelay at the shipped d_sel = 256) and its weights randomised (std 0.02 on every parameter,
so that no head short-cuts to the native path), or loaded from --trained LABEL=DIR (a checkpoint that
holds that head, e.g. a study run's drafter/). Batch 1, fp32, one block drafted after a ~200-token
verified context; per repetition all heads select on the same block, medians reported:
  select ms   selector.select(block, ctx): one round's select phase
  ÷ draft     select / drafter.draft(...) on the same block
  params      the head's trainable parameters (the frozen embedding is shared, not counted)

Run:  .venv/bin/python benchmarks/bench_selectors.py                 # 1 thread, ~1 min
      .venv/bin/python benchmarks/bench_selectors.py --trained dcoco=outputs/train/smollm2-135m-selectors-dcoco/drafter

On rounds recorded from real decoding instead of one block repeated (a cache that keeps work between
rounds, as DRelay's CPU fast path does, then pays what a real round pays): every head selects on the
same recorded rounds at each batch size (B request streams side by side, selector_rounds.batches),
the heads in turn on each round, thread CPU ms per round (medians over rounds and repetitions);
`drelay (reference)` is DRelay's reference path (`fast_path = False`) on the same rounds:
      .venv/bin/python benchmarks/bench_selector.py --record outputs/selector_rounds.pt --prompts 4
      .venv/bin/python benchmarks/bench_selectors.py --rounds outputs/selector_rounds.pt --batches 1,8,16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--checkpoint", help="drafter checkpoint (default: the bundled one)")
    p.add_argument("--trained", action="append", default=[], metavar="NAME=DIR", help="a trained head instead of a random one")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--rounds", metavar="FILE", help="time every head on the rounds recorded in FILE (bench_selector.py --record)")
    p.add_argument("--batches", default="1,8,16", help="with --rounds: batch sizes (request streams side by side)")
    args = p.parse_args()
    from pipelines.common.checkpoint_refs import resolve_ref

    args.checkpoint = args.checkpoint and resolve_ref(args.checkpoint)  # FOLDER@COMMIT too
    torch.set_num_threads(args.threads)

    from cli.options import parse_ints
    from drelay_model.decoding.history import VerifiedHistory
    from drelay_model.drafter import load_drafter
    from drelay_model.errors import DRelayError
    from drelay_model.selectors import SelectionContext, default_registry, trainable_selectors
    from drelay_model.target import load_target

    trained = {}
    for item in args.trained:
        name, eq, path = item.partition("=")
        path = resolve_ref(path) if eq and path else path  # FOLDER@COMMIT too
        if not eq or name not in trainable_selectors() or not Path(path).is_dir():
            raise DRelayError(
                f"--trained {item}: expected NAME=DIR with NAME one of {', '.join(trainable_selectors())} and DIR a checkpoint directory"
            )
        trained[name] = path
    if args.reps < 1 or args.threads < 1:
        raise DRelayError("--reps and --threads must be ≥ 1")
    batch_sizes = parse_ints(args.batches, "--batches", minimum=1) if args.rounds else ()
    if args.rounds and not Path(args.rounds).is_file():
        raise DRelayError(f"--rounds {args.rounds}: no such file (record one with benchmarks/bench_selector.py --record FILE)")
    target = load_target(args.target)
    drafter, _, _ = load_drafter(args.checkpoint or ROOT / "checkpoints" / args.target, target)
    drafter.eval()
    registry = default_registry()
    heads = {}
    for name in trainable_selectors():
        if name in trained:
            d, extra, meta = load_drafter(trained[name], target)
            heads[name] = registry.from_checkpoint(name, drafter=d, tensors=extra, meta=meta)
            continue
        torch.manual_seed(0)
        heads[name] = registry.create(
            name, drafter=drafter, config={"d_sel": 256, "heads": 4, "history_len": 64} if name == "drelay" else None
        )
        for param in heads[name].parameters():
            torch.nn.init.normal_(param, std=0.02)
        heads[name].eval()

    if args.rounds:
        return recorded(heads, trained, torch.load(args.rounds, weights_only=True), batch_sizes, args.reps)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (1, args.context), generator=g)
    cache = target.new_cache(1, args.context + 32)
    res = target(ids, cache, feature_layers=drafter.config.target_layer_ids)
    ctx_cache = drafter.new_context_cache(1, args.context + 32)
    drafter.extend_context(res.features, ctx_cache)
    hist = VerifiedHistory(1, 64, res.features.shape[-1])
    hist.push(res.features, torch.tensor([args.context]))
    anchor = ids[:, -1]
    ctx = SelectionContext(anchor_ids=anchor, anchor_pos=torch.tensor([args.context]), row_ids=torch.tensor([0]),
                           history=hist.feats, history_mask=hist.mask())  # fmt: skip
    draft_t, select_t = [], {n: [] for n in heads}
    with torch.inference_mode():
        for _ in range(args.reps):
            t0 = time.perf_counter()
            block = drafter.draft(anchor, ctx_cache)
            draft_t.append(time.perf_counter() - t0)
            for name, head in heads.items():
                t0 = time.perf_counter()
                head.select(block, ctx)
                select_t[name].append(time.perf_counter() - t0)
    draft = statistics.median(draft_t)
    print(f"{args.target}: drafter.draft {draft * 1e3:.2f} ms/round (median of {args.reps}, {args.threads} thread(s))")
    print("| selector | params | select ms/round | ÷ draft |\n|---|---|---|---|")
    for name, head in heads.items():
        s = statistics.median(select_t[name])
        n_params = sum(p.numel() for p in head.parameters())
        print(f"| {name}{' (trained)' if name in trained else ''} | {n_params:,} | {s * 1e3:.2f} | {s / draft:.2f} |")


def recorded(heads: dict, trained: dict, rounds: list[dict], batch_sizes: tuple[int, ...], reps: int) -> None:
    """Every head's select phase on recorded rounds: thread CPU ms per round, medians, per batch size."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import selector_rounds as sr

    from drelay_model.errors import DRelayError

    if max(batch_sizes) > len(rounds):
        raise DRelayError(
            f"--batches: {max(batch_sizes)} request streams need at least as many recorded rounds, the file has {len(rounds)}"
        )
    # (name, head, on DRelay's reference path): every head as served, then DRelay with `fast_path` off
    variants = [*((name, head, False) for name, head in heads.items()), ("drelay", heads["drelay"], True)]
    table = {}
    with torch.inference_mode():
        for B in batch_sizes:
            inputs = sr.batches(rounds, B)
            ms = [[] for _ in variants]
            for rep in range(reps + 1):  # the first pass warms every head's caches and is not counted
                for block, ctx in inputs:
                    for i, (_, head, reference) in enumerate(variants):
                        if reference:
                            head.fast_path = False
                        t0 = time.thread_time()
                        head.select(block, ctx)
                        if rep:
                            ms[i].append((time.thread_time() - t0) * 1e3)
                        if reference:
                            head.fast_path = True
            table[B] = [statistics.median(v) for v in ms]
            print(f"batch {B}: {len(inputs)} rounds × {reps} repetitions")
    head_row = " | ".join(f"batch {B}" for B in batch_sizes)
    print(f"| selector | params | select ms/round: {head_row} |\n|---|---|{'---|' * len(batch_sizes)}")
    for i, (name, head, reference) in enumerate(variants):
        n_params = sum(p.numel() for p in head.parameters())
        cells = " | ".join(f"{table[B][i]:.2f}" for B in batch_sizes)
        shown = f"{name}{' (trained)' if name in trained else ''}{' (reference)' if reference else ''}"
        print(f"| {shown} | {n_params:,} | {cells} |")


if __name__ == "__main__":
    from cli import guarded

    raise SystemExit(guarded(main, Path(__file__).name))
