"""Training schedules as pure functions of the step: learning rate and per-slot support weights."""

from __future__ import annotations

import math

import torch


def slot_weights(H: int, decay: float | None) -> torch.Tensor:
    """[H] support-loss weight per slot: exp(-(i-1)/decay) (DFlash's decay), or uniform."""
    i = torch.arange(H, dtype=torch.float32)
    return torch.ones(H) if decay is None else torch.exp(-i / decay)


def lr_at(step: int, *, base: float, warmup: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the base rate."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
