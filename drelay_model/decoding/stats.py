"""Decoding statistics shared by real decoding and replay.

τ (tokens per round) = tokens committed by verification rounds / rounds, where a round commits its
accepted drafts plus the target's bonus/replacement token (truncated at EOS or the token budget).
The first generated token comes from prefill and belongs to no round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

PHASES = ("draft", "select", "verify", "other")


def tau_of(committed: int, rounds: int) -> float:
    """Tokens committed per verification round (1.0 for autoregressive decoding)."""
    return committed / rounds if rounds else 0.0


def slot_acceptance_of(accept_hist: Sequence[int], rounds: int) -> list[float]:
    """P(draft at slot i accepted), i = 1..H, from accept_hist [H+1] (row-rounds that accepted
    exactly n drafts): the share of rounds that accepted ≥ i drafts."""
    hist = [int(n) for n in accept_hist]
    if not rounds:
        return [0.0] * (len(hist) - 1)
    tail, out = 0, []
    for n in range(len(hist) - 1, 0, -1):
        tail += hist[n]
        out.append(tail / rounds)
    return out[::-1]


def other_time_of(prefill: float, draft: float, select: float, verify: float, total: float) -> float:
    """Wall seconds outside the timed phases (bookkeeping, KV-cache moves, Python)."""
    return max(total - (prefill + draft + select + verify), 0.0)


def ms_per_step_of(steps: int, prefill: float, draft: float, select: float, verify: float, total: float) -> dict[str, float]:
    """Mean milliseconds per engine step by phase (prefill excluded; `other` = the rest of the wall time)."""
    other = other_time_of(prefill, draft, select, verify, total)
    n = max(steps, 1)
    return {phase: 1e3 * t / n for phase, t in zip(PHASES, (draft, select, verify, other))}


@dataclass
class DecodeStats:
    """Counters accumulated over every row and round of one generate() call.

    accept_hist  [H+1] int64: accept_hist[n] = number of row-rounds that accepted exactly n drafts.
    committed    tokens committed by rounds (excludes each row's prefill token).
    rounds       row-rounds (one per row per verification).
    steps        engine iterations (one batched draft → select → verify each).
    Times are wall seconds of the whole batch, by phase.
    """

    num_slots: int
    accept_hist: torch.Tensor = field(init=False)
    committed: int = 0
    rounds: int = 0
    steps: int = 0
    generated: int = 0
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_select: float = 0.0
    time_verify: float = 0.0
    time_total: float = 0.0

    def __post_init__(self) -> None:
        self.accept_hist = torch.zeros(self.num_slots + 1, dtype=torch.long)

    def record_round(self, accepted: list[int], committed: list[int]) -> None:
        for n, c in zip(accepted, committed):
            # A round cut short by EOS or the budget counts only the drafts it actually committed,
            # so real decoding and replay (which cannot see past the end) record the same histogram.
            self.accept_hist[min(n, c - 1)] += 1
            self.committed += c
        self.rounds += len(accepted)

    @property
    def tau(self) -> float:
        """Tokens committed per verification round (1.0 for autoregressive decoding)."""
        return tau_of(self.committed, self.rounds)

    @property
    def slot_acceptance(self) -> list[float]:
        """P(draft at slot i accepted), i = 1..H: fraction of rounds that accepted ≥ i drafts."""
        return slot_acceptance_of(self.accept_hist.tolist(), self.rounds)

    @property
    def time_other(self) -> float:
        return other_time_of(self.time_prefill, self.time_draft, self.time_select, self.time_verify, self.time_total)

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.time_total if self.time_total > 0 else 0.0

    def breakdown_ms_per_step(self) -> dict[str, float]:
        """Mean milliseconds per engine step for each phase (prefill excluded)."""
        return ms_per_step_of(self.steps, self.time_prefill, self.time_draft, self.time_select, self.time_verify, self.time_total)

    def summary(self) -> dict[str, float]:
        return {
            "tau": self.tau,
            "rounds": self.rounds,
            "generated_tokens": self.generated,
            "tokens_per_s": self.tokens_per_second,
            "wall_s": self.time_total,
            **{f"ms_{k}": v for k, v in self.breakdown_ms_per_step().items()},
        }
