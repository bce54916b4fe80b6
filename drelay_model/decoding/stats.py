"""Decoding statistics shared by real decoding and replay.

τ (tokens per round) = tokens committed by verification rounds / rounds, where a round commits its
accepted drafts plus the target's bonus/replacement token (truncated at EOS or the token budget).
The first generated token comes from prefill and belongs to no round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

PHASES = ("draft", "select", "verify", "other")


def tau_of(committed: int, rounds: int) -> float:
    """Tokens committed per verification round (1.0 for autoregressive decoding)."""
    return committed / rounds if rounds else 0.0


def committed_drafts(accepted: int, committed: int) -> int:
    """The drafts a row-round counts as accepted: those it committed. A round cut short by EOS or the
    budget commits fewer than it accepted, so real decoding and replay (which cannot see past the
    end) record the same histogram; `committed` includes the round's bonus token."""
    return min(accepted, committed - 1)


class RoundCounters(Protocol):
    """What `count_row_round` updates: a batch's `DecodeStats` or one request's `RequestStats`."""

    accept_hist: Any  # [H+1] counts, indexable (a tensor or a list)
    committed: int
    rounds: int
    drafted_rounds: int
    verified_drafts: int


def count_row_round(counters: RoundCounters, accepted: int, committed: int, verified: int | None) -> int:
    """Count one row's round: the histogram bin of its committed drafts (`committed_drafts`), the tokens
    it committed, and for a drafted round the drafts it verified (None: an AR round). The one rule for
    a batch's and a request's counters, so their histograms and τ agree.

    Returns:
        the drafts counted as accepted (int).
    """
    if verified is not None:
        counters.drafted_rounds += 1
        counters.verified_drafts += verified
    n = committed_drafts(accepted, committed)
    counters.accept_hist[n] += 1
    counters.committed += committed
    counters.rounds += 1
    return n


@dataclass
class DecodeStats:
    """Counters accumulated over every row and round of one continuous batcher (one generate() call
    is one batcher's whole run) — or, merged with `+`,
    over many calls (an evaluation pass, a cell, a benchmark); `to_dict`/`from_dict` round-trip JSON.

    accept_hist  [H+1] int64: accept_hist[n] = number of row-rounds that accepted exactly n drafts.
    committed    tokens committed by rounds (excludes each row's prefill token).
    rounds       row-rounds (one per row per verification).
    steps        engine iterations (one batched draft → select → verify each).
    drafted_steps   steps that drafted (the rest were AR rounds of a cost-aware policy);
    drafted_rounds  row-rounds of those steps; verified_drafts: the drafts they submitted for
                    verification (mean_verify_length = verified_drafts / drafted_rounds);
    selector_steps  drafted steps that ran the selector (the rest kept the native path: a
                    two-armed cost-aware policy's native arm).
    requests     requests admitted (generate() rows), i.e. prefilled rows.
    Times are wall seconds of the whole batch, by phase.
    """

    num_slots: int
    accept_hist: torch.Tensor = field(init=False)
    committed: int = 0
    rounds: int = 0
    steps: int = 0
    drafted_steps: int = 0
    drafted_rounds: int = 0
    verified_drafts: int = 0
    selector_steps: int = 0
    generated: int = 0
    requests: int = 0
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_select: float = 0.0
    time_verify: float = 0.0
    time_total: float = 0.0

    def __post_init__(self) -> None:
        self.accept_hist = torch.zeros(self.num_slots + 1, dtype=torch.long)

    _COUNTS = ("committed", "rounds", "steps", "drafted_steps", "drafted_rounds", "verified_drafts", "selector_steps",
               "generated", "requests")  # fmt: skip
    _TIMES = ("time_prefill", "time_draft", "time_select", "time_verify", "time_total")

    def __add__(self, other: "DecodeStats") -> "DecodeStats":
        """Sums of every counter, time and histogram bin (histograms of different H are zero-padded)."""
        out = DecodeStats(num_slots=max(self.num_slots, other.num_slots))
        for name in (*self._COUNTS, *self._TIMES):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.accept_hist[: self.num_slots + 1] += self.accept_hist
        out.accept_hist[: other.num_slots + 1] += other.accept_hist
        return out

    @classmethod
    def merged(cls, parts: Sequence["DecodeStats"], num_slots: int = 0) -> "DecodeStats":
        out = cls(num_slots=num_slots)
        for p in parts:
            out = out + p
        return out

    def to_dict(self) -> dict:
        """Plain JSON values: counters, times, and accept_hist as a list."""
        d = {name: getattr(self, name) for name in ("num_slots", *self._COUNTS, *self._TIMES)}
        return {**d, "accept_hist": [int(n) for n in self.accept_hist.tolist()]}

    @classmethod
    def from_dict(cls, d: dict) -> "DecodeStats":
        """Inverse of `to_dict`; fields missing from older files (e.g. `requests`) read as 0."""
        out = cls(num_slots=int(d["num_slots"]))
        for name in (*cls._COUNTS, *cls._TIMES):
            setattr(out, name, type(getattr(out, name))(d.get(name, 0)))
        hist = list(d.get("accept_hist") or [])
        if len(hist) > out.num_slots + 1:
            raise ValueError(f"accept_hist has {len(hist)} bins for {out.num_slots} slots")
        out.accept_hist[: len(hist)] = torch.tensor(hist, dtype=torch.long)
        unknown = set(d) - {"num_slots", "accept_hist", *cls._COUNTS, *cls._TIMES}
        if unknown:
            raise KeyError(f"unknown DecodeStats fields: {sorted(unknown)}")
        return out

    def record_round(self, accepted: list[int], committed: list[int], verified: list[int] | None = None) -> None:
        """One step's row-rounds: drafts accepted and tokens committed per row, and for a drafted step
        the drafts each row submitted for verification (None: an AR step)."""
        for i, (n, c) in enumerate(zip(accepted, committed, strict=True)):
            count_row_round(self, n, c, None if verified is None else verified[i])

    @property
    def tau(self) -> float:
        """Tokens committed per verification round (1.0 for autoregressive decoding)."""
        return tau_of(self.committed, self.rounds)

    @property
    def mean_verify_length(self) -> float:
        """Drafts verified per drafted row-round (0.0 when none drafted)."""
        return self.verified_drafts / self.drafted_rounds if self.drafted_rounds else 0.0

    @property
    def slot_acceptance(self) -> list[float]:
        """P(draft at slot i accepted), i = 1..H: fraction of rounds that accepted ≥ i drafts
        (the reversed cumulative sum of accept_hist[1:], divided by rounds)."""
        if not self.rounds:
            return [0.0] * self.num_slots
        at_least = self.accept_hist[1:].flip(0).cumsum(0).flip(0)  # [H]: rounds with ≥ i accepted
        return (at_least.double() / self.rounds).tolist()

    @property
    def time_other(self) -> float:
        """Wall seconds outside the timed phases (bookkeeping, KV-cache moves, Python)."""
        return max(self.time_total - (self.time_prefill + self.time_draft + self.time_select + self.time_verify), 0.0)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per wall second, prefill included (the numerator and denominator of S)."""
        return self.generated / self.time_total if self.time_total > 0 else 0.0

    @property
    def ms_prefill(self) -> float:
        """Mean prefill ms per request."""
        return 1e3 * self.time_prefill / self.requests if self.requests else 0.0

    def breakdown_ms_per_step(self) -> dict[str, float]:
        """Mean milliseconds per engine step for each phase (prefill excluded)."""
        n = max(self.steps, 1)
        times = (self.time_draft, self.time_select, self.time_verify, self.time_other)
        return {phase: 1e3 * t / n for phase, t in zip(PHASES, times)}

    def summary(self) -> dict[str, float]:
        return {
            "tau": self.tau,
            "rounds": self.rounds,
            "generated_tokens": self.generated,
            "tokens_per_s": self.tokens_per_second,
            "wall_s": self.time_total,
            **{f"ms_{k}": v for k, v in self.breakdown_ms_per_step().items()},
        }


@dataclass
class RequestStats:
    """One request's decoding counters (SGLang's names in brackets).

    rounds        verification rounds the request took part in [spec_verify_ct].
    committed     tokens committed by those rounds = accepted + bonus (the prefill token excluded).
    accepted      drafted tokens accepted and committed; bonus = one target token per round.
    accept_hist   [H+1]: accept_hist[n] = rounds that committed exactly n drafts.
    drafted_rounds  rounds that drafted (the rest were AR rounds of a cost-aware policy).
    verified_drafts drafts submitted for verification in those rounds (mean_verify_length per round).
    generated     all generated tokens = committed + 1 (the prefill token).
    time_to_first_token = time_queue + time_prefill + time_first_round (seconds):
      time_queue        submitted → its first prefill forward starts (a full batch, the prefills of
                        the step ahead of it, the budget, the round running when it arrived)
      time_prefill      its first prefill forward starts → its last ends (chunks: the steps between)
      time_first_round  prefill ends → its first token is out (chosen, its row joined to the batch)
    """

    num_slots: int
    prompt_tokens: int
    accept_hist: list[int] = field(default_factory=list)
    rounds: int = 0
    committed: int = 0
    accepted: int = 0
    drafted_rounds: int = 0
    verified_drafts: int = 0
    generated: int = 0
    time_to_first_token: float = 0.0
    time_queue: float = 0.0
    time_prefill: float = 0.0
    time_first_round: float = 0.0
    time_total: float = 0.0

    def __post_init__(self) -> None:
        self.accept_hist = self.accept_hist or [0] * (self.num_slots + 1)

    def record_round(self, accepted: int, committed: int, verified: int | None = None) -> None:
        """One round: drafts accepted, tokens committed, and the drafts verified (None: an AR round)."""
        self.accepted += count_row_round(self, accepted, committed, verified)  # DecodeStats' rule

    @property
    def mean_verify_length(self) -> float:
        """Drafts verified per drafted round (0.0 when none drafted)."""
        return self.verified_drafts / self.drafted_rounds if self.drafted_rounds else 0.0

    @property
    def bonus(self) -> int:
        return self.committed - self.accepted

    @property
    def tau(self) -> float:
        return tau_of(self.committed, self.rounds)
