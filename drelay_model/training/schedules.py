"""Training schedules as pure functions of the step: learning rate and per-slot support weights."""

from __future__ import annotations

import math

import torch

LR_FLOOR = 0.1  # where the decay ends, as a fraction of the base rate


def slot_weights(H: int, decay: float | None) -> torch.Tensor:
    """[H] support-loss weight per slot: exp(-(i-1)/decay) (DFlash's decay), or uniform."""
    i = torch.arange(H, dtype=torch.float32)
    return torch.ones(H) if decay is None else torch.exp(-i / decay)


def lr_at(step: int, *, base: float, warmup: int, total: int, taken: int | None = None) -> float:
    """Linear warm-up over the first `warmup` optimizer steps, then cosine decay to `LR_FLOOR` of the
    base rate at step `total`. `step` is the schedule's step; `taken` the optimizer steps actually
    taken (default: `step`). They differ under a time budget, where the schedule's step follows the
    budget spent (`max_steps · spent / budget`) and runs far ahead of the steps taken: the warm-up
    still lasts `warmup` real steps."""
    taken = step if taken is None else taken
    if taken < warmup:
        return base * (taken + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return base * (LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress)))


def lr_cooldown(fraction: float, *, start: float, base: float) -> float:
    """A cool-down's rate: linear from `start` (the rate when it began) down to the floor
    `LR_FLOOR · base` as `fraction` ∈ [0, 1] of it is done; a start already below the floor (a stop
    during warm-up) stays where it is."""
    end = min(LR_FLOOR * base, start)
    return start + (end - start) * min(max(fraction, 0.0), 1.0)
