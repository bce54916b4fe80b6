"""The selector stage's cool-down: the schedules end where an early-stopped run ends.

`train.max_steps` sets every schedule (the learning-rate decay, α, the credit blend β, the
native-anchor share), but an early-stopped run ends long before it. When the stop rule fires the run
therefore does not stop at once: it restores the best validated head and trains `n` more steps with

    every ramp at its end value (progress 1: β = β_end, α = α_end, native share = its end), and
    lr_k = lr_s + (floor − lr_s) · f_k,   f_k = max((k + 1) / n, seconds spent since / budget left)

so the last step trains at the floor `LR_FLOOR · train.lr` (`drelay_model.training.schedules`), and
a time-budgeted run (`train.max_minutes`) reaches it when its budget runs out. The head exported is
the cool-down's last one. `n` is `train.cooldown_steps`, by default a tenth of the steps run
when the stop fired (at least one), never past `train.max_steps`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from drelay_model.training.schedules import lr_cooldown

DEFAULT_FRACTION = 0.1  # of the steps run when the stop fires


def cooldown_length(configured: int | None, *, steps_run: int, steps_left: int) -> int:
    """The cool-down's steps: `configured` (0: none), or ⌈DEFAULT_FRACTION · steps_run⌉ ≥ 1 when None;
    at most `steps_left` (the steps to `train.max_steps`)."""
    n = max(math.ceil(DEFAULT_FRACTION * steps_run), 1) if configured is None else configured
    return max(min(n, steps_left), 0)


@dataclass(frozen=True)
class Cooldown:
    """A cool-down under way. `start`: its first step (0-based); `steps`: n ≥ 1; `lr_start`: the rate at
    the stop; `spent_start`: the clock's training seconds then; `budget_left`: the seconds of
    `train.max_minutes` left then (None: no budget)."""

    start: int
    steps: int
    lr_start: float
    spent_start: float = 0.0
    budget_left: float | None = None

    def fraction(self, step: int, spent: float) -> float:
        """How much of the cool-down is done after `step` (0-based), by steps or by time: ∈ (0, 1]."""
        by_steps = (step - self.start + 1) / self.steps
        if self.budget_left is None:
            return min(by_steps, 1.0)
        return min(max(by_steps, (spent - self.spent_start) / max(self.budget_left, 1e-9)), 1.0)

    def lr(self, step: int, spent: float, *, base: float) -> float:
        return lr_cooldown(self.fraction(step, spent), start=self.lr_start, base=base)

    def ends_at(self, step: int) -> bool:
        """Whether `step` (0-based) is its last."""
        return step + 1 >= self.start + self.steps

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict | None) -> "Cooldown | None":
        return None if doc is None else cls(**doc)
