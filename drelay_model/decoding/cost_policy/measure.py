"""Measuring the cost policy's round costs (`surface.py`) on this machine.

`measure_costs` times every term once per machine, target and drafter (cached as JSON by
`cache.py`). On a shared machine single timings swing by ±30%, so each repetition
interleaves all terms at every batch size (drift then shifts every term alike), each term is the
median over repetitions, and the verify and draft tables are fitted non-decreasing in both b and
t (or h) by isotonic regression (a running maximum would let one slow first call flatten the whole
curve). Measuring stops after the first repetition that ends more than `budget_s` after the
warm-up began (at least 3 repetitions), so it takes at most max(`budget_s` + one repetition, four
repetitions) once the model is loaded. The policy rescales the surface
online from the rounds it times.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict

import torch

from drelay_model.decoding.cost_policy.surface import (
    RoundCosts,
    Table,
    check_batch_sizes,
    draft_widths,
    fill_linear,
    verify_widths,
)
from drelay_model.errors import DRelayError


def isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence nearest to `values` in least squares (pool adjacent violators):
    a block of out-of-order values becomes their mean, so one outlier moves its neighbours a little
    instead of raising everything after it."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(n)]


def isotonic_2d(table: list[list[float]], sweeps: int = 20) -> Table:
    """A [N][T] table made non-decreasing along both axes: isotonic regression along t and along b in
    turn (alternating projections) until both hold; a last running maximum over b settles what is
    left (within float error after the sweeps)."""
    rows = [list(r) for r in table]
    for _ in range(sweeps):
        rows = [isotonic(r) for r in rows]
        cols = [isotonic([r[t] for r in rows]) for t in range(len(rows[0]))]
        rows = [[cols[t][i] for t in range(len(cols))] for i in range(len(rows))]
        if all(a <= b for r in rows for a, b in zip(r, r[1:])):
            break
    rows = [isotonic(r) for r in rows]
    for i in range(1, len(rows)):
        rows[i] = [max(a, b) for a, b in zip(rows[i], rows[i - 1])]
    return tuple(tuple(r) for r in rows)


def _batch_calls(target, drafter, selector, b: int, *, context_len: int, extend_tokens: int) -> dict:
    """Callables timing every term at `b` rows, keyed (term, b[, t or h])."""
    from drelay_model.selectors.base import SelectionContext  # local: selectors import the drafter

    H = drafter.config.num_slots
    device = target.embed_weight.device
    layers = drafter.config.target_layer_ids
    g = torch.Generator().manual_seed(b)
    ids = torch.randint(0, target.vocab_size, (b, context_len), generator=g).to(device)
    cache = target.new_cache(b, context_len + H + 2)
    res = target(ids, cache, feature_layers=layers)
    ctx = drafter.new_context_cache(b, context_len + H + 2 + extend_tokens)
    drafter.extend_context(res.features, ctx)
    base, ctx_base = cache.lengths.clone(), ctx.lengths.clone()
    anchor = ids[:, -1]
    block = drafter.draft(anchor, ctx)
    rows = torch.arange(b, dtype=torch.long, device=device)
    sctx = SelectionContext(anchor_ids=anchor, anchor_pos=ctx.lengths.clone(), row_ids=rows)
    if selector.capabilities.history_len:
        hist = torch.zeros(b, selector.capabilities.history_len, res.features.shape[-1], dtype=res.features.dtype, device=device)
        sctx = dataclasses.replace(sctx, history=hist, history_mask=torch.ones(hist.shape[:2], dtype=torch.bool, device=device))
    one_slot = dataclasses.replace(sctx, max_slots=1)
    # a partial-block selector decides one slot on a one-slot block (what a 1-draft round runs)
    one_block = drafter.draft(anchor, ctx, slots=1) if selector.capabilities.partial_block else block
    new_feats = res.features[:, -extend_tokens:]

    def verify(t: int) -> None:
        target(ids[:, :t], cache, feature_layers=layers)
        cache.crop(base)

    def extend() -> None:
        drafter.extend_context(new_feats, ctx)
        ctx.crop(ctx_base)

    calls = {("verify", b, t): (lambda t=t: verify(t)) for t in verify_widths(H)}
    calls |= {("draft", b, h): (lambda h=h: drafter.draft(anchor, ctx, slots=h)) for h in draft_widths(H)}
    calls |= {("select_one", b): lambda: selector.select(one_block, one_slot), ("select_all", b): lambda: selector.select(block, sctx),
              ("extend", b): extend}  # fmt: skip
    return calls


@torch.inference_mode()
def measure_costs(
    target,
    drafter,
    selector,
    *,
    batch_sizes: tuple[int, ...] = (1,),
    context_len: int = 200,
    reps: int = 9,
    budget_s: float = 60.0,
    extend_tokens: int = 4,
) -> RoundCosts:
    """Time verify(b, t) and drafting of h slots at the widths `verify_widths` / `draft_widths` pick (linear in
    between), selection and context extension (by `extend_tokens` positions, a typical drafted
    round) at every batch size b, in ms: the median of
    up to `reps` interleaved repetitions after one warm-up, stopping after the first repetition that
    ends more than `budget_s` seconds after the warm-up began (at least min(3, reps) repetitions)."""
    if reps < 1 or context_len < 2 or budget_s <= 0:
        raise DRelayError(
            f"measure_costs needs reps ≥ 1, context_len ≥ 2 and budget_s > 0, got {reps}, {context_len}, {budget_s}"
        )
    check_batch_sizes(batch_sizes)
    H = drafter.config.num_slots
    calls: dict = {}
    for b in batch_sizes:
        calls |= _batch_calls(target, drafter, selector, b, context_len=context_len, extend_tokens=extend_tokens)
    times: dict = defaultdict(list)
    t_start = time.perf_counter()
    for rep in range(reps + 1):  # repetition 0 warms up
        for key, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            if rep:
                times[key].append(1e3 * (time.perf_counter() - t0))
        if rep >= min(3, reps) and time.perf_counter() - t_start > budget_s:
            break
    ms = {key: statistics.median(v) for key, v in times.items()}
    per_slot = max(H - 1, 1)
    widths, slots = verify_widths(H), draft_widths(H)
    return RoundCosts(
        verify_ms=isotonic_2d([fill_linear(widths, [ms[("verify", b, t)] for t in widths], H + 1) for b in batch_sizes]),
        draft_slots_ms=isotonic_2d([fill_linear(slots, [ms[("draft", b, h)] for h in slots], H) for b in batch_sizes])
        if H
        else ((),) * len(batch_sizes),
        select_ms=tuple(ms[("select_one", b)] for b in batch_sizes),
        select_slot_ms=tuple(max(ms[("select_all", b)] - ms[("select_one", b)], 0.0) / per_slot for b in batch_sizes),
        extend_ms=tuple(ms[("extend", b)] for b in batch_sizes),
        batch_sizes=tuple(batch_sizes),
    )
