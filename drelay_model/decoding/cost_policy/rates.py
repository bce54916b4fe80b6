"""Running per-slot acceptance rates of one kind of drafted round (`policy.py`).

Two sets of decayed counts of the drafts verified at slot i (`seen_i`) and accepted (`hits_i`):

    recent    decay `rate_decay` per drafted round of this kind, and `idle_decay` per round of any
              other kind (an AR round, or a round of the other arm): what this text shows now
    long-run  decay `base_decay` per drafted round of this kind only: what it showed over its last
              few dozen such rounds, whatever ran in between

    b_i = (base_hits_i + κ_b·π_i) / (base_seen_i + κ_b)                 long-run rate, with prior π:
          π_i = b_{i−1} (b_0 = ½)                                       a slot rarely reached borrows
                                                                        the rate below it, or
          π_i = another kind's b_i (`rates(prior=…)`)                   a selector's rounds start
                                                                        from the native path's rates
    â_i = (hits_i + κ·b_i) / (seen_i + κ)                               recent evidence, shrunk
                                                                        towards the long-run rate
    â⁺_1 = â_1 + z·√(â_1(1 − â_1) / (1 + N)), â⁺_i = â_i (i ≥ 2)       an upper estimate, for the
                                                                        plan (`upper_rates`); N = the
                                                                        first drafts this kind has
                                                                        had verified, ever

κ_b is small (2) and κ large (16) by default (`PolicySettings.base_prior`, `.rate_prior`); while
other rounds run, â returns to the long-run rate. â⁺ is optimism in the face of uncertainty (as in
UCB bandits), on the first slot only (whether to draft at all is decided there), with an undecayed N
so the bonus is a cold start's and vanishes as the engine runs (z = `PolicySettings.optimism`).
Why these choices, with measurements: docs/verification-length.md. Plain Python floats: a round asks
a few dozen questions of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SlotRates:
    """Counts over H slots; see the module docstring."""

    num_slots: int
    hits: list[float] = field(init=False)  # [H] recent accepted drafts per slot
    seen: list[float] = field(init=False)  # [H] recent verified drafts per slot
    base_hits: list[float] = field(init=False)  # [H] long-run
    base_seen: list[float] = field(init=False)
    first_verified: int = 0  # N: first drafts verified by rounds of this kind, ever (not decayed)

    def __post_init__(self) -> None:
        H = self.num_slots
        self.hits, self.seen, self.base_hits, self.base_seen = [0.0] * H, [0.0] * H, [0.0] * H, [0.0] * H

    def base_rates(self, kappa: float, prior: list[float] | None = None) -> list[float]:
        """[H] b_i, with κ_b = kappa and prior π = `prior` [H] (None: the chain from b_0 = ½)."""
        rates, prev = [], 0.5
        for i, (hits, seen) in enumerate(zip(self.base_hits, self.base_seen)):
            prev = (hits + kappa * (prev if prior is None else prior[i])) / (seen + kappa)
            rates.append(prev)
        return rates

    def rates(self, kappa: float, base_kappa: float, prior: list[float] | None = None) -> list[float]:
        """[H] â_i with κ = kappa, κ_b = base_kappa (and b's prior `prior`, as in `base_rates`)."""
        return [(h + kappa * b) / (n + kappa) for h, n, b in zip(self.hits, self.seen, self.base_rates(base_kappa, prior))]

    def upper_rates(self, rates: list[float], z: float) -> list[float]:
        """[H] â⁺ from this kind's â `rates`: slot 1 raised by z standard errors of a rate seen N times."""
        a = rates[0]
        return [min(a + z * math.sqrt(a * (1.0 - a) / (1.0 + self.first_verified)), 1.0), *rates[1:]]

    def fade(self, idle_decay: float) -> None:
        """A round of another kind ran: the recent counts fade."""
        self.hits = [idle_decay * h for h in self.hits]
        self.seen = [idle_decay * n for n in self.seen]

    def observe(self, outcomes: list[tuple[int, bool]], *, rate_decay: float, base_decay: float) -> None:
        """One drafted round of this kind: (slot, accepted) for every draft it verified, all rows."""
        self.hits = [rate_decay * h for h in self.hits]
        self.seen = [rate_decay * n for n in self.seen]
        self.base_hits = [base_decay * h for h in self.base_hits]
        self.base_seen = [base_decay * n for n in self.base_seen]
        for i, hit in outcomes:
            self.first_verified += i == 0
            if i < self.num_slots:
                self.seen[i] += 1.0
                self.hits[i] += hit
                self.base_seen[i] += 1.0
                self.base_hits[i] += hit
