"""The engine's CPU thread policy: how many intra-op threads a decode round runs on.

torch's OpenMP threads wait for each other at the end of every parallel region, and a decode round
is hundreds of small regions. When another process holds one of the cores, the kernel deschedules a
partner and every region waits for it: on the 2-core CPU machine, beside two busy training workers
(at nice 19, which Linux's per-session autogroups make no nicer), two threads decoded the demo prompt
at 1.1–1.4 tok/s and one thread at 17–19 (docs/benchmarks.md, "A shared CPU"). So the policy runs
on the cores the rest of the machine leaves free, re-measured as it decodes:

    others  = (busy CPU seconds of the allowed cores − this process's CPU seconds) / wall seconds
              over the last `window` intervals (1 s), from /proc/stat and the process's own clock
    taken   = ⌊others + 1 − slack⌋       cores another process keeps busy (a core counts as taken
                                         from `slack` of it: 0.3 for one row, rising to 0.6 at 16
                                         rows, linear in log2 rows)
    threads = max(1, allowed − taken)    allowed: this process's CPU affinity

The slack is measured, not guessed: beside a competitor busy a share d of every 10 ms
(`bench_shared_cpu.py --duty`), two threads decoded the demo prompt (AR) at 23.1 / 20.4 / 16.3 /
9.8 tok/s for d = 0.15 / 0.3 / 0.5 / 1 against one thread's 18.6 / 19.9 / 19.8 / 19.5, so a second
thread pays up to about 0.3 of a core held elsewhere. At 8 rows (in-process continuous batching of
GSM8K prompts, 32 tokens each) it pays up to about 0.5: 82.5 / 70.8 tok/s at d = 0.3 / 0.5 against
one thread's 67.2 / 70.0; at 16 rows up to 0.6–0.7 (`bench_batcher.py --methods ar --concurrency 16
--requests 32 --max-new-tokens 32 --threads 2|1 --duty d`): 138.3 / 131.4 and 125.1 / 106.5 / 66.2
tok/s at d = 0.5 / 0.7 and 0.7 / 0.85 / 1 against one thread's 133.4 / 125.9 and 125.7 / 132.5 /
123.9, so the slack stops at 0.6, where two threads lose little and beyond which they soon lose a
fifth. Larger batches make longer parallel regions, so a descheduled partner costs a smaller share
of each. A serving replica's own proxy and HTTP clients
hold 0.1–0.3 of a core under load (measured at concurrency 1–16): below the slack, so an endpoint
keeps both threads (with 0.1 it dropped to one and lost a third of its throughput at concurrency 16);
their bursts pass 0.3 for half a second now and then, which a 1 s window smooths out.
After an idle spell (no round for longer than the window, this process under half a core
meanwhile) the first round decides on the spell (a competitor that ran meanwhile most likely still
runs: two threads beside it would run the burst's first step several times slower), and the window
then restarts from that round: the next decision comes `restart_s` (0.2 s) later, on what the burst's
first step saw alone, then every `interval_s` again. Evidence from before the burst cannot tell a
competitor that stays from one that stopped as the burst began (the other endpoint of a paired
benchmark: busy until its leg ends, which is when this one's begins); the first step after the spell
can, and the continuous batcher's prefill budget keeps that step short. So a replica beside a
persistent competitor keeps one thread, and one whose spell was another endpoint's leg is back on two
after its first step (one prefill budget and a round, or 0.2 s if longer). A fixed `threads` skips
the measurement. Where /proc/stat is unreadable (not Linux) auto keeps every
allowed core. The count changes between rounds only (torch.set_num_threads), so outputs do not
depend on it; `benchmarks/bench_shared_cpu.py` measures it against fixed counts and vLLM-CPU.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

SLACK = 0.3  # one row: a core counts as taken from this share of it (the break-even above)
SLACK_BATCHED = 0.6  # from 16 rows on
log = logging.getLogger(__name__)


def allowed_cores() -> int:
    """The cores this process may run on (its CPU affinity; the CPU count off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def slack_for(rows: int) -> float:
    """The share of a core another process must hold before it counts as taken, for a round over
    `rows` rows: SLACK at one row, SLACK_BATCHED from 16, linear in log2(rows) between (0.525 at 8)."""
    return SLACK + (SLACK_BATCHED - SLACK) * min(math.log2(max(rows, 1)) / 4.0, 1.0)


def threads_for(others: float, allowed: int, slack: float = SLACK) -> int:
    """Threads to run beside `others` cores of other processes' demand on `allowed` cores."""
    taken = math.floor(max(others, 0.0) + 1.0 - slack)
    return max(1, allowed - taken)


@dataclass(frozen=True)
class CpuSample:
    """Busy seconds of the allowed cores (every process), this process's CPU seconds, and when."""

    wall: float
    busy: float
    own: float

    @classmethod
    def now(cls) -> "CpuSample | None":
        try:
            with open("/proc/stat") as f:
                lines = [line.split() for line in f if line.startswith("cpu") and line[3:4].isdigit()]
        except OSError:
            return None
        try:
            cpus = os.sched_getaffinity(0)
        except AttributeError:
            return None
        tick = os.sysconf("SC_CLK_TCK")
        busy = 0
        for fields in lines:  # cpuN user nice system idle iowait irq softirq steal …
            if int(fields[0][3:]) in cpus:
                ticks = [int(v) for v in fields[1:9]]
                busy += sum(ticks) - ticks[3] - ticks[4]
        return cls(time.monotonic(), busy / tick, time.process_time())

    def others_since(self, earlier: "CpuSample") -> float:
        """Cores' worth of CPU other processes used between `earlier` and this sample."""
        wall = self.wall - earlier.wall
        return ((self.busy - earlier.busy) - (self.own - earlier.own)) / wall if wall > 0 else 0.0


@dataclass
class ThreadPolicy:
    """torch's intra-op thread count for an engine's rounds: fixed (`threads`) or auto (None).

    Building one changes nothing; the decoding loop calls `update()` once per round, which applies
    the count in the calling thread, and auto re-decides at most every `interval_s` (reading
    /proc/stat costs microseconds) from the other processes' use over the last `window` intervals,
    calling torch.set_num_threads again only on a change; after an idle spell, `restart_s` after its
    first decision, on that short window alone."""

    threads: int | None = None
    interval_s: float = 0.5
    window: int = 2
    restart_s: float = 0.2
    current: int = field(init=False, default=0)
    _after_spell: bool = field(init=False, default=False, repr=False)  # the last decision was on an idle spell
    _samples: deque = field(init=False, default_factory=deque, repr=False)  # the last `window`, oldest first
    _applied_in: set[int] = field(init=False, default_factory=set, repr=False)  # OpenMP's count is per thread

    def __post_init__(self) -> None:
        from drelay_model.errors import DRelayError

        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1):
            raise DRelayError(f"threads must be a positive integer or auto, got {self.threads!r}")
        if not self.interval_s > 0:
            raise DRelayError(f"the thread policy's interval_s must be > 0, got {self.interval_s!r}")
        if not self.restart_s > 0:
            raise DRelayError(f"the thread policy's restart_s must be > 0, got {self.restart_s!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise DRelayError(f"the thread policy's window must be a positive number of intervals, got {self.window!r}")
        self.current = self.threads if self.threads is not None else allowed_cores()
        first = None if self.threads is not None else CpuSample.now()
        self._samples = deque([first] if first is not None else [], maxlen=self.window)

    @classmethod
    def parse(cls, value: str | int | None) -> "ThreadPolicy":
        """From a setting: 'auto' / None (measured) or a positive count (a string of digits from a
        flag); the count itself is checked where every policy is, in `__post_init__`."""
        from drelay_model.errors import DRelayError

        if value is None or value == "auto":
            return cls()
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                raise DRelayError(f"threads must be a positive integer or auto, got {value!r}") from None
        return cls(value)

    def describe_setting(self) -> str:
        """The setting as `parse` reads it: 'auto' or the count."""
        return "auto" if self.auto else str(self.threads)

    @property
    def auto(self) -> bool:
        return self.threads is None

    def update(self, rows: int = 1) -> int:
        """The thread count for the next round over `rows` rows (re-measured when the interval has
        passed). Call it from the thread that runs the rounds: OpenMP keeps the count per calling
        thread."""
        if threading.get_ident() not in self._applied_in:
            self._apply(self.current)
        if self.threads is not None or not self._samples:
            return self.current
        now = time.monotonic()
        if now - self._samples[-1].wall < (min(self.restart_s, self.interval_s) if self._after_spell else self.interval_s):
            return self.current
        sample = CpuSample.now()
        if sample is None:
            return self.current
        last = self._samples[-1]
        others = sample.others_since(self._samples[0])  # over the last `window` intervals
        wanted = threads_for(others, allowed_cores(), slack_for(rows))
        spell = sample.wall - last.wall
        self._after_spell = spell > self.window * self.interval_s and sample.own - last.own < 0.5 * spell
        if self._after_spell:
            self._samples.clear()  # after an idle spell: decided on it once, then on what follows it
        self._samples.append(sample)
        if wanted != self.current:
            log.info("threads %d → %d: other processes use %.2f cores", self.current, wanted, others)
            self._applied_in.clear()
            self._apply(wanted)
            self.current = wanted
        return self.current

    def _apply(self, n: int) -> None:
        torch.set_num_threads(n)
        self._applied_in.add(threading.get_ident())

    def describe(self) -> str:
        how = f"auto, {allowed_cores()} allowed, re-measured every {self.interval_s:g} s" if self.auto else "fixed"
        return f"threads {self.current} ({how}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'default')})"
