"""Partial blocks: under cost-aware verification a round verifies L ≤ H drafts. A partial-block
selector is served a block of L drafted slots (what the engine drafts today: the drafter's block is
the anchor and L masked positions), so DRelay's Global Read reads a shorter block than the H-slot
blocks it was trained on, and the drafter's own bidirectional block changes too. The alternative
drafts the whole block for the selector and verifies L of it. Which pays?

    .venv/bin/python analysis/partial_blocks.py --compare-dir outputs/compare/headline-s0 \
        [--checkpoint checkpoints/smollm2-135m] [--lengths 2,4,8] [--benchmarks all] [--limit 4]
        [--methods drelay,native]     # a drafter-only checkpoint (no DRelay head): --methods native

For each method (the checkpoint's DRelay head and the native argmax, as a control for the drafter's
part), each L and each way to draft (partial: L slots; full: H), greedy replay at a fixed verification
length (`replay(verify_slots=L, head_slots=…)`) over the target's cached continuations of a `drelay
compare` run (its cells/ folder: same prompts, no target decoding here). Prints τ per cell, full ÷
partial with its paired 95% bootstrap interval over prompts (stratified by benchmark), and the round
cost of each way at batch 1 — the draft, the select phase and the verify forward, thread CPU ms
(medians, one torch thread, on a real block of the first prompt) — and the tokens per ms it gives:
τ_L ÷ (draft + select + verify(1 + L)). Writes partial_blocks.json and .md to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from drelay_model.errors import DRelayError  # noqa: E402

METHODS = ("drelay", "native")


def parse_lengths(text: str, H: int) -> list[int]:
    try:
        lengths = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise DRelayError(f"--lengths: comma-separated integers, got {text!r}") from None
    if not lengths or lengths[0] < 1 or lengths[-1] >= H:
        raise DRelayError(f"--lengths: each L in 1..{H - 1} (at L = H = {H} the two ways are the same), got {text!r}")
    return lengths


def replay_inputs(compare_dir: Path, benchmarks: tuple[str, ...], limit: int | None, seed: int, encoder):
    """{benchmark: (prompt ids, continuations)} from a compare run's cached AR cells."""
    from pipelines.data.eval_sets import load_benchmarks
    from pipelines.eval.results import cell_store

    prompts = load_benchmarks(benchmarks, limit=limit, seed=seed)
    store = cell_store(compare_dir)
    out = {}
    for bench, items in prompts.items():
        path = store.path(bench, "ar")
        if not path.is_file():
            raise DRelayError(f"{path}: no cached AR cell for {bench} (run `drelay compare` into {compare_dir} first)")
        outputs = json.loads(path.read_text())["outputs"]
        ids, conts = [], []
        for p in items:
            answers = outputs.get(p.prompt_id)
            if answers is None:
                raise DRelayError(f"{path}: no output for prompt {p.prompt_id!r}; use the run's --limit/--subset-seed")
            for turn, cont in enumerate(answers):
                ids.append(encoder.encode(p.turns[: turn + 1], answers[:turn]))
                conts.append(cont)
        out[bench] = (ids, conts)
    return out


def replay_counts(target, drafter, selector, ids, conts, L: int, heads: int) -> np.ndarray:
    """[n, 2] (committed, rounds) per prompt turn at a fixed verification length."""
    from drelay_model.decoding import replay
    from pipelines.common.replay_counts import ReplayCounts

    counts = ReplayCounts(len(ids))
    replay(target, drafter, ids, conts, selector=selector, on_round=counts.add, verify_slots=L, head_slots=heads)
    return np.array([counts.committed, counts.rounds], dtype=float).T


def full_over_partial(groups: list[np.ndarray]):
    """Mean over benchmarks of τ(full) ÷ the same of τ(partial); columns (c_full, r_full, c_part, r_part)."""
    from pipelines.common.intervals import paired_bootstrap

    def stat(means):
        full = np.mean([m[..., 0] / m[..., 1] for m in means], axis=0)
        part = np.mean([m[..., 2] / m[..., 3] for m in means], axis=0)
        return full / part

    return paired_bootstrap(groups, stat)


@torch.inference_mode()
def round_costs(target, drafter, selector, prompt: list[int], lengths: list[int], reps: int) -> dict[str, float]:
    """Thread CPU ms (median of `reps`) at batch 1: draft(h) and select(L on an h-slot block) for h in
    {L, H}, and verify(1 + L), on the first prompt's context."""
    from drelay_model.selectors.base import SelectionContext

    H, dev = drafter.config.num_slots, target.device
    n = len(prompt)
    cache, ctx = target.new_cache(1, n + H + 2), drafter.new_context_cache(1, n + 1)
    res = target(torch.tensor([prompt], device=dev), cache, feature_layers=drafter.config.target_layer_ids)
    drafter.extend_context(res.features, ctx)
    base = cache.lengths.clone()
    anchor = torch.tensor([prompt[-1]], device=dev)
    N = selector.capabilities.history_len
    hist = res.features[:, -N:] if N else None
    hmask = torch.ones(hist.shape[:2], dtype=torch.bool, device=dev) if N else None

    def timed(fn) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.thread_time()
            fn()
            ts.append((time.thread_time() - t0) * 1000)
        return statistics.median(ts)

    def verify(t: int) -> None:
        target(torch.tensor([prompt[-t:]], device=dev), cache, feature_layers=drafter.config.target_layer_ids)
        cache.crop(base)

    out = {}
    for L in [*lengths, H]:
        for heads in {L, H}:
            block = drafter.draft(anchor, ctx, slots=heads)
            sctx = SelectionContext(anchor_ids=anchor, anchor_pos=ctx.lengths.clone(), row_ids=torch.zeros(1, dtype=torch.long, device=dev),
                                    history=hist, history_mask=hmask, max_slots=L if L < H else None)  # fmt: skip
            out[f"draft_ms/{heads}"] = timed(lambda: drafter.draft(anchor, ctx, slots=heads))
            out[f"select_ms/{L}/{heads}"] = timed(lambda: selector.select(block, sctx))
        out[f"verify_ms/{1 + L}"] = timed(lambda: verify(1 + L))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare-dir", required=True, help="a `drelay compare` output folder (its cells/ hold the continuations)")
    p.add_argument("--checkpoint", default=str(ROOT / "checkpoints/smollm2-135m"), help="drafter checkpoint with a DRelay head")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--lengths", default="2,4,8", help="verification lengths L < H")
    p.add_argument("--methods", default=",".join(METHODS), help="drelay and/or native (a drafter-only checkpoint: native)")
    p.add_argument("--benchmarks", default="all")
    p.add_argument("--limit", type=int, default=4, help="prompts per benchmark (a subset of the compare run's)")
    p.add_argument("--subset-seed", type=int, default=0, help="the compare run's --subset-seed")
    p.add_argument("--reps", type=int, default=15, help="timing repetitions per cost")
    p.add_argument("--out", default="outputs/partial_blocks")
    args = p.parse_args()
    from pipelines.common.checkpoint_refs import resolve_ref

    args.checkpoint = args.checkpoint and resolve_ref(args.checkpoint)  # FOLDER@COMMIT too
    torch.set_num_threads(1)

    from drelay_model.drafter.checkpoint import read_checkpoint
    from drelay_model.target import load_target
    from pipelines.common.methods import load_method, resolve_method
    from pipelines.data.eval_sets import parse_benchmarks
    from pipelines.eval.prompts import encoder_for

    # Cheap checks first: the arguments, before the target loads.
    lengths = parse_lengths(args.lengths, read_checkpoint(args.checkpoint)[0].num_slots)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or set(methods) - set(METHODS):
        raise DRelayError(f"--methods: one or both of {', '.join(METHODS)}, got {args.methods!r}")
    if not (Path(args.compare_dir) / "cells").is_dir():
        raise DRelayError(f"--compare-dir: no '{args.compare_dir}/cells' (run `drelay compare --out {args.compare_dir}` first)")
    target = load_target(args.target)
    inputs = replay_inputs(
        Path(args.compare_dir), parse_benchmarks(args.benchmarks), args.limit, args.subset_seed, encoder_for(target)
    )
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "compare_dir": args.compare_dir,
        "checkpoint": args.checkpoint,
        "prompts": {b: len(v[0]) for b, v in inputs.items()},
    }
    lines = [
        f"# Partial blocks: {args.checkpoint}, {sum(results['prompts'].values())} prompt turns over {len(inputs)} benchmarks",
        "",
    ]
    for name in methods:
        drafter, selector = load_method(resolve_method(name, target_spec=args.target, checkpoint=args.checkpoint), target)
        H = drafter.config.num_slots
        first = next(iter(inputs.values()))[0][0]
        costs = round_costs(target, drafter, selector, first, lengths, args.reps)
        lines += [f"## {name}", "", "| L | τ partial | τ full | full ÷ partial [95%] | ms partial | ms full | tok/ms partial | tok/ms full |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        rows = []
        for L in lengths:
            groups = []
            for bench, (ids, conts) in inputs.items():
                full = replay_counts(target, drafter, selector, ids, conts, L, H)
                part = replay_counts(target, drafter, selector, ids, conts, L, L)
                groups.append(np.concatenate([full, part], axis=1))
                print(f"{name} L={L} {bench}: done", file=sys.stderr, flush=True)
            tau = {
                k: float(np.mean([g[:, i].sum() / g[:, i + 1].sum() for g in groups])) for k, i in (("full", 0), ("partial", 2))
            }
            ratio = full_over_partial(groups)
            ms = {
                w: costs[f"draft_ms/{h}"] + costs[f"select_ms/{L}/{h}"] + costs[f"verify_ms/{1 + L}"]
                for w, h in (("partial", L), ("full", H))
            }
            row = {"L": L, "tau": tau, "ratio": ratio.as_dict("full_over_partial"), "round_ms": ms,
                   "tokens_per_ms": {w: tau[w] / ms[w] for w in ms}}  # fmt: skip
            rows.append(row)
            lines.append(f"| {L} | {tau['partial']:.3f} | {tau['full']:.3f} | {ratio.format()} | {ms['partial']:.1f} | {ms['full']:.1f} | "
                         f"{row['tokens_per_ms']['partial']:.4f} | {row['tokens_per_ms']['full']:.4f} |")  # fmt: skip
        results[name] = {"rows": rows, "costs_ms": costs}
        lines += ["", "Costs (thread CPU ms, batch 1): " + ", ".join(f"{k} {v:.2f}" for k, v in costs.items()), ""]
    text = "\n".join(lines)
    (out_dir / "partial_blocks.json").write_text(json.dumps(results, indent=1))
    (out_dir / "partial_blocks.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    from cli import guarded

    raise SystemExit(guarded(main, Path(__file__).name))
