"""Per-request ring buffer of the last N verified target features, kept by the plugin's worker.

Why this and not a selector that reads the drafter's projected context features: DRelay's causal
selector was trained to read the last `history_len` *raw* target features f_t (width L·D, the
concatenated hidden states of the drafter's target layers) through its own W_F (selectors/drelay/
causal.py). SGLang projects those features through `fc`/`hidden_norm` into the draft KV and keeps no
raw window, so the worker keeps one itself: the features are already in hand once per verify (the
target returns them for the draft KV), and keeping the last N per request costs
max_requests · N · L·D values (Qwen3-4B: 64 × 12,800 × 2 bytes = 1.6 MB per request in bf16) and
one scatter + one gather per round. Trained checkpoints work unchanged. Reading the projected
features instead would change the selector's input distribution and needs a retrained selector
(future work, see docs/sglang.md).

Layout: `buf [R, N, F]` indexed by SGLang's request-pool slot (`req_pool_idx`); entry e of a request
(e = 0, 1, … in commit order) lives at ring position e mod N; `count [R]` entries ever appended.
`read` returns exactly what the engine's `VerifiedHistory` holds for the same commits: the last N
entries right-aligned, oldest first, zero-padded, with a mask of real entries. Fixed shapes and no
host syncs: both calls can run inside a captured CUDA graph.
"""

from __future__ import annotations

import torch


class RequestFeatureRing:
    def __init__(self, max_requests: int, size: int, dim: int, *, dtype=torch.float32, device="cpu") -> None:
        if max_requests < 1 or size < 1 or dim < 1:
            raise ValueError(f"RequestFeatureRing needs max_requests, size, dim ≥ 1 (got {max_requests}, {size}, {dim})")
        self.size = size
        self.buf = torch.zeros(max_requests, size, dim, dtype=dtype, device=device)  # [R, N, F]
        self.count = torch.zeros(max_requests, dtype=torch.long, device=device)  # [R]

    def reset(self, slots: torch.Tensor) -> None:
        """Forget the requests at `slots` [B] (a new request reuses a pool slot)."""
        self.count[slots] = 0

    def append(self, slots: torch.Tensor, feats: torch.Tensor, n_new: torch.Tensor) -> None:
        """Commit the first n_new[b] rows of feats[b] ([B, T, F], left-aligned) to request slots[b].

        Rows beyond the last N of a commit can never be read: a commit longer than N (a prefill)
        keeps its last N rows only.
        """
        N = self.size
        B, T, _ = feats.shape
        if T > N:  # keep each row's last min(n_new, N) committed rows, left-aligned
            start = (n_new - N).clamp(min=0)  # [B]
            idx = (start[:, None] + torch.arange(N, device=feats.device)).clamp(max=T - 1)  # [B, N]
            feats = feats.gather(1, idx[:, :, None].expand(B, N, feats.shape[2]))
            n_new, T = n_new.clamp(max=N), N
        t = torch.arange(T, device=feats.device)
        pos = (self.count[slots][:, None] + t) % N  # [B, T] distinct per row since T ≤ N
        rows = slots[:, None].expand(B, T)
        old = self.buf[rows, pos]  # [B, T, F]
        keep = (t[None, :] < n_new[:, None])[:, :, None]
        self.buf[rows, pos] = torch.where(keep, feats.to(self.buf.dtype), old)
        self.count[slots] += n_new

    def append_packed(
        self, slots: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, feats: torch.Tensor
    ) -> None:
        """Commit lens[b] entries to request slots[b] [B] from packed rows: feats [M, F] are the
        entries that can still be read (at most the last N of each commit, ring_feed.py), row m
        being entry offsets[m] (0-based within this commit) of batch row rows[m]. Writes M rows:
        no [B, longest commit, F] tensor."""
        slot = slots[rows]  # [M]
        pos = (self.count[slot] + offsets) % self.size  # [M]; distinct per request (≤ N consecutive entries)
        self.buf[slot, pos] = feats.to(self.buf.dtype)
        self.count[slots] += lens

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last N entries of requests `slots` [B] → (feats [B, N, F] right-aligned, oldest first,
        zeros where empty; mask [B, N] bool, True = a real entry)."""
        N = self.size
        entry = self.count[slots][:, None] - N + torch.arange(N, device=slots.device)  # [B, N] entry index
        mask = entry >= 0
        feats = self.buf[slots[:, None].expand_as(entry), entry % N]  # [B, N, F]
        return torch.where(mask[:, :, None], feats, torch.zeros_like(feats)), mask
