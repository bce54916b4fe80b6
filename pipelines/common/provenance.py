"""Which MLflow run produced a checkpoint: `provenance.json` beside `drafter_config.json`.

    {"mlflow_run_id": "…", "tracking_uri": "…", "experiment": "drelay-train"}

`drelay train` writes it into the exported checkpoint (inside the atomic publish, so a checkpoint
never exists without it); `drelay eval` tags each method run with `drelay.checkpoint_run` = that id,
so an evaluation links back to the training run in the MLflow UI. Older checkpoints have no file.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.common.run_tags import CHECKPOINT_RUN

PROVENANCE_FILE = "provenance.json"


def write_provenance(checkpoint_dir: str | Path, *, run_id: str, tracking_uri: str, experiment: str) -> Path:
    path = Path(checkpoint_dir) / PROVENANCE_FILE
    path.write_text(json.dumps({"mlflow_run_id": run_id, "tracking_uri": tracking_uri, "experiment": experiment}, indent=2))
    return path


def read_provenance(checkpoint_dir: str | Path | None) -> dict:
    """The checkpoint's provenance, or {} (no checkpoint, no file, or an unreadable one)."""
    if not checkpoint_dir:
        return {}
    path = Path(checkpoint_dir) / PROVENANCE_FILE
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def checkpoint_run_tag(checkpoint_dir: str | Path | None) -> dict[str, str]:
    run_id = read_provenance(checkpoint_dir).get("mlflow_run_id")
    return {CHECKPOINT_RUN: str(run_id)} if run_id else {}
