"""The last N strictly verified target features of every row (what DRelay's causal selector reads).

Layout: right-aligned, oldest first. feats [B, N, F]; row b's valid entries are the last
min(count[b], N) positions; mask() marks them. Each round appends a different number of verified
positions per row (anchor + accepted drafts), so `push` gathers per row instead of shifting.
"""

from __future__ import annotations

import torch


class VerifiedHistory:
    def __init__(self, batch_size: int, size: int, dim: int, *, dtype=torch.float32, device="cpu") -> None:
        self.size = size
        self.feats = torch.zeros(batch_size, size, dim, dtype=dtype, device=device)  # [B, N, F]
        self.count = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B] entries ever pushed

    def push(self, new: torch.Tensor, n_new: torch.Tensor) -> None:
        """Append the first n_new[b] rows of new[b] ([B, T, F], left-aligned) to each row's history."""
        N = self.size
        h = self.count.clamp(max=N)  # [B] valid entries now
        total = h + n_new  # [B]
        both = torch.cat([self.feats, new.to(self.feats.dtype)], dim=1)  # [B, N + T, F]
        # Output slot j holds valid entry k = total - N + j of the sequence (old valid…, new valid…).
        k = total[:, None] - N + torch.arange(N, device=h.device)[None, :]  # [B, N]
        src = torch.where(k < h[:, None], N - h[:, None] + k, N + k - h[:, None])
        src = src.clamp(0, both.shape[1] - 1)
        gathered = both.gather(1, src[:, :, None].expand(-1, -1, both.shape[2]))
        self.feats = torch.where((k >= 0)[:, :, None], gathered, torch.zeros_like(gathered))
        self.count = self.count + n_new

    def mask(self) -> torch.Tensor:
        """[B, N] bool: True where the entry is real (right-aligned)."""
        h = self.count.clamp(max=self.size)
        return torch.arange(self.size, device=h.device)[None, :] >= (self.size - h)[:, None]

    def select_rows(self, rows: torch.Tensor) -> None:
        self.feats = self.feats[rows]
        self.count = self.count[rows]


def history_window(features: torch.Tensor, anchor_pos: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replay's equivalent of VerifiedHistory: the `size` features before `anchor_pos`.

    features [1, S, F] of a whole sequence → (feats [1, size, F] right-aligned, mask [1, size] bool).
    """
    lo = max(0, anchor_pos - size)
    window = features[:, lo:anchor_pos]
    n = window.shape[1]
    feats = torch.zeros(1, size, features.shape[2], dtype=features.dtype, device=features.device)
    feats[:, size - n :] = window
    mask = torch.arange(size, device=features.device)[None, :] >= size - n
    return feats, mask
