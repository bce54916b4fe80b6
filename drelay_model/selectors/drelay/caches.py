"""What the CPU fast path (fast.py) keeps between rounds: per-token projections, the projected
verified history, and fused packed weights.

All three rest on one property of the packed oneDNN linear (kernels/cpu_linear.py): it computes an
output row the same, bit for bit, whatever other rows share a call of at least INVARIANT_ROWS rows
(the caches pad their few-row calls to that: `rows_invariant`), and an output column the same
whatever other columns share the weight. So a row projected once and stored equals the row the
reference would project this round, and one linear over concatenated weights equals the separate
linears side by side. Where a weight is not packed (packing off, a weight made under
`torch.inference_mode`, autograd) nothing is stored: every row is projected afresh, as the
reference does.

  TokenTable     token id v → the rows every round recomputes for it: ê_v = W_e E(v), W_n ê_v
                 (Global Read's n_ik before the slot term) and [W_x ; W_e'] ê_v (causal.token_terms)
  HistoryCache   per row of the batch: LN(W_F f_t) of the verified features it read last round;
                 the window slides by the anchor's advance, so a round projects only the features
                 verified since (after checking that the overlap holds the same features)
  FusedLinear    one packed weight for several linears of the same input
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from drelay_model.kernels.cpu_linear import PackedLinear, linear, pack, rows_invariant


def packs(*modules: PackedLinear) -> bool:
    """Every one of `modules` runs through a packed oneDNN weight right now (outside autograd)."""
    return all(m._pack.get(m.weight, m.cpu_kernels) is not None for m in modules)


class FusedLinear:
    """Linears of one input as one packed weight: y = x [W_1 ; W_2 ; …]ᵀ + [b_1 ; b_2 ; …] (a missing
    bias is zero). Rebuilt when any weight changes; `None` from `get` where packing does not apply."""

    def __init__(self, *modules: nn.Linear) -> None:
        self.modules = modules
        self._key: tuple | None = None
        self._weight = self._bias = self._packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] → [..., Σ out]."""
        mods = self.modules
        key = tuple((m.weight.data_ptr(), m.weight._version, m.cpu_kernels) for m in mods)
        if key != self._key:
            self._weight = torch.cat([m.weight.detach() for m in mods])
            biases = [m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in mods]
            self._bias = torch.cat(biases) if any(m.bias is not None for m in mods) else None
            self._packed = pack(self._weight, mods[0].cpu_kernels) if packs(*mods) else None
            self._key = key
        return linear(x, self._weight, self._bias, self._packed)


class TokenTable:
    """Per-token rows `rows(E(v))` for token ids v, computed once each while the weights stay the
    same (`version`), up to `capacity` distinct tokens (then it starts over).

    `rows` maps embeddings [M, D] to a tuple of tensors [M, w_1], [M, w_2], …; `lookup(ids)` returns
    each gathered for ids [...] → [..., w_j]."""

    def __init__(self, capacity: int = 16384) -> None:
        self.capacity = capacity
        self._version: tuple | None = None
        self._slot_of: torch.Tensor | None = None  # [V] int64, −1 = not stored
        self._tables: list[torch.Tensor] = []
        self._count = 0

    def lookup(self, ids: torch.Tensor, embed: torch.Tensor, rows, version: tuple) -> tuple[torch.Tensor, ...]:
        flat = ids.reshape(-1)
        if version != self._version or self._slot_of is None:
            self._reset(embed.shape[0], version)
        slots = self._slot_of[flat]
        missing = slots < 0
        if bool(missing.any()):
            new = torch.unique(flat[missing])
            if self._count + new.numel() > self.capacity:
                self._reset(embed.shape[0], version)
                new = torch.unique(flat)
            computed = rows_invariant(rows, F.embedding(new, embed))
            self._store(new, computed)
            slots = self._slot_of[flat]
        return tuple(t[slots].view(*ids.shape, t.shape[1]) for t in self._tables)

    def _reset(self, vocab: int, version: tuple) -> None:
        self._version, self._count, self._tables = version, 0, []
        self._slot_of = torch.full((vocab,), -1, dtype=torch.long)

    def _store(self, ids: torch.Tensor, computed: tuple[torch.Tensor, ...]) -> None:
        end = self._count + ids.numel()
        if not self._tables or end > self._tables[0].shape[0]:  # grow by doubling, up to capacity
            size = min(self.capacity, max(1024, 2 * end))
            grown = [t.new_empty(size, t.shape[1]) for t in computed]
            for g, old in zip(grown, self._tables):
                g[: self._count] = old[: self._count]
            self._tables = grown
        for table, t in zip(self._tables, computed):
            table[self._count : end] = t
        self._slot_of[ids] = torch.arange(self._count, end)
        self._count = end


@dataclass
class _Seen:
    anchor_pos: int
    raw: torch.Tensor  # [N, F] the features read
    projected: torch.Tensor  # [N, d] their projections


class HistoryCache:
    """Projections of each row's verified-feature window, reused as the window slides.

    Row b of a round (request `row_ids[b]`, anchor at `anchor_pos[b]`) reads the N features before
    its anchor. If the same request was seen s = anchor_pos − anchor_pos_before positions earlier
    (0 ≤ s < N) and its old window's last N − s features equal the new window's first N − s, those
    rows are reused and only the last s are projected; otherwise all N are. The check compares the
    features themselves, so a reused or reordered row id never reuses another request's rows."""

    def __init__(self) -> None:
        self._seen: dict[int, _Seen] = {}
        self._version: tuple | None = None

    def project(
        self, history: torch.Tensor, row_ids: torch.Tensor, anchor_pos: torch.Tensor, proj, version: tuple
    ) -> torch.Tensor:
        """history [B, N, F], proj: [M, F] → [M, d] → [B, N, d] (proj of every row of every window)."""
        B, N, _ = history.shape
        if version != self._version:
            self._seen, self._version = {}, version
        ids, pos = row_ids.tolist(), anchor_pos.tolist()
        reused, first_new = [], []  # per row: cached projections still in the window; first entry to project
        for b in range(B):
            seen = self._seen.get(ids[b])
            s = pos[b] - seen.anchor_pos if seen is not None and seen.raw.shape[0] == N else -1
            ok = 0 <= s < N and torch.equal(seen.raw[s:], history[b, : N - s])
            reused.append(seen.projected[s:] if ok else None)
            first_new.append(N - s if ok else 0)
        fresh = [history[b, first_new[b] :] for b in range(B) if first_new[b] < N]
        new = rows_invariant(proj, torch.cat(fresh)) if fresh else None  # rows are independent: one call for all
        out, at = [], 0
        for b in range(B):
            n_new = N - first_new[b]
            parts = ([reused[b]] if reused[b] is not None else []) + ([new[at : at + n_new]] if n_new else [])
            at += n_new
            out.append(parts[0] if len(parts) == 1 else torch.cat(parts))
        projected = torch.stack(out)  # [B, N, d]
        self._seen = {ids[b]: _Seen(pos[b], history[b].clone(), projected[b]) for b in range(B)}
        return projected
