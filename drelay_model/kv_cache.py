"""A static, per-row KV cache.

Speculative decoding commits a different number of tokens per row every round, so one global
length (as in Hugging Face's `DynamicCache.crop`) cannot describe a batch. Here every row keeps its
own valid length; cropping a row is a write to `lengths`, nothing is copied or freed.

`k`, `v` and `lengths` are updated in place (`begin` → `append` → `end`, `crop`): a CUDA graph
captured over them (benchmarks/gpu/check_graphs.py) reads the same storage on every replay. Only the
methods that reshape the batch (below) allocate new tensors or views.

Layout:
    k, v     [n_layers, B, n_kv_heads, capacity, head_dim]   preallocated once (a static cache)
    lengths  [B] int64                                         row b holds valid entries [0, lengths[b])

A forward over `T` new tokens writes them at positions `lengths[b] + t` (t < T) of every layer, and
attends over keys `[0, lengths[b] + t]` of its row (causal). Entries at or past a row's length are
stale (rejected drafts of an earlier round, padding) and are never attended to, because the mask is
derived from `lengths`; they are always finite (zero-initialised), so masking them is exact.

The continuous batcher reshapes the batch between forwards: `select_rows`, `compact_rows` (rows leave),
`write_rows` (new rows take finished rows' slots), `concat` (new rows join), `resize` (capacity).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from drelay_model.errors import DRelayError


class KVCache:
    """Static KV cache with an independent valid length per batch row."""

    def __init__(
        self,
        *,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (n_layers, batch_size, n_kv_heads, capacity, head_dim)
        # Zeros, not empty: masked-out keys still enter the attention matmuls (weight 0), and
        # uninitialised memory can hold NaN/Inf, which would poison them (0 · NaN = NaN).
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.capacity = capacity
        # Set by `begin`, valid until `end`: where this forward writes and how far it reads.
        self._write_pos: torch.Tensor | None = None  # [B, T] int64
        self._uniform_start: int | None = None  # all rows start at the same length (fast path)
        self._kv_len = 0

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    # ---- one forward = begin → append (per layer) → end -----------------------------------------
    def begin(self, num_new: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prepare a forward over `num_new` tokens per row.

        Returns:
            positions  [B, T] int64: absolute position of each new token (= its cache slot).
            mask       [B, 1, T, kv_len] bool (True = attend) or None when no mask is needed
                       (uniform lengths and a single new token: every stored key is visible).
        """
        T = num_new
        start = self.lengths
        end_max = int(start.max()) + T
        if end_max > self.capacity:
            raise DRelayError(f"sequence too long for the KV cache: needs {end_max} positions, capacity is {self.capacity}")
        positions = start[:, None] + torch.arange(T, device=start.device)  # [B, T]
        self._write_pos = positions
        lo, hi = int(start.min()), int(start.max())
        self._uniform_start = lo if lo == hi else None
        self._kv_len = end_max
        if self._uniform_start is not None and T == 1:
            return positions, None
        key_pos = torch.arange(end_max, device=start.device)  # [kv_len]
        mask = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, kv_len]: causal per row
        return positions, mask[:, None]

    def append(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's keys/values of one layer and return the readable window.

        Args:
            k_new, v_new  [B, n_kv, T, head_dim]
        Returns:
            k, v          [B, n_kv, kv_len, head_dim] views into the cache (kv_len = max end of any row).
        """
        assert self._write_pos is not None, "call begin() before append()"
        T = k_new.shape[2]
        if self._uniform_start is not None:
            s = self._uniform_start
            self.k[layer, :, :, s : s + T] = k_new
            self.v[layer, :, :, s : s + T] = v_new
        else:
            B, n_kv, _, D = k_new.shape
            idx = self._write_pos[:, None, :, None].expand(B, n_kv, T, D)
            self.k[layer].scatter_(2, idx, k_new)
            self.v[layer].scatter_(2, idx, v_new)
        return self.k[layer, :, :, : self._kv_len], self.v[layer, :, :, : self._kv_len]

    def end(self) -> None:
        """Mark every written token as valid (the caller crops rejected ones afterwards)."""
        assert self._write_pos is not None, "call begin() before end()"
        self.lengths.copy_(self._write_pos[:, -1] + 1)  # in place: captured graphs read this storage
        self._write_pos = None

    # ---- bookkeeping between forwards ----------------------------------------------------------
    def crop(self, new_lengths: torch.Tensor) -> None:
        """Keep only the first `new_lengths[b]` entries of row b ([B] int64, each ≤ current length)."""
        if new_lengths.shape != self.lengths.shape:
            raise ValueError(f"crop lengths have shape {tuple(new_lengths.shape)}, the cache has {self.batch_size} rows")
        if bool((new_lengths > self.lengths).any()) or bool((new_lengths < 0).any()):
            raise ValueError(f"crop lengths {new_lengths.tolist()} outside [0, {self.lengths.tolist()}]")
        self.lengths.copy_(new_lengths)  # in place (a copy: later changes to new_lengths do not reach it)

    # ---- reshaping the batch (the continuous batcher) ------------------------------------------
    # Each of these replaces `k`/`v`/`lengths` (except `write_rows` within capacity, which writes in
    # place): a graph captured over this cache must be captured again after them.
    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the given batch rows ([R] int64), e.g. to drop finished sequences: new tensors (the
        batch size changes), so a graph captured over this cache must be captured again."""
        self.k = self.k[:, rows]
        self.v = self.v[:, rows]
        self.lengths = self.lengths[rows]

    def compact_rows(self, n: int, *, holes: list[int], movers: list[int]) -> None:
        """Keep `n` rows without re-allocating: row movers[i] (≥ n) is copied into slot holes[i] (< n, a
        dropped row), then the batch narrows to a view of its first `n` rows (the memory of the rows past
        them stays with it until the next re-allocation). One row's copy per hole, not every row's."""
        if len(holes) != len(movers) or any(h >= n for h in holes) or any(m < n for m in movers):
            raise ValueError(f"compact_rows: holes {holes} must lie below {n} and movers {movers} at or past it, one each")
        if holes:
            src, dst = torch.tensor(movers, device=self.k.device), torch.tensor(holes, device=self.k.device)
            for t in (self.k, self.v):
                t[:, dst] = t[:, src]
            self.lengths[dst] = self.lengths[src]
        self.k, self.v, self.lengths = self.k[:, :n], self.v[:, :n], self.lengths[:n]

    def write_rows(self, index: torch.Tensor, src: "KVCache") -> None:
        """Rows `index` ([R] int64) ← the R rows of `src`, with their lengths; positions past `src`'s
        capacity become zeros, as in a fresh cache (masked keys still enter the attention matmuls).
        Grows this cache first when `src` holds more positions; otherwise writes in place."""
        if src.capacity > self.capacity:
            self.resize(src.capacity)
        c = src.capacity
        for dst, new in ((self.k, src.k), (self.v, src.v)):
            dst[:, index, :, :c] = new
            dst[:, index, :, c:] = 0
        self.lengths[index] = src.lengths  # in place: captured graphs read this storage

    def resize(self, capacity: int) -> None:
        """Change the number of positions per row to `capacity`: new positions are zeros (growing), or
        the tail past it is freed (shrinking: every row's length must fit). New tensors either way."""
        longest = int(self.lengths.max()) if self.batch_size else 0
        if capacity < longest:
            raise ValueError(f"cannot resize the KV cache to {capacity} positions: a row holds {longest}")
        if capacity > self.capacity:
            pad = capacity - self.capacity  # zeros at the end of the position dimension (dim 3)
            self.k = torch.nn.functional.pad(self.k, (0, 0, 0, pad))
            self.v = torch.nn.functional.pad(self.v, (0, 0, 0, pad))
        elif capacity < self.capacity:
            self.k = self.k[:, :, :, :capacity].contiguous()
            self.v = self.v[:, :, :, :capacity].contiguous()
        self.capacity = capacity

    @classmethod
    def concat(cls, caches: Sequence["KVCache"]) -> "KVCache":
        """The rows of each cache in order, in one new cache whose capacity is the largest of theirs
        (a shorter cache's extra positions are zeros). Layers, heads, head size, dtype and device must agree."""
        first = caches[0]
        L, _, n_kv, _, head_dim = first.k.shape
        layout = (L, n_kv, head_dim, first.k.dtype, first.k.device)
        for c in caches[1:]:
            if (c.k.shape[0], c.k.shape[2], c.k.shape[4], c.k.dtype, c.k.device) != layout:
                raise ValueError("KV caches to concatenate differ in layers, heads, head size, dtype or device")
        out = cls(
            n_layers=L, batch_size=sum(c.batch_size for c in caches), n_kv_heads=n_kv, head_dim=head_dim,
            capacity=max(c.capacity for c in caches), dtype=first.k.dtype, device=first.k.device,
        )  # fmt: skip
        row = 0
        for c in caches:
            rows = slice(row, row + c.batch_size)
            out.k[:, rows, :, : c.capacity] = c.k
            out.v[:, rows, :, : c.capacity] = c.v
            out.lengths[rows] = c.lengths
            row += c.batch_size
        return out
