"""Other ways to make DRelay's H causal decisions, timed against the walk on rounds recorded from
real decoding (`bench_selector.py --record`): the measurement behind keeping the sequential walk.

    parallel passes   `CausalSelector.decide_block`: all H decisions at once under an assumed path,
                      repeated until the path stops changing. Pays only if a block settles in a
                      few passes; the passes each block needed are counted here.
    compiled walk     `torch.compile(walk, fullgraph=True)` (Inductor's CPU code): one compile per
                      (batch, slots) shape; the compile time is printed beside the per-round time.

Every variant's decisions are checked against the walk's (mismatches printed; scores agree to
float rounding, not bit for bit). Thread CPU ms per round, medians, variants alternating per round.

    .venv/bin/python benchmarks/bench_selector.py --walks outputs/selector_rounds.pt [--batches 1]
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import torch

from drelay_model.selectors.drelay.walk import walk, walk_inputs


def passes_needed(cr, ev, anchor_emb, cand_emb) -> int:
    """The passes `decide_block` itself takes on this block: its calls of the teacher-forced pass,
    allowed H + 1 of them (each pass settles one more slot, so it never falls back to the loop)."""
    passes, forced = 0, cr.teacher_forced

    def counted(*args, **kwargs):
        nonlocal passes
        passes += 1
        return forced(*args, **kwargs)

    cr.teacher_forced = counted  # an instance attribute: shadows the method for this call only
    try:
        cr.decide_block(ev, anchor_emb, cand_emb, max_passes=cand_emb.shape[1] + 1)
    finally:
        del cr.teacher_forced
    return passes


def compare_walks(sel, inputs: list, *, reps: int, compile_walk: bool = True, rounds: int = 40) -> None:
    """Print the table of the module docstring for batches `inputs` (`selector_rounds.batches`)."""
    cr = sel.causal
    prepared = []
    with torch.inference_mode():
        for block, ctx in inputs[:rounds]:
            H = block.cand_ids.shape[1]
            ev, emb = sel.evidence(block, ctx.history, ctx.history_mask, slots=H)
            anchor = sel.embed(ctx.anchor_ids)
            prepared.append((ev, anchor, emb, walk_inputs(cr, ev, anchor, emb)))
        passes = Counter(passes_needed(cr, ev, a, e) for ev, a, e, _ in prepared)
    # Each variant: (evidence, anchor embedding, pool embeddings, walk inputs) → picks [B, H].
    variants = {
        "walk": lambda ev, a, e, w: walk(w).pool_index,
        "parallel passes": lambda ev, a, e, w: cr.decide_block(ev, a, e, max_passes=e.shape[1] + 1)[0],
    }
    compile_s = None
    if compile_walk:
        compiled = torch.compile(walk, fullgraph=True, dynamic=False)
        t0 = time.perf_counter()
        with torch.inference_mode():
            compiled(prepared[0][3])
        compile_s = time.perf_counter() - t0
        variants["compiled walk"] = lambda ev, a, e, w: compiled(w).pool_index
    ms: dict[str, list[float]] = {name: [] for name in variants}
    mismatches = Counter()
    with torch.inference_mode():
        for rep in range(reps):
            for inputs in prepared:
                ref = None
                for name, fn in variants.items():
                    t0 = time.thread_time()
                    pick = fn(*inputs)
                    ms[name].append((time.thread_time() - t0) * 1e3)
                    if ref is None:
                        ref = pick
                    elif rep == 0:
                        mismatches[name] += int(not torch.equal(pick, ref))
    n = len(prepared)
    mean_passes = sum(k * v for k, v in passes.items()) / n
    print(f"{n} blocks of batch {prepared[0][2].shape[0]}: parallel passes needed, mean {mean_passes:.1f}, "
          f"histogram {dict(sorted(passes.items()))}")  # fmt: skip
    print("| decisions | ms per round | ÷ walk | blocks decided differently |\n|---|---|---|---|")
    base = statistics.median(ms["walk"])
    for name, values in ms.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.2f} | {med / base:.2f} | {mismatches[name]} of {n} |")
    if compile_s is not None:
        print(f"compile time of the walk for this shape: {compile_s:.0f} s")
