"""What one round of the engine passes from phase to phase, and its timer.

RoundPlan    plan → draft/select: how many path tokens the round may verify, which selector runs
PathChoice   select → verify/commit: the path each row submits, and its drafts' probabilities q
Verified     verify → commit: what the target accepted, and what the caches keep
RoundResult  what the round returns to the decoding loop
RoundTimer   wall-clock marks of the phases → `DecodeStats` times and the cost policy's `RoundTimes`
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from drelay_model.decoding.cost_policy import PolicyRound, RoundTimes
from drelay_model.decoding.logprobs import RowLogprobs
from drelay_model.decoding.stats import DecodeStats
from drelay_model.selectors.base import Selector


@dataclass(frozen=True)
class RoundPlan:
    """verify_slots: path tokens the round may verify (0 = an AR round); head_slots: slots drafted
    with an LM head (= verify_slots, or all H for a selector that reads the whole pool); selector:
    what picks the path (the engine's selector, or the native path on a native-arm round); rows:
    the batch size the round was planned for; cost: the cost policy's plan of this round, which
    cuts its paths and learns from it (None: every round verifies the whole path)."""

    verify_slots: int
    head_slots: int
    selector: Selector | None
    runs_selector: bool
    rows: int = 1
    cost: PolicyRound | None = None

    @property
    def drafts(self) -> bool:
        return self.verify_slots > 0


@dataclass
class PathChoice:
    """path [R, G] int64 (G ≤ H; 0 in an AR round), length [R] int64 (path tokens each row submits),
    q [R, G] float32: the chosen candidates' draft probabilities (cost-aware rounds only), proposal:
    (pool ids [R, H, K], q of the sampled path) when the path was sampled (T > 0), else None."""

    path: torch.Tensor
    length: torch.Tensor
    q: torch.Tensor | None = None
    proposal: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(frozen=True)
class Verified:
    """start [R] int64: the target cache's lengths before the verify forward; features [R, 1 + G, F]:
    the target's features at the verified positions; accepted [R] int64; next_token [R] int64;
    logits [R, 1 + G, V]: the target's logits there (for committed tokens' log-probabilities)."""

    start: torch.Tensor
    features: torch.Tensor
    accepted: torch.Tensor
    next_token: torch.Tensor
    logits: torch.Tensor | None = None


@dataclass(frozen=True)
class RoundResult:
    """accepted [R] int64 drafts each row accepted, next_token [R] int64 (the new anchor), path [R, G];
    logprobs: per row the committed tokens' log-probabilities (`logprobs.round_logprobs`; None for a
    row that did not ask), or None when no row asked; length [R] int64: the drafts each row submitted
    for verification (0 in an AR round); drafted: whether the round drafted."""

    accepted: torch.Tensor
    next_token: torch.Tensor
    path: torch.Tensor
    logprobs: list[RowLogprobs] | None = None
    length: torch.Tensor | None = None
    drafted: bool = False


@dataclass
class RoundTimer:
    """perf_counter marks of one round:

        start ─ plan ─ draft_start ─ catch-up ─ synced ─ draft ─ drafted ─ select ─ selected
              ─ verify_start ─ verify ─ verified ─ commit ─ (feed)

    `draft` (DecodeStats.time_draft) = drafter forwards: the context catch-up + the block;
    `select` = the selector and the policy's cut; `verify` = the target forward; the rest of the
    round (acceptance, cache crops, bookkeeping) is the engine's own overhead. An AR round has no
    draft marks."""

    start: float = field(default_factory=time.perf_counter)
    draft_start: float | None = None
    synced: float | None = None
    drafted: float | None = None
    selected: float | None = None
    verify_start: float = 0.0
    verified: float = 0.0

    def mark(self, name: str) -> None:
        setattr(self, name, time.perf_counter())

    @property
    def drafting(self) -> bool:
        return self.draft_start is not None

    def record(self, stats: DecodeStats) -> None:
        """Add this round's phase times to `stats`."""
        if self.drafting:
            stats.time_draft += self.drafted - self.draft_start
            stats.time_select += self.selected - self.drafted
        stats.time_verify += self.verified - self.verify_start

    def times(self, verify_width: int) -> RoundTimes:
        """This round's phases for the cost policy (ms, the whole round up to now); `verify_width`:
        the tokens per row the target verified."""
        drafting = catch_up = 0.0
        if self.drafting:
            drafting, catch_up = 1e3 * (self.selected - self.draft_start), 1e3 * (self.synced - self.draft_start)
        return RoundTimes(
            verify_width=verify_width, verify_ms=1e3 * (self.verified - self.verify_start),
            total_ms=1e3 * (time.perf_counter() - self.start), drafting_ms=drafting, catch_up_ms=catch_up,
        )  # fmt: skip
