"""The intervals of `drelay compare`: each ratio to the baseline with its 95% paired-bootstrap interval,
the verdict, and the half-widths the comparison reached (what it can resolve).

An item is a prompt (a conversation's turns summed), measured under every variant: every replay cell
of a benchmark shares the AR reference and the prompt ids. Per benchmark b, one row per prompt with
X = (rounds, committed, oracle rounds, oracle committed):

    rows_b [n_b, 8] = [X under the variant | X under the baseline]
    τ_b             = Σ committed ÷ Σ rounds   (the table's τ: totals over the benchmark's prompts)
    ratio_b         = τ_b(variant) ÷ τ_b(baseline)                            resampled within b
    mean ratio      = mean_b τ_b(variant) ÷ mean_b τ_b(baseline)               resampled within every b at once
    headroom share  = (mean τ(variant) − mean τ(baseline)) ÷ (mean oracle τ(baseline) − mean τ(baseline))

(pipelines/common/intervals.py: the stratified percentile bootstrap.) Point estimates are the table's.

Power: a half-width h reached with n prompts per benchmark shrinks as 1/sqrt(n), so resolving a
difference d (half-width ≤ d) needs about n·(h/d)² prompts per benchmark.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from drelay_model.errors import DRelayError
from pipelines.common.intervals import DEFAULT_LEVEL, Interval, paired_bootstrap
from pipelines.eval.results import PROMPT_COUNTS, ReplayResult

RESOLVE_DIFFERENCE = 0.02  # the mean-τ difference the power line sizes a comparison for (2%)
_X = len(PROMPT_COUNTS)  # columns per variant: rounds, committed, oracle rounds, oracle committed


@dataclass(frozen=True)
class Bootstrap:
    """The bootstrap's settings: resamples R and the generator's seed (same seed, same intervals)."""

    resamples: int
    seed: int
    level: float = DEFAULT_LEVEL

    def options(self) -> dict:
        return {"resamples": self.resamples, "seed": self.seed, "level": self.level}


@dataclass(frozen=True)
class VariantIntervals:
    """One variant against the baseline: τ ratio per benchmark, the mean ratio, the headroom share,
    and the prompts per benchmark they rest on."""

    per_benchmark: dict[str, Interval]
    mean_ratio: Interval
    headroom_share: Interval
    prompts: dict[str, int]

    @property
    def verdict(self) -> str:
        """ahead / behind / unresolved: where the mean ratio's interval lies against 1."""
        return self.mean_ratio.verdict(1.0)

    def metrics(self) -> dict[str, float]:
        """`<benchmark>/ratio_vs_baseline`, `ratio_vs_baseline`, `headroom_share` with their `_ci_low`/`_ci_high`."""
        out: dict[str, float] = {}
        for b, iv in self.per_benchmark.items():
            out.update(iv.as_dict(f"{b}/ratio_vs_baseline"))
        return out | self.mean_ratio.as_dict("ratio_vs_baseline") | self.headroom_share.as_dict("headroom_share")

    @property
    def prompts_per_benchmark(self) -> float:
        return sum(self.prompts.values()) / len(self.prompts)

    def prompts_to_resolve(self, difference: float = RESOLVE_DIFFERENCE) -> int | None:
        """Prompts per benchmark at which the mean ratio's half-width would be `difference`
        (h ∝ 1/sqrt(n) → n·(h/d)²); None when no interval was drawn."""
        h = self.mean_ratio.half_width
        if not math.isfinite(h):
            return None
        return max(1, math.ceil(self.prompts_per_benchmark * (h / difference) ** 2))

    def power(self) -> dict:
        return {
            "half_width": self.mean_ratio.half_width,
            "per_benchmark": {b: iv.half_width for b, iv in self.per_benchmark.items()},
            "prompts_per_benchmark": self.prompts,
            "resolve_difference": RESOLVE_DIFFERENCE,
            "prompts_to_resolve": self.prompts_to_resolve(),
        }


def prompt_rows(replay: ReplayResult, where: str) -> dict[str, np.ndarray]:
    """Prompt id → its counts summed over turns, float [4] (PROMPT_COUNTS). A cell without per-prompt
    counts cannot be resampled (a DRelayError naming it)."""
    if not replay.per_prompt:
        raise DRelayError(f"replay cell {where} holds no per-prompt counts: delete it to replay it again")
    rows: dict[str, np.ndarray] = {}
    for key, counts in replay.per_prompt.items():
        prompt_id = key.rpartition("#")[0]
        rows[prompt_id] = rows.get(prompt_id, np.zeros(_X)) + np.asarray(counts, dtype=np.float64)
    return rows


def paired_rows(variant: ReplayResult, baseline: ReplayResult, where: str) -> np.ndarray:
    """[n, 8]: each prompt's counts under the variant, then under the baseline (same prompts, same order)."""
    v, b = prompt_rows(variant, where), prompt_rows(baseline, where)
    if set(v) != set(b):
        raise DRelayError(f"replay cells {where} cover different prompts than the baseline's: delete them to replay them again")
    ids = sorted(v)
    return np.stack([np.concatenate([v[i], b[i]]) for i in ids])


def _tau(means: np.ndarray, offset: int) -> np.ndarray:
    """committed ÷ rounds of the variant (offset 0) or the baseline (offset 4); 0 without rounds (as `tau_of`)."""
    rounds, committed = means[..., offset], means[..., offset + 1]
    return np.divide(committed, rounds, out=np.zeros_like(committed), where=rounds > 0)


def _oracle_tau(means: np.ndarray, offset: int) -> np.ndarray:
    return _tau(means[..., offset + 2 :], 0)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero baseline τ: NaN, dropped by the bootstrap
        return num / den


def benchmark_ratio(means: list[np.ndarray]) -> np.ndarray:
    return _ratio(_tau(means[0], 0), _tau(means[0], _X))


def mean_ratio(means: list[np.ndarray]) -> np.ndarray:
    return _ratio(sum(_tau(m, 0) for m in means), sum(_tau(m, _X) for m in means))


def headroom_share(means: list[np.ndarray]) -> np.ndarray:
    """0 where the baseline's pool leaves no headroom (as `headroom`)."""
    gain = sum(_tau(m, 0) - _tau(m, _X) for m in means)
    room = sum(_oracle_tau(m, _X) - _tau(m, _X) for m in means)
    return np.divide(gain, room, out=np.zeros_like(gain), where=room != 0)


def variant_intervals(
    cells: Mapping[str, tuple[ReplayResult, ReplayResult]],
    points: Mapping[str, float],
    bootstrap: Bootstrap,
    label: str,
) -> VariantIntervals:
    """The intervals of one variant. `cells`: benchmark → (variant's replay, baseline's replay);
    `points`: the table's flat metrics of the variant (the point estimates)."""
    groups = {b: paired_rows(v, base, f"{b}/{label}") for b, (v, base) in cells.items()}
    opts = bootstrap.options()
    per_benchmark = {
        b: _at(paired_bootstrap([rows], benchmark_ratio, **opts), points[f"{b}/ratio_vs_baseline"]) for b, rows in groups.items()
    }
    every = list(groups.values())
    return VariantIntervals(
        per_benchmark=per_benchmark,
        mean_ratio=_at(paired_bootstrap(every, mean_ratio, **opts), points["ratio_vs_baseline"]),
        headroom_share=_at(paired_bootstrap(every, headroom_share, **opts), points["headroom_share"]),
        prompts={b: len(rows) for b, rows in groups.items()},
    )


def _at(interval: Interval, point: float) -> Interval:
    """The table's point estimate (the same statistic over the same totals; summed in another order)."""
    return dataclasses.replace(interval, point=point)


def headroom(mean_tau: float, base_tau: float, base_oracle_tau: float) -> float:
    """Share of the baseline pool's oracle headroom a variant's mean τ captures; 0 when there is none."""
    room = base_oracle_tau - base_tau
    return (mean_tau - base_tau) / room if room else 0.0


def interval_table(baseline: str, intervals: Mapping[str, VariantIntervals], bootstrap: Bootstrap) -> str:
    """Markdown: each variant's mean ratio, headroom share and verdict, then the power lines."""
    pct = int(round(100 * bootstrap.level))
    lines = [
        f"| variant | mean τ ÷ {baseline} [{pct}% CI] | share of the oracle headroom [{pct}% CI] | verdict |",
        "|---|---|---|---|",
    ]
    for label, iv in intervals.items():
        lines.append(f"| {label} | {iv.mean_ratio.format()} | {_percent(iv.headroom_share)} | {iv.verdict} |")
    lines += ["", f"Intervals: paired bootstrap over prompts within each benchmark ({bootstrap.resamples} resamples, "
              f"seed {bootstrap.seed}); verdict: the mean ratio's interval above 1 (ahead), below (behind), or across it.", ""]  # fmt: skip
    return "\n".join(lines + power_lines(baseline, intervals)) + "\n"


def power_lines(baseline: str, intervals: Mapping[str, VariantIntervals], names: Mapping[str, str] | None = None) -> list[str]:
    """Per variant: the half-width reached overall and per benchmark, and the prompts per benchmark a
    2% difference on the mean would need."""
    from pipelines.eval.report import BENCHMARK_LABELS

    names = names or BENCHMARK_LABELS
    out = []
    for label, iv in intervals.items():
        per = ", ".join(f"{names.get(b, b)} ±{x.half_width:.3f}" for b, x in iv.per_benchmark.items())
        have = round(iv.prompts_per_benchmark)
        need = iv.prompts_to_resolve()
        d = f"{RESOLVE_DIFFERENCE:.0%}"
        if need is None:
            tail = "no interval (no rounds to resample)"
        elif need <= have:
            tail = f"{have} prompts per benchmark resolve a {d} difference on the mean"
        else:
            tail = f"to resolve a {d} difference on the mean need about {need} prompts per benchmark (have {have})"
        out.append(f"- {label} ÷ {baseline}: half-width of the mean ratio ±{iv.mean_ratio.half_width:.3f} ({per}); {tail}")
    return out


def _percent(iv: Interval) -> str:
    return f"{100 * iv.point:.1f}% [{100 * iv.low:.1f}%, {100 * iv.high:.1f}%]"


def compare_intervals(
    replays: Mapping[tuple[str, str], ReplayResult],
    labels: Sequence[str],
    benchmarks: Sequence[str],
    baseline: str,
    metrics: Mapping[str, Mapping[str, float]],
    bootstrap: Bootstrap,
) -> dict[str, VariantIntervals]:
    """Every variant but the baseline → its intervals; `replays[(benchmark, label)]`."""
    return {
        label: variant_intervals(
            {b: (replays[(b, label)], replays[(b, baseline)]) for b in benchmarks}, metrics[label], bootstrap, label
        )
        for label in labels
        if label != baseline
    }
