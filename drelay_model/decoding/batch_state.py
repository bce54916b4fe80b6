"""`BatchState`: everything per row that lives across the engine's rounds.

    rows       [R] request ids (the engine's prompt indices, or the continuous batcher's request ids)
    cache      the target's KV cache, one valid length per row (`kv_cache.py`)
    ctx        the drafter's context keys/values (None without a drafter)
    history    the last N verified target features per row, for selectors that read them (or None)
    anchor     [R] int64: each row's last verified token, not yet in `cache`
    pending    verified target features not yet in `ctx` nor `history` (see `defer`)

Rows leave with `keep`; the continuous batcher joins new rows with `merge`, or with `fill` in the slots
of rows that have just finished, and resizes the caches with `set_capacity`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from drelay_model.decoding.history import VerifiedHistory
from drelay_model.drafter.model import BlockDrafter
from drelay_model.kv_cache import KVCache
from drelay_model.selectors.base import SelectionContext


@dataclass
class BatchState:
    """Per-row decoding state (the module docstring)."""

    rows: list[int]
    cache: KVCache
    ctx: KVCache | None = None  # drafter context keys/values
    history: VerifiedHistory | None = None
    anchor: torch.Tensor | None = None  # [R] int64
    # Verified target features not yet in the drafter's context (`ctx`) nor in the verified history,
    # one (features [R, T, F], counts [R] or None = all T) per round since the last drafted one:
    # the round that verified them does not need them, so they wait for the next drafted round,
    # which extends by all of them in one call each (`sync_context`) instead of one per round.
    pending: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)

    def defer(self, features: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """Queue a round's verified features: the first counts[r] of row r (None: all T, an AR round)."""
        self.pending.append((features, counts))

    def sync_context(self, drafter: BlockDrafter) -> None:
        """Extend the drafter's context and the history by the pending features.

        Every row's pending features go left-aligned into one [R, T, F] tensor (T = the most any row
        has) at positions ctx.lengths + t, and each row is cropped to its own count: the context
        keys/values are per position (row-independent linears, RoPE by position), so one call
        yields what one call per round would."""
        if not self.pending:
            return
        if all(counts is None for _, counts in self.pending):  # AR rounds only: the same count everywhere
            feats = torch.cat([f for f, _ in self.pending], dim=1)  # [R, n, F]
            total = torch.full_like(self.ctx.lengths, feats.shape[1])
        else:
            total = sum(f.shape[1] if c is None else c for f, c in self.pending)  # [R]
            feats = _left_aligned(self.pending, total)
        start = self.ctx.lengths.clone()
        need = int(start.max()) + feats.shape[1]  # every row writes T positions, then is cropped to its own
        if need > self.ctx.capacity:  # a row that joined after these rounds (count 0) may start late
            self.ctx.resize(need)
        drafter.extend_context(feats, self.ctx)
        self.ctx.crop(start + total)
        if self.history is not None:
            self.history.push(feats, total)
        self.pending = []

    def selection_context(self, max_slots: int | None = None) -> SelectionContext:
        hist = self.history
        return SelectionContext(
            anchor_ids=self.anchor,
            anchor_pos=self.cache.lengths.clone(),
            row_ids=torch.tensor(self.rows, dtype=torch.long, device=self.anchor.device),
            history=hist.feats if hist is not None else None,
            history_mask=hist.mask() if hist is not None else None,
            max_slots=max_slots,
        )

    def keep(self, rows: list[int]) -> None:
        """Drop the rows not in `rows` from every per-row state (no-op when all stay). The caches are
        compacted in place: each kept row past the new batch size moves into a dropped row's slot
        (one row's copy, not every row's), and the batch narrows to a view of the first rows; so the
        rows' order may change (`self.rows` says it)."""
        wanted = set(rows)
        if len(wanted) == len(self.rows) and wanted <= set(self.rows):
            return
        n = len(rows)
        holes = [p for p in range(n) if self.rows[p] not in wanted]  # dropped slots among the first n
        movers = [p for p in range(n, len(self.rows)) if self.rows[p] in wanted]  # kept rows past them
        order = list(range(n))
        for h, m in zip(holes, movers):
            order[h] = m
        for cache in (self.cache, self.ctx):
            if cache is not None:
                cache.compact_rows(n, holes=holes, movers=movers)
        index = torch.tensor(order, dtype=torch.long, device=self.anchor.device)
        if self.history is not None:
            self.history.select_rows(index)
        self.pending = [(f[index], None if c is None else c[index]) for f, c in self.pending]
        self.anchor = self.anchor[index]
        self.rows = [self.rows[i] for i in order]

    def merge(self, other: "BatchState") -> "BatchState":
        """This state's rows, then `other`'s, in one state whose caches hold the larger capacity of
        the two. `other` (freshly prefilled) has no pending features; this state's stay pending,
        with counts of 0 for the rows joining, so the drafter's context catches up when a round next
        drafts, not at every admission (during AR rounds it may never need to). Sampling numbers are
        the caller's (the continuous batcher keeps one per request)."""
        assert not other.pending, "the joining state has pending features: sync_context() it first"
        out = BatchState(rows=self.rows + other.rows, cache=KVCache.concat([self.cache, other.cache]))
        R_new = len(other.rows)
        for f, c in self.pending:  # f [R, T, F] → [R + R_new, T, F]; counts: the rows joining add none
            counts = _counts(f, c)
            out.pending.append((torch.cat([f, f.new_zeros(R_new, *f.shape[1:])]), torch.cat([counts, counts.new_zeros(R_new)])))
        out.anchor = torch.cat([self.anchor, other.anchor])
        if self.ctx is not None:
            out.ctx = KVCache.concat([self.ctx, other.ctx])
        if self.history is not None:
            out.history = self.history
            out.history.feats = torch.cat([self.history.feats, other.history.feats])
            out.history.count = torch.cat([self.history.count, other.history.count])
        return out

    def fill(self, positions: list[int], other: "BatchState") -> None:
        """Put `other`'s rows (freshly prefilled, one per position) in place of the rows at `positions`
        (finished ones): their caches are written into those rows' slots, so nothing is re-allocated
        unless `other` needs a larger capacity, where `keep` then `merge` would copy every row twice.
        The pending features of those slots get counts of 0 (the new rows' own features are in
        `ctx` already, as after `merge`)."""
        assert not other.pending, "the joining state has pending features: sync_context() it first"
        assert len(positions) == len(other.rows)
        index = torch.tensor(positions, dtype=torch.long, device=self.anchor.device)
        for mine, theirs in ((self.cache, other.cache), (self.ctx, other.ctx)):
            if mine is not None:
                mine.write_rows(index, theirs)
        self.anchor[index] = other.anchor
        for p, r in zip(positions, other.rows):
            self.rows[p] = r
        if self.history is not None:
            self.history.feats[index] = other.history.feats
            self.history.count[index] = other.history.count
        self.pending = [(f, _counts(f, c).index_fill(0, index, 0)) for f, c in self.pending]

    def set_capacity(self, capacity: int) -> None:
        """Resize the target's and the drafter's caches to `capacity` positions (every row's length
        must fit; a smaller capacity frees memory when long rows have left)."""
        for cache in (self.cache, self.ctx):
            if cache is not None:
                cache.resize(capacity)


def _counts(features: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
    """A pending entry's counts [R] (None: every row has all T); callers build new tensors from it."""
    if counts is None:
        return torch.full((features.shape[0],), features.shape[1], dtype=torch.long, device=features.device)
    return counts


def _left_aligned(chunks: list[tuple[torch.Tensor, torch.Tensor | None]], total: torch.Tensor) -> torch.Tensor:
    """Chunks (features [R, T_i, F], counts [R] or None = T_i) → [R, max total, F]: row r holds the
    first counts[r] of each chunk's row r, in order, then zeros."""
    first = chunks[0][0]
    R, F = first.shape[0], first.shape[2]
    out = first.new_zeros(R, int(total.max()), F)  # one host sync
    offset = torch.zeros_like(total)
    for f, c in chunks:
        n = torch.full_like(total, f.shape[1]) if c is None else c
        rows, cols = (torch.arange(f.shape[1], device=f.device)[None] < n[:, None]).nonzero(as_tuple=True)
        out[rows, offset[rows] + cols] = f[rows, cols]
        offset = offset + n
    return out
