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

from drelay_model.selectors.drelay.causal import decide
from drelay_model.selectors.drelay.walk import walk, walk_inputs


def passes_needed(cr, ev, anchor_emb, cand_emb) -> int:
    """Passes `decide_block` takes on this block (H + 1 at most: each pass settles one more slot)."""
    B, H, K, d = cand_emb.shape
    path = torch.zeros(B, H, dtype=torch.long)
    for n in range(1, H + 2):
        chosen = cand_emb.gather(2, path[:, :, None, None].expand(B, H, 1, d)).squeeze(2)
        new = decide(*cr.teacher_forced(ev, anchor_emb, chosen))
        if torch.equal(new, path):
            return n
        path = new
    raise AssertionError("decide_block did not settle in H + 1 passes")


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
    variants = {"walk": walk, "parallel passes": lambda w, ev, a, e: cr.decide_block(ev, a, e, max_passes=e.shape[1] + 1)}
    compile_s = None
    if compile_walk:
        compiled = torch.compile(walk, fullgraph=True, dynamic=False)
        t0 = time.perf_counter()
        with torch.inference_mode():
            compiled(prepared[0][3])
        compile_s = time.perf_counter() - t0
        variants["compiled walk"] = compiled
    ms: dict[str, list[float]] = {name: [] for name in variants}
    mismatches = Counter()
    with torch.inference_mode():
        for rep in range(reps):
            for ev, a, e, w in prepared:
                ref = None
                for name, fn in variants.items():
                    t0 = time.thread_time()
                    out = fn(w) if name != "parallel passes" else fn(w, ev, a, e)
                    ms[name].append((time.thread_time() - t0) * 1e3)
                    pick = out.pool_index if hasattr(out, "pool_index") else out[0]
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
