"""Atomic directory writes: build a directory next to its destination, then rename it into place.

An interrupted writer (crash, Ctrl-C, full disk) leaves the previous content intact and no
half-written directory behind: readers see the old directory or the new one, never a mix.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a fresh temp directory; on success it replaces `path`, on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp.", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the result should read like any directory
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
