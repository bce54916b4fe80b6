"""S that a busy machine cannot fake: paired timing and the CPU share of everything else.

Phased timing (AR's cell first, then each method's) lets any other process that runs during one
phase skew S: with a second job running through the AR phase, GSM8K's S read 5.43× instead of
0.71×. Paired timing decodes each prompt (each batch of `concurrency` prompts, each turn) with the
method and with AR back to back, alternating which goes first, so both see the same machine:

    S = (Σ_p tokens_m,p / Σ_p t_m,p) / (Σ_p tokens_AR,p / Σ_p t_AR,p)   over the prompt-turns p
        (a batch's prompt-turns share its seconds), with its 95% interval from a bootstrap over the
        prompts that keeps each prompt's two timings together (prompt_intervals.py)

Greedy outputs are identical, so S = Σ t_AR / Σ t_m there; at T > 0 token counts differ and the rate
ratio is what is compared. `CpuMeter` records how much of the machine other processes used while
a cell ran (0 = a quiet machine), so a reader can tell a clean measurement from a noisy one.
"""

from __future__ import annotations

import time

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
