"""Repository paths and the one pattern for user-chosen names."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BUNDLED_CHECKPOINTS = REPO_ROOT / "checkpoints"

# A label that doubles as a file, MLflow run and Ray run name (compare variants, study runs).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"


def repo_path(path: str | Path) -> Path:
    """A config path as an absolute path (relative paths are relative to the repository)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def bundled_checkpoint(target_spec: str) -> Path | None:
    """The checkpoint shipped in the repo for a target, if any (checkpoints/<target>/)."""
    path = BUNDLED_CHECKPOINTS / target_spec
    return path if path.is_dir() else None
