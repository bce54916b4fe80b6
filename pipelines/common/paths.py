"""Repository paths and the one pattern for user-chosen names."""

from __future__ import annotations

from pathlib import Path

from pipelines.common.outputs import REPO_ROOT, resolve_path, shipped_checkpoints_dir

BUNDLED_CHECKPOINTS = REPO_ROOT / "checkpoints"

# A label that doubles as a file, MLflow run and Ray run name (compare variants, study runs).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"


def repo_path(path: str | Path) -> Path | str:
    """A config path as an absolute path: `outputs/…` under the output root, other relative paths
    relative to the repository; URIs (`s3://…`) come back untouched (see `outputs.py`)."""
    return resolve_path(path)


def bundled_checkpoint(target_spec: str) -> Path | None:
    """The checkpoint shipped for a target, if any: `<output root>/checkpoints/<target>/` (what
    `drelay study` ships when an output root is configured), else the repo's `checkpoints/<target>/`."""
    for folder in (shipped_checkpoints_dir(), BUNDLED_CHECKPOINTS):
        path = None if folder is None else folder / target_spec
        if path is not None and path.is_dir():
            return path
    return None
