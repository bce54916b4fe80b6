"""SIGTERM as SystemExit, so a job's tracked runs end FAILED (not RUNNING) when it is terminated."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit(128 + signum) inside the block (a no-op off the main thread)."""

    def handler(signum, frame):  # noqa: ARG001
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
