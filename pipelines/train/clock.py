"""The training loops' clocks: the time budget (`train.max_minutes`, wall or CPU seconds), the
wall-time checkpoint cadence (`train.checkpoint_minutes`) and the one-line progress report.

Why a CPU clock: a budget study runs beside other work on a shared machine. Wall seconds then buy a
run whatever CPU the others leave it, so equal wall budgets are not equal work. The process's CPU
time (`time.process_time`: every thread of the worker, which runs `ray.cpus_per_worker` intra-op
threads) counts only the work the run itself did, so two runs given 45 CPU-minutes each did equal
work, however loaded the machine was."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Iterator

import torch

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class TrainClock:
    """`train.max_minutes`: seconds spent in training steps (validation paused out), carried across a
    resume through the checkpoint, and the progress fraction the schedules follow:
    max(step / max_steps, spent / budget). Ranks agree on "spent" (the smallest clock: the others
    also wait out rank 0's validation at the report barrier), so every rank stops at the same step.

    `kind` picks what a second is: "wall" (perf_counter) or "cpu" (this process's CPU time).
    `checkpoint_minutes`: wall minutes between checkpoints (None: steps only), agreed by every rank."""

    def __init__(self, max_minutes: float | None, max_steps: int, *, kind: str = "wall", checkpoint_minutes: float | None = None):
        if kind not in CLOCKS:
            raise ValueError(f"clock kind must be one of {sorted(CLOCKS)}, got {kind!r}")
        self.budget = max_minutes * 60.0 if max_minutes else None
        self.max_steps = max_steps
        self.spent = 0.0
        self._now = CLOCKS[kind]
        self._since = self._now()
        self._checkpoint_every_s = checkpoint_minutes * 60.0 if checkpoint_minutes else None
        self._last_checkpoint = time.perf_counter()
        self._checkpoint_due = False

    def restart(self) -> None:
        """Start counting now (loading the model and data is not training)."""
        self._since = self._now()
        self._last_checkpoint = time.perf_counter()

    def progress(self, step: int) -> float:
        by_steps = step / self.max_steps
        return by_steps if self.budget is None else min(max(by_steps, self.spent / self.budget), 1.0)

    def schedule_step(self, step: int) -> int:
        """The step whose schedule value applies now (the step itself without a budget)."""
        return min(max(step, int(self.progress(step) * self.max_steps)), self.max_steps - 1)

    def tick(self, world: int) -> None:
        """After a step: count its seconds and decide (all ranks alike) whether a checkpoint is due."""
        now = self._now()
        self.spent += now - self._since
        self._since = now
        due = self._checkpoint_every_s is not None and time.perf_counter() - self._last_checkpoint >= self._checkpoint_every_s
        needs_agreement = self.budget is not None or self._checkpoint_every_s is not None
        if world > 1 and needs_agreement and torch.distributed.is_initialized():
            t = torch.tensor([-self.spent, float(due)])  # MAX of −spent is the smallest clock
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            self.spent, due = -float(t[0]), bool(t[1] > 0)
        self._checkpoint_due = due

    def checkpoint_due(self) -> bool:
        """Whether `checkpoint_minutes` of wall time passed since the last checkpoint (as of `tick`)."""
        return self._checkpoint_due

    def checkpointed(self) -> None:
        self._last_checkpoint = time.perf_counter()
        self._checkpoint_due = False

    def pause(self, seconds: float) -> None:
        """Seconds of this clock that were not training (validation): not counted."""
        self._since += seconds

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Whatever runs inside (validation) is not counted, on this clock's own time."""
        started = self._now()
        try:
            yield
        finally:
            self.pause(self._now() - started)

    def left(self) -> float | None:
        """Seconds of the budget left (None without a budget)."""
        return None if self.budget is None else self.budget - self.spent

    def spent_all(self, world: int) -> bool:
        return self.budget is not None and self.spent >= self.budget


class ProgressLine:
    """One line on the driver's console every `every` steps (Ray forwards worker stdout): step,
    losses, slot-1 accuracy, seconds per step and the time left at that pace. Under a CPU budget
    (`clock="cpu"`) the minutes left are CPU minutes; the line adds the wall minutes they take at
    the pace since the previous line (validation and a busy machine included)."""

    def __init__(self, start: int, total: int, every: int = 25, *, clock: str = "wall") -> None:
        self.start, self.total, self.every, self.t0 = start, total, every, time.perf_counter()
        self.clock = clock
        self._previous: tuple[float, float] | None = None  # (wall time, budget seconds left) at the last line

    def update(self, step: int, metrics: dict, *, budget_left_s: float | None = None, last: bool = False) -> None:
        """`budget_left_s`: the time budget left (train.max_minutes), when it ends the run sooner."""
        if step % self.every and step != self.total and not last:
            return
        now = time.perf_counter()
        per_step = (now - self.t0) / max(step - self.start, 1)
        left = (self.total - step) * per_step / 60
        left_text = f"{left:.1f} min left"
        if budget_left_s is not None and budget_left_s / 60 < left:
            left = max(budget_left_s, 0.0) / 60
            left_text = f"{left:.1f} {self.clock} min left"
            if self.clock != "wall" and self._previous is not None and self._previous[1] > budget_left_s:
                rate = (self._previous[1] - budget_left_s) / (now - self._previous[0])  # budget s per wall s
                left_text += f" (~{left / rate:.0f} wall min at this pace)"
        if budget_left_s is not None:
            self._previous = (now, budget_left_s)
        losses = " ".join(f"{k.removeprefix('loss/')} {v:.3f}" for k, v in metrics.items() if k.startswith("loss/"))
        val = " ".join(f"{k.removeprefix('val/')} {v:.3f}" for k, v in metrics.items() if k.startswith("val/"))
        line = (f"[train] step {step}/{self.total} · {losses} · slot-1 acc {metrics.get('acc/slot1', 0.0):.3f} · "
                f"{per_step:.2f} s/step · {left_text}{' · ' + val if val else ''}")  # fmt: skip
        # The process's own stdout, once: Ray Train patches print() to log through its logger *and*
        # echo to a wrapped sys.stdout, which printed every line twice on the driver.
        print(line, file=sys.__stdout__, flush=True)
