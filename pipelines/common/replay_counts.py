"""Per-prompt counts of a greedy replay, gathered from `replay`'s round hook (`on_round`): how
many rounds each replayed row took and how many tokens they committed. Training's validation and
`drelay eval`/`drelay compare` both read τ per prompt, and its interval over prompts, from here."""

from __future__ import annotations

import numpy as np

from drelay_model.decoding.stats import tau_of
from pipelines.common.intervals import Interval, paired_bootstrap, paired_rate_ratio, ratio_of_means


class ReplayCounts:
    """rounds[row] and committed[row] for rows 0..n−1 of one `replay` call (its `on_round` hook)."""

    def __init__(self, n: int) -> None:
        self.rounds, self.committed = [0] * n, [0] * n

    def add(self, r) -> None:
        """`replay`'s round hook: one more round of row `r.row`, `r.committed` tokens."""
        self.rounds[r.row] += 1
        self.committed[r.row] += r.committed

    def tau(self, row: int) -> float:
        return tau_of(self.committed[row], self.rounds[row])

    def tau_interval(self) -> Interval:
        """Σ committed ÷ Σ rounds (= replay τ) with its 95% bootstrap interval over the rows."""
        counts = np.array([self.committed, self.rounds], dtype=float).T  # [n, (committed, rounds)]
        return paired_bootstrap([counts], ratio_of_means(0, 1))

    def tau_ratio(self, other: ReplayCounts) -> Interval:
        """τ of these rows ÷ τ of `other`'s, the same rows replayed another way, with its 95% bootstrap
        interval paired by row (each resample keeps a row's four counts together)."""
        return paired_rate_ratio(self.committed, self.rounds, other.committed, other.rounds)
