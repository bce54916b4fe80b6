"""Decoding statistics shared by real decoding and replay.

τ (tokens per round) = tokens committed by verification rounds / rounds, where a round commits its
accepted drafts plus the target's bonus/replacement token (truncated at EOS or the token budget).
The first generated token comes from prefill and belongs to no round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
        return self.committed / self.rounds if self.rounds else 0.0

    @property
    def slot_acceptance(self) -> list[float]:
        """P(draft at slot i accepted), i = 1..H: fraction of rounds that accepted ≥ i drafts."""
        if self.rounds == 0:
            return [0.0] * self.num_slots
        at_least = self.accept_hist.flip(0).cumsum(0).flip(0)[1:]  # [H]: rounds with n ≥ i
        return (at_least.double() / self.rounds).tolist()

    @property
    def time_other(self) -> float:
        busy = self.time_prefill + self.time_draft + self.time_select + self.time_verify
        return max(self.time_total - busy, 0.0)

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.time_total if self.time_total > 0 else 0.0

    def breakdown_ms_per_step(self) -> dict[str, float]:
        """Mean milliseconds per engine step for each phase (prefill excluded)."""
        n = max(self.steps, 1)
        return {
            "draft": 1e3 * self.time_draft / n,
            "select": 1e3 * self.time_select / n,
            "verify": 1e3 * self.time_verify / n,
            "other": 1e3 * self.time_other / n,
        }

    def summary(self) -> dict[str, float]:
        return {
            "tau": self.tau,
            "rounds": self.rounds,
            "generated_tokens": self.generated,
            "tokens_per_s": self.tokens_per_second,
            "wall_s": self.time_total,
            **{f"ms_{k}": v for k, v in self.breakdown_ms_per_step().items()},
        }
