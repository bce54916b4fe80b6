"""The paired, stratified bootstrap behind every interval the platform prints (pipelines/common/intervals.py)."""

import numpy as np
import pytest

from pipelines.common.intervals import (
    AHEAD,
    BEHIND,
    UNRESOLVED,
    Interval,
    paired_bootstrap,
    paired_rate_ratio,
    paired_ratio,
    ratio_of_means,
)


def _ratio_of_group_means(means):
    """Mean over groups of (mean column 0 ÷ mean column 1): the shape of a compare's mean ratio."""
    return np.mean([m[..., 0] / m[..., 1] for m in means], axis=0)


def test_the_95_interval_covers_a_known_ratio_in_93_to_97_percent_of_1000_repetitions():
    """Synthetic paired data whose true per-group ratio is 1.03 (a 3% gain): over 1,000 seeded
    repetitions, the interval contains 1.03 in 93–97% of them."""
    rng = np.random.default_rng(1234)
    true_ratio, covered = 1.03, 0
    for rep in range(1000):
        groups = []
        for g in range(4):  # four benchmarks of 24 prompts, prompts of very different difficulty
            base = rng.gamma(4.0, 0.5, size=24) + 1.0  # each prompt's τ under the baseline
            variant = base * true_ratio * rng.lognormal(0.0, 0.05, size=24) / np.exp(0.05**2 / 2)
            groups.append(np.column_stack([variant, base]))
        iv = paired_bootstrap(groups, _ratio_of_group_means, resamples=1000, seed=rep)
        covered += iv.contains(true_ratio)
    assert 930 <= covered <= 970, covered


def test_identical_variants_give_an_interval_that_contains_one():
    rng = np.random.default_rng(0)
    x = rng.gamma(3.0, 0.5, size=(16, 1)) + 1.0
    iv = paired_bootstrap([np.hstack([x, x]), np.hstack([x[:8], x[:8]])], _ratio_of_group_means)
    assert iv.point == pytest.approx(1.0) and iv.contains(1.0) and iv.verdict() == UNRESOLVED


def test_same_seed_same_interval_and_pairing_narrows_it():
    rng = np.random.default_rng(3)
    base = rng.gamma(4.0, 0.5, size=32) + 1.0
    variant = base * 1.05 * rng.lognormal(0, 0.02, size=32)
    a, b = paired_ratio(variant, base, seed=7), paired_ratio(variant, base, seed=7)
    assert a == b and a.verdict() == AHEAD
    unpaired = paired_ratio(variant, rng.permutation(base), seed=7)  # the pairing broken
    assert unpaired.half_width > 3 * a.half_width


def test_interval_format_verdict_and_metric_names():
    iv = Interval(1.046, 1.021, 1.072)
    assert iv.format() == "1.046 [1.021, 1.072]" and iv.verdict() == AHEAD
    assert Interval(0.9, 0.85, 0.95).verdict() == BEHIND
    assert iv.as_dict("ratio") == {"ratio": 1.046, "ratio_ci_low": 1.021, "ratio_ci_high": 1.072}
    assert iv.half_width == pytest.approx(0.0255)


def test_bad_options_and_shapes_are_one_line_errors():
    rows = np.ones((4, 2))
    with pytest.raises(ValueError, match="resamples"):
        paired_bootstrap([rows], ratio_of_means(0, 1), resamples=10)
    with pytest.raises(ValueError, match="level"):
        paired_bootstrap([rows], ratio_of_means(0, 1), level=1.0)
    with pytest.raises(ValueError, match="non-empty"):
        paired_bootstrap([np.ones((0, 2))], ratio_of_means(0, 1))
    with pytest.raises(ValueError, match="equal"):
        paired_ratio([1.0, 2.0], [1.0])


def test_a_ratio_of_pooled_rates_keeps_each_items_four_values_together():
    """(Σ tokens ÷ Σ s of a) ÷ (Σ tokens ÷ Σ s of b) over paired repetitions: the point is the pooled
    ratio, a constant 1.2× gain under shared machine noise gives a narrow interval around it."""
    rng = np.random.default_rng(5)
    load = rng.lognormal(0.0, 0.2, size=6)  # each repetition's machine slowdown, shared by both runs
    tokens = np.full(6, 128.0)
    seconds_b = 4.0 * load
    seconds_a = seconds_b / 1.2 * rng.lognormal(0.0, 0.01, size=6)
    iv = paired_rate_ratio(tokens, seconds_a, tokens, seconds_b)
    assert iv.point == pytest.approx(seconds_b.sum() / seconds_a.sum())
    assert iv.contains(1.2) and iv.half_width < 0.03 and iv.verdict() == AHEAD
    with pytest.raises(ValueError, match="four equal"):
        paired_rate_ratio(tokens, seconds_a[:3], tokens, seconds_b)
