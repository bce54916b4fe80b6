"""git as a subprocess, for the modules that read the repository's history (pinned checkpoints,
carried training snapshots): each call captures its output and never raises on git's exit status."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    """`git -C repo ARGS…` with stdout and stderr captured (bytes); check `returncode` yourself."""
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True)


def said(done: subprocess.CompletedProcess, limit: int = 200) -> str:
    """git's complaint on one line, at most `limit` characters (for an error message)."""
    return " ".join(done.stderr.decode(errors="replace").split())[:limit]
