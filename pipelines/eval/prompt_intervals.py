"""95% intervals of an evaluation's τ and S: a paired bootstrap over the prompts of each benchmark.

A prompt (all its turns: MT-Bench's second turn follows the model's own first answer) is one item;
its columns hold, for each seed s the cell decoded (one when greedy), sums over its turns:

    τ   committed_s, rounds_s                           real decoding, the prompt decoded alone
    S   tokens_s, seconds_s, ar_tokens_s, ar_seconds_s  the method, and AR on the same prompt-turns
                                                        (paired timing: back to back; phased: AR's cell)

and the statistics, of the column means over the prompts (ratios of sums are ratios of means):

    τ = mean_s  Σ committed_s ÷ Σ rounds_s                                 = the cell's τ
    S = mean_s (Σ tokens_s ÷ Σ seconds_s) ÷ (Σ ar_tokens_s ÷ Σ ar_seconds_s)  = the cell's S

A resample draws the benchmark's prompts with replacement and keeps each prompt's row whole, so a
prompt's AR time moves with its method time and the load they shared cancels in S. The mean over
benchmarks (the table's Avg.) resamples every benchmark at once (`pipelines.common.intervals`).
An interval needs each prompt's own counts: τ has none when the first concurrency level batches
prompts together (their rounds are shared), S none when AR's timings are missing for a prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pipelines.common.intervals import Interval, paired_bootstrap
from pipelines.eval.results import CellResult, PromptRecord

TAU_COLUMNS = ("committed", "rounds")
SPEEDUP_COLUMNS = ("tokens", "seconds", "ar_tokens", "ar_seconds")


def _rows(records: Sequence[PromptRecord], values) -> np.ndarray | None:
    """[n_prompts, seeds × width]: `values(record)` (a tuple, or None when missing) summed over each
    prompt's turns, per seed in ascending order; None when any record has no values or a prompt
    lacks a seed."""
    seeds = sorted({r.seed for r in records})
    sums: dict[str, dict[int, np.ndarray]] = {}
    for r in records:
        v = values(r)
        if v is None:
            return None
        per_seed = sums.setdefault(r.prompt_id, {})
        per_seed[r.seed] = per_seed.get(r.seed, 0.0) + np.asarray(v, dtype=np.float64)
    if not sums or any(len(per_seed) != len(seeds) for per_seed in sums.values()):
        return None
    return np.stack([np.concatenate([per_seed[s] for s in seeds]) for per_seed in sums.values()])


def tau_rows(cell: CellResult) -> np.ndarray | None:
    """Per prompt, per seed: (committed, rounds) of real decoding; None when prompts shared rounds."""

    def counts(r: PromptRecord):
        if r.rounds is None or r.tau is None:
            return None
        return round(r.tau * r.rounds), r.rounds  # τ = committed ÷ rounds, exactly

    return _rows(cell.prompts, counts)


def speedup_rows(cell: CellResult, ar: CellResult) -> np.ndarray | None:
    """Per prompt, per seed: (tokens, seconds) of the method and of AR on the same prompt-turn — its
    paired AR run when the cell has one, else AR's own cell's record; None when any is missing."""
    ar_records = {(r.prompt_id, r.turn, r.seed): r for r in ar.prompts}

    def timings(r: PromptRecord):
        if r.ar_wall_s is not None and r.ar_new_tokens is not None:
            ar_tokens, ar_seconds = r.ar_new_tokens, r.ar_wall_s
        elif (ref := ar_records.get((r.prompt_id, r.turn, r.seed))) is not None and ref.wall_s is not None:
            ar_tokens, ar_seconds = ref.new_tokens, ref.wall_s
        else:
            return None
        return None if not r.wall_s or not ar_seconds else (r.new_tokens, r.wall_s, ar_tokens, ar_seconds)

    return _rows(cell.prompts, timings)


def seed_mean_tau(m: np.ndarray) -> np.ndarray:
    """m [..., seeds × 2] column means → [...]: mean over seeds of committed ÷ rounds."""
    m = m.reshape(*m.shape[:-1], -1, 2)
    return (m[..., 0] / m[..., 1]).mean(axis=-1)


def seed_mean_speedup(m: np.ndarray) -> np.ndarray:
    """m [..., seeds × 4] column means → [...]: mean over seeds of the method's rate ÷ AR's."""
    m = m.reshape(*m.shape[:-1], -1, 4)
    return ((m[..., 0] / m[..., 1]) / (m[..., 2] / m[..., 3])).mean(axis=-1)


# name → (the rows of a cell against its AR cell, the statistic of one benchmark's column means)
STATISTICS = {
    "tau": (lambda cell, ar: tau_rows(cell), seed_mean_tau),
    "speedup": (speedup_rows, seed_mean_speedup),
}


def cell_intervals(
    cell: CellResult, ar: CellResult, names: Sequence[str] = tuple(STATISTICS), **bootstrap
) -> dict[str, Interval]:
    """`{"tau": …, "speedup": …}` of one cell (of `names`), each present when its per-prompt counts
    are. `bootstrap`: `resamples`, `seed` (`pipelines.common.intervals` defaults)."""
    out = {}
    for name in names:
        rows_of, statistic = STATISTICS[name]
        rows = rows_of(cell, ar)
        if rows is not None:
            out[name] = paired_bootstrap([rows], lambda means, f=statistic: f(means[0]), **bootstrap)
    return out


def mean_intervals(
    cells: Sequence[CellResult], ar_cells: Mapping[str, CellResult], names: Sequence[str] = tuple(STATISTICS), **bootstrap
) -> dict[str, Interval]:
    """`{"mean_tau": …, "mean_speedup": …}`: the mean over benchmarks of the cells' statistics, every
    benchmark's prompts resampled at once; present when every cell has its counts (the same seeds)."""
    out = {}
    for name in names:
        rows_of, statistic = STATISTICS[name]
        groups = [rows_of(c, ar_cells[c.benchmark]) for c in cells]
        if not groups or any(g is None for g in groups) or len({g.shape[1] for g in groups}) != 1:
            continue
        out[f"mean_{name}"] = paired_bootstrap(
            groups, lambda means, f=statistic: np.mean([f(m) for m in means], axis=0), **bootstrap
        )
    return out


def interval_metrics(intervals: Mapping[str, Interval]) -> dict[str, float]:
    """`<name>_ci_low`, `<name>_ci_high` of each interval (the points are the metrics' own)."""
    out = {}
    for name, iv in intervals.items():
        d = iv.as_dict(name)
        out.update({k: v for k, v in d.items() if k != name})
    return out
