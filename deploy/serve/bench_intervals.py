"""95% intervals of a paired serve benchmark's B ÷ A ratios, over its pairs of legs (no HTTP, no Ray).

At one concurrency level, leg r of A and leg r of B ask the same prompts, back to back in ABBA order
(`bench_pairing.py`): pair r = (A's leg r, B's leg r), and a resample draws `rounds` pairs with
replacement, keeping each pair's two legs together so that a slow stretch of the machine that both
legs of a pair saw cancels in the ratio.

    tokens/s     (Σ_r tokens_B,r ÷ Σ_r seconds_B,r) ÷ (Σ_r tokens_A,r ÷ Σ_r seconds_A,r): a ratio of pooled
                 rates, `pipelines.common.intervals.paired_rate_ratio` (the small-sample widening included)
    latency p99, TTFT p99   B's p99 ÷ A's p99 of the requests of the resampled legs, pooled (percentile
                 bootstrap of the printed statistic itself; a quantile has no widening)

With fewer than `MIN_PAIRS` pairs (`--rounds` below 3) there is no interval.
"""

from __future__ import annotations

import math

import numpy as np

from deploy.serve.bench import LevelResult, Sample, percentile
from pipelines.common.intervals import DEFAULT_LEVEL, DEFAULT_RESAMPLES, DEFAULT_SEED, MIN_PAIRS, paired_rate_ratio

# RATIO_KEYS' latency entries → the request field whose p99 they compare
QUANTILE_FIELDS = {"latency_p99_s": "latency", "ttft_p99_s": "ttft"}


def _ok(leg: LevelResult) -> list[Sample]:
    return [s for s in leg.samples if s.status == 200]


def pooled_p99_ratio(legs_a: list[LevelResult], legs_b: list[LevelResult], field: str) -> float:
    """B's p99 of `field` over the legs' successful requests ÷ A's (NaN when A's is 0)."""
    a = percentile(sorted(getattr(s, field) for leg in legs_a for s in _ok(leg)), 99)
    b = percentile(sorted(getattr(s, field) for leg in legs_b for s in _ok(leg)), 99)
    return b / a if a else math.nan


def _quantile_interval(
    legs_a: list[LevelResult], legs_b: list[LevelResult], field: str, *, resamples: int, seed: int
) -> tuple[float, float]:
    """The percentile interval of `pooled_p99_ratio` over resampled pairs of legs."""
    n = len(legs_a)
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))  # [R, n] pair indices
    stats = np.array([pooled_p99_ratio([legs_a[i] for i in row], [legs_b[i] for i in row], field) for row in idx])
    stats = stats[np.isfinite(stats)]
    if not stats.size:
        return math.nan, math.nan
    tail = (1.0 - DEFAULT_LEVEL) / 2.0
    low, high = np.quantile(stats, [tail, 1.0 - tail])
    return float(low), float(high)


def ratio_intervals(
    legs_a: list[LevelResult], legs_b: list[LevelResult], *, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED
) -> dict[str, float | None]:
    """`ratio_<key>_ci_low` / `_ci_high` for tokens/s, latency p99 and TTFT p99 of one level (None below
    MIN_PAIRS pairs or without data), and `leg_pairs`.

    Args:
        legs_a, legs_b  the level's legs of A and of B in round order (leg r of each asked the same prompts).
    """
    assert len(legs_a) == len(legs_b), "one leg of B per leg of A"
    n = len(legs_a)
    out: dict[str, float | None] = {"leg_pairs": n}
    names = ["tokens_per_s", *QUANTILE_FIELDS]
    out.update({f"ratio_{k}_ci_{side}": None for k in names for side in ("low", "high")})
    if n < MIN_PAIRS:
        return out
    tokens = [[sum(s.tokens for s in _ok(leg)) for leg in legs] for legs in (legs_b, legs_a)]
    seconds = [[leg.wall_s for leg in legs] for legs in (legs_b, legs_a)]
    if all(t > 0 for t in tokens[1]):
        iv = paired_rate_ratio(tokens[0], seconds[0], tokens[1], seconds[1], resamples=resamples, seed=seed)
        out["ratio_tokens_per_s_ci_low"], out["ratio_tokens_per_s_ci_high"] = iv.low, iv.high
    for key, field in QUANTILE_FIELDS.items():
        low, high = _quantile_interval(legs_a, legs_b, field, resamples=resamples, seed=seed)
        if math.isfinite(low):
            out[f"ratio_{key}_ci_low"], out[f"ratio_{key}_ci_high"] = low, high
    return out
