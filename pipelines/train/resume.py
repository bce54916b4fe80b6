"""Where a rerun of a training config continues, without starting anything: what `drelay study
--dry-run` prints for a run that is not finished.

The driver's order (driver.py, snapshot.py): the run's Ray Train checkpoint under
`ray.storage_path/ray.run_name` (exact: weights, optimizer, step), else the bfloat16 snapshot in
`train.snapshot_dir`, else the newest snapshot of the same `ray.run_name` carried in git history
(restored into `train.snapshot_dir` before Ray starts), else step 0.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from pipelines.common.paths import repo_path
from pipelines.train.config import RunConfig

RAY_CHECKPOINT = "its Ray checkpoint"
SNAPSHOT = "its snapshot"


@dataclass(frozen=True)
class ResumePoint:
    source: str  # RAY_CHECKPOINT, SNAPSHOT, or "the snapshot carried in <commit>"
    step: int
    budget_minutes: float | None  # the budget clock's minutes spent, where the source records them

    def describe(self, cfg: RunConfig) -> str:
        """e.g. "continues from its Ray checkpoint at step 1,442 (139.8 of 240 cpu min)"."""
        spent = ""
        if self.budget_minutes is not None and cfg.train.max_minutes:
            spent = f" ({self.budget_minutes:.1f} of {cfg.train.max_minutes:g} {cfg.train.budget_clock} min)"
        return f"continues from {self.source} at step {self.step:,}{spent}"


def ray_checkpoint_point(storage: Path) -> ResumePoint | None:
    """The latest checkpoint Ray Train recorded for a run folder (`ray.train.Result.from_path`)."""
    if not (storage / "checkpoint_manager_snapshot.json").is_file():
        return None
    import ray.train

    quiet = logging.getLogger("ray.train")
    level, quiet.level = quiet.level, logging.ERROR  # from_path announces the snapshot it reads
    try:
        result = ray.train.Result.from_path(str(storage.resolve()))
    except (OSError, ValueError, RuntimeError):
        return None
    finally:
        quiet.setLevel(level)
    metrics = result.metrics or {}
    if result.checkpoint is None or "step" not in metrics:
        return None
    minutes = metrics.get("train/budget_minutes")
    return ResumePoint(RAY_CHECKPOINT, int(metrics["step"]), None if minutes is None else float(minutes))


def _snapshot_point(source: str, meta: dict) -> ResumePoint:
    seconds = meta.get("train_seconds")
    return ResumePoint(source, int(meta["step"]), None if seconds is None else float(seconds) / 60)


def resume_point(cfg: RunConfig) -> ResumePoint | None:
    """Where `drelay train` with `cfg` would continue, or None: from step 0."""
    from drelay_model.drafter.checkpoint import CONFIG
    from pipelines.train.snapshot import has_snapshot, is_snapshot_of
    from pipelines.train.snapshot_history import carried

    point = ray_checkpoint_point(repo_path(cfg.ray.storage_path) / cfg.ray.run_name)
    if point is not None or not cfg.train.snapshot_dir:
        return point
    snap = repo_path(cfg.train.snapshot_dir)
    if has_snapshot(snap):
        try:
            meta = json.loads((snap / CONFIG).read_text()).get("meta", {})
        except (OSError, ValueError):
            return None  # the run itself says what is wrong with it (driver.check_inputs)
        return _snapshot_point(SNAPSHOT, meta) if is_snapshot_of(meta, cfg.ray.run_name) and "step" in meta else None
    found = carried(snap, run_name=cfg.ray.run_name)
    return None if found is None else _snapshot_point(f"the snapshot carried in {found[0][:10]}", found[1])
