"""Which queued prompts a step of the continuous batcher prefills: a per-step prompt-token budget.

A step is an admission (prefill forwards of new prompts) then one round over the running rows. An
admission that prefills a whole burst stalls every running row for all of it (16 GSM8K chat prompts:
~2.3 s of prefill against a ~60 ms round), and every prompt in the burst waits for the prefills ahead
of it before its first token. With a budget of `budget` prompt tokens per step

    continue   the request being prefilled in chunks (if any) takes min(its remaining tokens, budget)
               and, while unfinished, ends the step's admission (nothing passes it)
    whole      then queued prompts, first in first out, while there is room in the batch and each
               prompt fits what is left of the budget
    start      a prompt longer than the whole budget (it could never fit) starts its chunked prefill
               with what is left, when it is next in line

so a step's prefill is at most `budget` tokens, the running rows decode every step, and no request
waits behind a later one (FIFO: a prompt that does not fit what is left goes first in the next step,
whose budget is whole). Prefilling a prompt in chunks extends its caches chunk by chunk (the target's
forward appends to a cache that holds the prompt's first tokens), so its rows equal one forward over
the whole prompt. budget None: every queued prompt with room is admitted whole (a static batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from drelay_model.errors import DRelayError

DEFAULT_PREFILL_BUDGET = 512  # prompt tokens per step: a serving endpoint's default (docs/serving.md)


@dataclass(frozen=True)
class AdmissionPlan:
    """continue_tokens: tokens of the chunked request's prompt to prefill now (0: none in progress);
    whole: the number of queued requests (from the front) prefilled whole; start_tokens: tokens of the
    next queued request's first chunk (0: none starts)."""

    continue_tokens: int = 0
    whole: int = 0
    start_tokens: int = 0


def check_budget(budget: int | None) -> int | None:
    """The budget as the batcher takes it: None (unbounded) or an integer ≥ 1; one-line error otherwise."""
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise DRelayError(f"prefill_budget must be a positive number of prompt tokens per step or None, got {budget!r}")
    return budget


def plan_admission(remaining: int | None, queued: list[int], room: int, budget: int | None) -> AdmissionPlan:
    """What this step prefills (module docstring).

    Args:
        remaining  prompt tokens the chunked request still needs (None: none in progress)
        queued     the queued prompts' lengths, oldest first
        room       rows the batch can still take (the chunked request's row already counted)
        budget     prompt tokens per step (None: unbounded)
    """
    left = float("inf") if budget is None else budget
    carry = 0
    if remaining is not None:
        carry = int(min(remaining, left))
        left -= carry
        if carry < remaining:
            return AdmissionPlan(continue_tokens=carry)
    whole = 0
    for n in queued[: max(room, 0)]:
        if n > left:
            break
        whole += 1
        left -= n
    start = 0
    if budget is not None and whole < min(len(queued), room) and queued[whole] > budget and left > 0:
        start = int(left)
    return AdmissionPlan(continue_tokens=carry, whole=whole, start_tokens=start)


@dataclass
class ChunkedPrefill:
    """A request whose prompt is being prefilled in chunks: `state` holds its row's caches after the
    `done` tokens prefilled so far (None before the first chunk)."""

    request: Any  # the batcher's request
    state: Any = None  # BatchState of its one row
    done: int = 0

    @property
    def remaining(self) -> int:
        return len(self.request.prompt) - self.done
