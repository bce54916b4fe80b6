"""Flat metric dictionaries from evaluation cells: what MLflow stores and the report reads back.

Per cell (one benchmark, one method), at the primary concurrency (the first `--concurrency`):
    tau, tau_std             committed tokens per round, mean ± std over seeds (real decoding)
    speedup                  paired timing (the default, timing.py): method tokens/s ÷ AR tokens/s,
                             each pooled over the prompt-turns (Σ tokens ÷ Σ seconds) that the two
                             decoded back to back; mean over seeds. Phased timing: as speedup_phased.
    tau_ci_low, tau_ci_high, speedup_ci_low, speedup_ci_high
                             the 95% intervals of τ and S, resampled over the benchmark's prompts,
                             paired with AR for S (prompt_intervals.py); absent without per-prompt counts
    speedup_phased, speedup_std   S = method tokens/s ÷ AR tokens/s of whole passes (AR's own cell),
                             same benchmark, seed and concurrency, prefill included; mean ± std over seeds
    other_cpu_share          CPU share of other processes while the cell ran (0 = a quiet machine)
    tokens_per_s             the method's own throughput
    slot_acceptance/NN       P(draft at slot NN accepted), pooled over seeds
    ms_draft|select|verify|other   mean ms per engine step (= per round at concurrency 1)
    ms_prefill               mean prefill ms per request
    throughput/cN, speedup/cN      tokens/s and S at concurrency N (mean over seeds)
    matches_ar               share of prompt-turns whose greedy output equals AR's (must be 1 at T=0)
  greedy speculative cells only (replay over AR's cached continuations):
    tau_replay, tau_replay_gap     replay τ and |τ − replay τ| (must be 0)
    oracle_tau, efficiency         pool ceiling τ and τ / oracle τ
    coverage_first_error, coverage_first_base_error, one_edit_gain   (drelay_model.diagnostics)

Per method, over benchmarks: `<benchmark>/<name>` for the headline names, `mean_<name>` (the
arithmetic mean over benchmarks, as in the paper's Avg. column; `mean_tau` and `mean_speedup` with
their `_ci_low` / `_ci_high`, every benchmark resampled at once) and pooled `slot_acceptance/NN`,
`ms_*`, `throughput/cN`, `speedup/cN` (all benchmarks' rounds and seconds summed).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from drelay_model.diagnostics import selection_efficiency
from drelay_model.decoding.stats import DecodeStats
from pipelines.eval.prompt_intervals import cell_intervals, interval_metrics, mean_intervals
from pipelines.eval.results import CellResult

BENCHMARK_METRICS = (
    "tau", "tau_std", "tau_ci_low", "tau_ci_high", "speedup", "speedup_std", "speedup_ci_low", "speedup_ci_high",
    "speedup_phased",
    "other_cpu_share", "tokens_per_s", "matches_ar",
    "tau_replay", "tau_replay_gap", "oracle_tau", "efficiency",
    "coverage_first_error", "coverage_first_base_error", "one_edit_gain",
)  # fmt: skip
MEAN_METRICS = (
    "tau", "speedup", "speedup_phased", "other_cpu_share", "tau_replay", "oracle_tau", "efficiency",
    "coverage_first_error", "coverage_first_base_error", "one_edit_gain",
)  # fmt: skip


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    if not values:
        return 0.0, 0.0
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _passes_at(cell: CellResult, concurrency: int) -> dict[int, DecodeStats]:
    return {p.seed: p.totals for p in cell.passes if p.concurrency == concurrency}


def speedups(cell: CellResult, ar: CellResult, concurrency: int) -> list[float]:
    """S per seed at one concurrency: method tokens/s ÷ AR tokens/s (seeds both cells ran)."""
    mine, ref = _passes_at(cell, concurrency), _passes_at(ar, concurrency)
    return [
        mine[s].tokens_per_second / ref[s].tokens_per_second for s in sorted(mine) if s in ref and ref[s].tokens_per_second > 0
    ]


def pooled(cells: Sequence[CellResult], concurrency: int) -> DecodeStats | None:
    """All passes of the cells at one concurrency summed (None if there are none)."""
    totals = [p.totals for c in cells for p in c.passes if p.concurrency == concurrency]
    return DecodeStats.merged(totals) if totals else None


def timing_metrics(totals: DecodeStats) -> dict[str, float]:
    """Slot acceptance and per-phase latency of (pooled) totals."""
    out = {f"slot_acceptance/{i:02d}": a for i, a in enumerate(totals.slot_acceptance, start=1)}
    out.update({f"ms_{phase}": ms for phase, ms in totals.breakdown_ms_per_step().items()})
    out["ms_prefill"] = totals.ms_prefill
    return out


def _paired(cell: CellResult) -> bool:
    """Whether the cell's prompt-turns were timed back to back with AR (paired timing)."""
    return any(r.ar_wall_s is not None for r in cell.prompts)


def _interval_names(cell: CellResult, concurrency_levels: Sequence[int]) -> tuple[str, ...]:
    """Which intervals match the cell's printed point: S's only when it is paired, or phased with each
    prompt decoded alone (then the prompts' times sum to the passes' that phased S divides)."""
    return ("tau", "speedup") if _paired(cell) or concurrency_levels[0] == 1 else ("tau",)


def cell_metrics(
    cell: CellResult, ar: CellResult, concurrency_levels: Sequence[int], *, bootstrap: Mapping[str, int] | None = None
) -> dict[str, float]:
    """The flat metrics of one cell (names in the module docstring); AR's own cell has S = 1.
    `bootstrap`: the intervals' `resamples` and `seed` (default: `pipelines.common.intervals`')."""
    c0 = concurrency_levels[0]
    at_c0 = _passes_at(cell, c0)
    tau, tau_std = mean_std([t.tau for t in at_c0.values()])
    s, s_std = mean_std(speedups(cell, ar, c0))
    out = {"tau": tau, "tau_std": tau_std, "speedup": s, "speedup_std": s_std, "speedup_phased": s}
    intervals = cell_intervals(cell, ar, _interval_names(cell, concurrency_levels), **(bootstrap or {}))
    if _paired(cell) and "speedup" in intervals:
        out["speedup"] = intervals["speedup"].point
    out.update(interval_metrics(intervals))
    if cell.other_cpu_share is not None:
        out["other_cpu_share"] = cell.other_cpu_share
    out["tokens_per_s"] = statistics.fmean(t.tokens_per_second for t in at_c0.values()) if at_c0 else 0.0
    out.update(timing_metrics(pooled([cell], c0)))
    for c in concurrency_levels:
        out[f"throughput/c{c}"] = mean_std([t.tokens_per_second for t in _passes_at(cell, c).values()])[0]
        out[f"speedup/c{c}"] = mean_std(speedups(cell, ar, c))[0]
    same = _matches(cell, ar)
    if same is not None:
        out["matches_ar"] = same
    if cell.replay is not None:
        out.update(replay_metrics(cell, tau))
    return out


def replay_metrics(cell: CellResult, tau: float) -> dict[str, float]:
    r = cell.replay
    d = r.diagnostics
    return {
        "tau_replay": r.tau,
        "tau_replay_gap": abs(tau - r.tau),
        "oracle_tau": r.oracle_tau,
        "efficiency": selection_efficiency(tau, r.oracle_tau),
        "coverage_first_error": d.coverage_first_error,
        "coverage_first_base_error": d.coverage_first_base_error,
        "one_edit_gain": d.one_edit_gain,
    }


def _matches(cell: CellResult, ar: CellResult) -> float | None:
    """Share of (prompt, turn) outputs identical to AR's greedy ones; None unless greedy (AR cached
    outputs only then: sampled outputs differ by design)."""
    if not ar.outputs:
        return None
    ref = {(p.prompt_id, p.turn, p.seed): p.output_digest for p in ar.prompts}
    pairs = [(p.output_digest, ref.get((p.prompt_id, p.turn, p.seed))) for p in cell.prompts]
    pairs = [(a, b) for a, b in pairs if b is not None]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def method_metrics(
    cells: Sequence[CellResult],
    ar_cells: dict[str, CellResult],
    concurrency_levels: Sequence[int],
    *,
    bootstrap: Mapping[str, int] | None = None,
) -> dict[str, float]:
    """One method's row over benchmarks: `<benchmark>/<name>`, `mean_<name>` and pooled metrics."""
    out: dict[str, float] = {}
    per_bench = {c.benchmark: cell_metrics(c, ar_cells[c.benchmark], concurrency_levels, bootstrap=bootstrap) for c in cells}
    for bench, m in per_bench.items():
        out.update({f"{bench}/{k}": m[k] for k in BENCHMARK_METRICS if k in m})
    for k in MEAN_METRICS:
        values = [m[k] for m in per_bench.values() if k in m]
        if values and len(values) == len(per_bench):
            out[f"mean_{k}"] = statistics.fmean(values)
    names = [n for n in ("tau", "speedup") if all(f"{n}_ci_low" in m for m in per_bench.values())]
    out.update(interval_metrics(mean_intervals(cells, ar_cells, names, **(bootstrap or {}))))
    c0 = concurrency_levels[0]
    totals = pooled(cells, c0)
    if totals is not None:
        out.update(timing_metrics(totals))
    ar_list = [ar_cells[c.benchmark] for c in cells]
    for c in concurrency_levels:
        mine, ref = pooled(cells, c), pooled(ar_list, c)
        if mine is not None and ref is not None and ref.tokens_per_second > 0:
            out[f"throughput/c{c}"] = mine.tokens_per_second
            out[f"speedup/c{c}"] = mine.tokens_per_second / ref.tokens_per_second
    return out
