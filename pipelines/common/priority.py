"""A low-priority job that is really low: the session's autogroup follows the job's nice value.

Where the kernel groups processes by session (`/proc/sys/kernel/sched_autogroup_enabled` = 1), the
CPU is shared between groups first and by nice value only inside a group. A job started with
`setsid nohup nice -n 19 …` forms a group of its own (Ray's workers join it) and takes an equal share
of the CPU beside the user's shell whatever its nice value. Lowering the group from outside
(`echo 19 > /proc/$!/autogroup`) races with the job's own `setsid`: written before it, it lowers the
caller's group instead. So the job does it itself, once: a job that starts Ray does it right after
`ray.init` (ray_start.py), since a local head started at the lowest priority beside a busy
foreground can miss its start-up deadline.
"""

from __future__ import annotations

import os
from pathlib import Path

AUTOGROUP = Path("/proc/self/autogroup")  # "/autogroup-107 nice 0"


def autogroup_follows_nice(path: Path = AUTOGROUP) -> int | None:
    """If this process leads its own session (so the autogroup holds only this job) and runs at a
    positive nice value above its group's, raise the group's nice to it. Returns the value written,
    or None (no autogroups, nice 0, not a session leader, or not permitted)."""
    nice = os.nice(0)
    if nice <= 0 or os.getsid(0) != os.getpid():
        return None
    try:
        current = int(path.read_text().split()[-1])
        if current >= nice:
            return None
        path.write_text(str(nice))
    except (OSError, ValueError, IndexError):
        return None
    return nice
