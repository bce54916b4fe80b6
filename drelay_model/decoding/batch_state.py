"""`BatchState`: everything per row that lives across the engine's rounds.

    rows       [R] request ids (the engine's prompt indices, or the continuous batcher's request ids)
    cache      the target's KV cache, one valid length per row (`kv_cache.py`)
    ctx        the drafter's context keys/values (None without a drafter)
    history    the last N verified target features per row, for selectors that read them (or None)
    anchor     [R] int64: each row's last verified token, not yet in `cache`
    pending    verified target features not yet in `ctx` nor `history` (see `defer`)
    draws      each row's sampling numbers (`draws.RowDraws`, T > 0), or None

Rows leave with `keep`; the continuous batcher joins new rows with `merge` and resizes the caches
with `set_capacity`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from drelay_model.decoding.draws import RowDraws
from drelay_model.decoding.history import VerifiedHistory
from drelay_model.drafter.model import BlockDrafter
from drelay_model.kv_cache import KVCache
from drelay_model.selectors.base import SelectionContext


@dataclass
class BatchState:
    """Per-row decoding state (the module docstring)."""

    rows: list[int]
    cache: KVCache
    draws: list[RowDraws] | None = None  # one per live row (sampling only)
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
            _grow(self.ctx, need)
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
        """Drop finished rows from every per-row state (no-op when all stay)."""
        if rows == self.rows:
            return
        positions = [self.rows.index(b) for b in rows]
        index = torch.tensor(positions, dtype=torch.long, device=self.anchor.device)
        self.cache.select_rows(index)
        if self.draws is not None:
            self.draws = [self.draws[i] for i in positions]
        for part in (self.ctx, self.history):
            if part is not None:
                part.select_rows(index)
        self.pending = [(f[index], None if c is None else c[index]) for f, c in self.pending]
        self.anchor = self.anchor[index]
        self.rows = rows

    def merge(self, other: "BatchState") -> "BatchState":
        """This state's rows, then `other`'s, in one state whose caches hold the larger capacity of
        the two. `other` (freshly prefilled) has no pending features; this state's stay pending,
        with counts of 0 for the rows joining, so the drafter's context catches up when a round next
        drafts, not at every admission (during AR rounds it may never need to). Sampling numbers are
        the caller's (the continuous batcher keeps one per request)."""
        assert not other.pending, "the joining state has pending features: sync_context() it first"
        out = BatchState(rows=self.rows + other.rows, cache=_concat_caches(self.cache, other.cache))
        R_new = len(other.rows)
        for f, c in self.pending:  # f [R, T, F] → [R + R_new, T, F]; counts: the rows joining add none
            counts = torch.full((f.shape[0],), f.shape[1], dtype=torch.long, device=f.device) if c is None else c
            out.pending.append((torch.cat([f, f.new_zeros(R_new, *f.shape[1:])]), torch.cat([counts, counts.new_zeros(R_new)])))
        out.anchor = torch.cat([self.anchor, other.anchor])
        if self.ctx is not None:
            out.ctx = _concat_caches(self.ctx, other.ctx)
        if self.history is not None:
            out.history = self.history
            out.history.feats = torch.cat([self.history.feats, other.history.feats])
            out.history.count = torch.cat([self.history.count, other.history.count])
        return out

    def set_capacity(self, capacity: int) -> None:
        """Resize the target's and the drafter's caches to `capacity` positions (every row's length
        must fit; a smaller capacity frees memory when long rows have left)."""
        for cache in (self.cache, self.ctx):
            if cache is not None:
                _set_capacity(cache, capacity)


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


def _concat_caches(a: KVCache, b: KVCache) -> KVCache:
    """Rows of `a` then rows of `b` in one cache whose capacity is the larger of the two."""
    L, A, n_kv, _, hd = a.k.shape
    B = b.k.shape[1]
    out = KVCache(
        n_layers=L, batch_size=A + B, n_kv_heads=n_kv, head_dim=hd,
        capacity=max(a.capacity, b.capacity), dtype=a.k.dtype, device=a.k.device,
    )  # fmt: skip
    for dst, src_a, src_b in ((out.k, a.k, b.k), (out.v, a.v, b.v)):
        dst[:, :A, :, : a.capacity] = src_a
        dst[:, A:, :, : b.capacity] = src_b
    out.lengths = torch.cat([a.lengths, b.lengths])
    return out


def _set_capacity(cache: KVCache, capacity: int) -> None:
    """Shrink a cache to `capacity` positions (every row's length must fit)."""
    assert int(cache.lengths.max()) <= capacity <= cache.capacity
    cache.k = cache.k[:, :, :, :capacity].contiguous()
    cache.v = cache.v[:, :, :, :capacity].contiguous()
    cache.capacity = capacity


def _grow(cache: KVCache, capacity: int) -> None:
    """Enlarge a cache to `capacity` positions (the new ones empty)."""
    pad = capacity - cache.capacity
    assert pad > 0
    cache.k = torch.nn.functional.pad(cache.k, (0, 0, 0, pad))
    cache.v = torch.nn.functional.pad(cache.v, (0, 0, 0, pad))
    cache.capacity = capacity
