"""Running per-slot acceptance rates of one kind of drafted round (`verify_length.py`).

Two sets of decayed counts of the drafts verified at slot i (`seen_i`) and accepted (`hits_i`):

    recent    decay `rate_decay` per drafted round of this kind, and `idle_decay` per round of any
              other kind (an AR round, or a round of the other arm): what this text shows now
    long-run  decay `base_decay` per drafted round of this kind only: what it showed over its last
              few dozen such rounds, whatever ran in between

    b_i = (base_hits_i + κ_b·b_{i−1}) / (base_seen_i + κ_b),   b_0 = ½   a slot rarely reached
                                                                        borrows the rate below it
    â_i = (hits_i + κ·b_i) / (seen_i + κ)                               recent evidence, shrunk
                                                                        towards the long-run rate

κ_b stays small (2): the long-run counts hold ~50 rounds, and a large κ_b would keep ½ in b_1 for
good (with κ_b = 16, text accepting 20% of first drafts read 27%, above break-even on a 2-core CPU).

So while other rounds run, â returns to the long-run rate and not to an optimistic constant, and one
probe that hits moves it by about (1 − â)/(κ + 1) (κ = 16 by default: `CostAwareLength.rate_prior`).
Plain Python floats: a round asks a few dozen questions of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SlotRates:
    """Counts over H slots; see the module docstring."""

    num_slots: int
    hits: list[float] = field(init=False)  # [H] recent accepted drafts per slot
    seen: list[float] = field(init=False)  # [H] recent verified drafts per slot
    base_hits: list[float] = field(init=False)  # [H] long-run
    base_seen: list[float] = field(init=False)

    def __post_init__(self) -> None:
        H = self.num_slots
        self.hits, self.seen, self.base_hits, self.base_seen = [0.0] * H, [0.0] * H, [0.0] * H, [0.0] * H

    def base_rates(self, kappa: float) -> list[float]:
        """[H] b_i, with κ_b = kappa."""
        rates, prev = [], 0.5
        for hits, seen in zip(self.base_hits, self.base_seen):
            prev = (hits + kappa * prev) / (seen + kappa)
            rates.append(prev)
        return rates

    def rates(self, kappa: float, base_kappa: float) -> list[float]:
        """[H] â_i with κ = kappa, κ_b = base_kappa."""
        return [(h + kappa * b) / (n + kappa) for h, n, b in zip(self.hits, self.seen, self.base_rates(base_kappa))]

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
            if i < self.num_slots:
                self.seen[i] += 1.0
                self.hits[i] += hit
                self.base_seen[i] += 1.0
                self.base_hits[i] += hit
