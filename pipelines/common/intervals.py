"""Confidence intervals for the ratios the platform reports: a paired, stratified percentile bootstrap.

Every comparison here is paired: the same prompts (or repetitions, or load legs) measured under every
variant. A resample draws, within each group (a benchmark), as many items as the group holds, with
replacement, and keeps each item's whole row — its values under every variant — so the variation the
variants share cancels in their ratio. A statistic over several groups (the mean over benchmarks)
resamples every group at once.

    groups[g]      float array [n_g, C]: item i of group g, its C measured columns
                   (e.g. committed and rounds for the variant and for the baseline)
    statistic(M)   M: list over groups of column means, each [..., C] → the statistic, [...]
                   (called once on the observed means [C] and once on all resamples [R, C])
    interval       the 2.5% and 97.5% percentiles of the R resampled statistics (level 0.95),
                   the resampled means widened by sqrt(n/(n−1)) about the observed ones (the
                   plug-in variance is (n−1)/n of the sampling variance: a group of 8 prompts would
                   otherwise cover a 95% interval's truth ~92% of the time)

Ratios of totals are ratios of column means, so any statistic over totals is a statistic over means.
Defaults: 2,000 resamples, seed 0, level 0.95 (the DRelay paper's Figure 2 reports 95% intervals
resampled over prompts within task). `tests/pipelines/test_intervals.py` checks the coverage on
synthetic data with a known ratio.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_RESAMPLES = 2000
DEFAULT_SEED = 0
DEFAULT_LEVEL = 0.95

AHEAD, BEHIND, UNRESOLVED = "ahead", "behind", "unresolved"
# fewer paired items than this (repetitions, load legs) give no interval worth printing: a resample of
# two items takes three distinct values
MIN_PAIRS = 3

Statistic = Callable[[list[np.ndarray]], np.ndarray]


@dataclass(frozen=True)
class Interval:
    """A point estimate and its confidence interval [low, high] at `level`."""

    point: float
    low: float
    high: float
    level: float = DEFAULT_LEVEL

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2.0

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def verdict(self, reference: float = 1.0) -> str:
        """`ahead` when the whole interval lies above `reference`, `behind` below, else `unresolved`."""
        if self.low > reference:
            return AHEAD
        if self.high < reference:
            return BEHIND
        return UNRESOLVED

    def format(self, digits: int = 3) -> str:
        """`1.046 [1.021, 1.072]`."""
        return f"{self.point:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"

    def as_dict(self, name: str) -> dict[str, float]:
        """`{name: point, name_ci_low: low, name_ci_high: high}`: the MLflow metric names."""
        return {name: self.point, f"{name}_ci_low": self.low, f"{name}_ci_high": self.high}


def check_bootstrap_options(resamples: int, level: float) -> None:
    """One-line errors for the options every command shares (`--bootstrap-resamples`, the level)."""
    if not isinstance(resamples, int) or resamples < 100:
        raise ValueError(f"bootstrap resamples must be an integer >= 100, got {resamples!r}")
    if not 0.5 <= level < 1.0:
        raise ValueError(f"confidence level must be in [0.5, 1), got {level!r}")


def paired_bootstrap(
    groups: Sequence[np.ndarray],
    statistic: Statistic,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    level: float = DEFAULT_LEVEL,
) -> Interval:
    """The statistic of the observed column means and its stratified percentile interval.

    Args:
        groups     per group, a float array [n_g, C] (n_g ≥ 1; every group the same C).
        statistic  maps a list of per-group column means ([..., C] each) to [...] (vectorised).
        resamples  bootstrap resamples R (≥ 100); seed: the generator's seed (same seed, same interval).
    Returns:
        Interval(point, low, high, level). A group of one item contributes no spread; non-finite
        resampled statistics (a zero denominator) are dropped, and an interval with none left is NaN.
    """
    check_bootstrap_options(resamples, level)
    arrays = [np.asarray(g, dtype=np.float64) for g in groups]
    if not arrays or any(a.ndim != 2 or a.shape[0] < 1 for a in arrays):
        raise ValueError("paired_bootstrap: every group must be a non-empty [n, C] array")
    if len({a.shape[1] for a in arrays}) != 1:
        raise ValueError("paired_bootstrap: every group must have the same columns")
    point = float(statistic([a.mean(axis=0) for a in arrays]))
    rng = np.random.default_rng(seed)
    means = []
    for a in arrays:  # [R, n] indices within the group → [R, C] resampled column means
        n = a.shape[0]
        idx = rng.integers(0, n, size=(resamples, n))
        observed = a.mean(axis=0)
        # Resampled means spread by sqrt((n−1)/n) of the sampling spread (the plug-in variance);
        # widen them back by sqrt(n/(n−1)) about the observed mean, or small groups under-cover.
        widen = math.sqrt(n / (n - 1)) if n > 1 else 0.0
        means.append(observed + widen * (a[idx].mean(axis=1) - observed))
    stats = np.asarray(statistic(means), dtype=np.float64).reshape(resamples)
    stats = stats[np.isfinite(stats)]
    if stats.size == 0:
        return Interval(point, math.nan, math.nan, level)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(stats, [tail, 1.0 - tail])
    return Interval(point, float(low), float(high), level)


def ratio_of_means(num: int, den: int) -> Statistic:
    """Statistic for one group: mean of column `num` ÷ mean of column `den`."""
    return lambda means: means[0][..., num] / means[0][..., den]


def paired_ratio(a: Sequence[float], b: Sequence[float], **options) -> Interval:
    """mean(a) ÷ mean(b) over paired items (a[i] and b[i] measured together, e.g. one repetition or
    one load leg), with its bootstrap interval."""
    if len(a) != len(b) or not len(a):
        raise ValueError(f"paired_ratio: need equal, non-empty samples, got {len(a)} and {len(b)}")
    rows = np.column_stack([np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)])
    return paired_bootstrap([rows], ratio_of_means(0, 1), **options)


def paired_rate_ratio(
    amount_a: Sequence[float], seconds_a: Sequence[float], amount_b: Sequence[float], seconds_b: Sequence[float], **options
) -> Interval:
    """(Σ amount_a ÷ Σ seconds_a) ÷ (Σ amount_b ÷ Σ seconds_b): the ratio of two pooled rates (tokens/s)
    over paired items (item i of a and of b measured together: one repetition, one pair of load legs),
    with its bootstrap interval. A ratio of sums is a ratio of means, so each resample keeps item i's
    four values together."""
    cols = [np.asarray(c, dtype=np.float64) for c in (amount_a, seconds_a, amount_b, seconds_b)]
    if len({c.shape for c in cols}) != 1 or cols[0].ndim != 1 or not cols[0].size:
        raise ValueError(f"paired_rate_ratio: need four equal, non-empty samples, got lengths {[c.size for c in cols]}")

    def rate_ratio(means: list[np.ndarray]) -> np.ndarray:  # means[0]: [..., 4]
        m = means[0]
        return (m[..., 0] / m[..., 1]) / (m[..., 2] / m[..., 3])

    return paired_bootstrap([np.column_stack(cols)], rate_ratio, **options)


def mean_interval(values: Sequence[float], **options) -> Interval:
    """The mean of independent items (prompts) with its bootstrap interval."""
    if not len(values):
        raise ValueError("mean_interval: no values")
    rows = np.asarray(values, dtype=np.float64).reshape(-1, 1)
    return paired_bootstrap([rows], lambda means: means[0][..., 0], **options)
