"""S that a busy machine cannot fake: paired timing and the CPU share of everything else.

Phased timing (AR's cell first, then each method's) lets any other process that runs during one
phase skew S: with a second job running through the AR phase, GSM8K's S read 5.43× instead of
0.71×. Paired timing decodes each prompt (each batch of `concurrency` prompts, each turn) with the
method and with AR back to back, alternating which goes first, so both see the same machine:

    S_p = (tokens_m / t_m) / (tokens_AR / t_AR)      per prompt-turn p (batch: its prompt-turns share it)
    speedup = median_p S_p,   spread = [25th, 75th percentile]

Greedy outputs are identical, so S_p = t_AR / t_m there; at T > 0 token counts differ and the rate
ratio is what is compared. `CpuMeter` records how much of the machine other processes used while
a cell ran (0 = a quiet machine), so a reader can tell a clean measurement from a noisy one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import psutil

TIMINGS = ("paired", "phased")


class CpuMeter:
    """Share of the machine's CPU used by *other* processes over an interval:

    (Δ busy CPU-seconds of the whole machine − Δ CPU-seconds of this process and its children)
    ÷ (Δ wall seconds × logical CPUs), clamped to [0, 1].
    """

    def __init__(self) -> None:
        self._me = psutil.Process()
        self._start = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        total = psutil.cpu_times()
        busy = sum(total) - total.idle - getattr(total, "iowait", 0.0)
        mine = self._me.cpu_times()
        own = mine.user + mine.system + mine.children_user + mine.children_system
        return time.perf_counter(), busy, own

    def other_share(self) -> float:
        """The share since construction."""
        (w0, b0, o0), (w1, b1, o1) = self._start, self._sample()
        wall = max(w1 - w0, 1e-9) * (psutil.cpu_count() or 1)
        return min(max(((b1 - b0) - (o1 - o0)) / wall, 0.0), 1.0)


def paired_ratios(records: Sequence) -> list[float]:
    """S_p of every prompt record that carries its paired AR timing (module docstring)."""
    out = []
    for r in records:
        if r.ar_wall_s and r.wall_s and r.new_tokens and r.ar_new_tokens:
            out.append((r.new_tokens / r.wall_s) / (r.ar_new_tokens / r.ar_wall_s))
    return out


def median_spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, 25th percentile, 75th percentile); a single value is its own spread."""
    if not values:
        return 0.0, 0.0, 0.0
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q2, q1, q3
