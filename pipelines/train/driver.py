"""The training driver: validate inputs, open the MLflow run, run a Ray Train `TorchTrainer`, export.

    drelay train --config platform/experiments/smollm2-135m/train.yaml [section.key=value ...]

Runs locally (a Ray cluster started on demand) or on a cluster (`ray.address`, or submit this same
command as a Ray job). Resume: re-running with the same `ray.run_name` and `ray.storage_path`
continues from the latest checkpoint; a killed worker is restarted from it (`ray.max_failures`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from drelay_model.atomic import atomic_directory
from drelay_model.errors import DRelayError
from pipelines.config import RunConfig
from pipelines.train.data import data_files
from pipelines.train.model_io import continues_selector
from pipelines.tracking import REPO_ROOT, TrackedRun, fail_stale_runs, get_client, git_commit, hardware_description, tracked_run


@dataclass(frozen=True)
class TrainResult:
    checkpoint: Path  # the exported drafter checkpoint (drafter.safetensors + drafter_config.json)
    metrics: dict
    mlflow_run_id: str


def repo_path(path: str) -> Path:
    """A config path as an absolute path (relative paths are relative to the repository)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def check_inputs(cfg: RunConfig) -> None:
    """Fail fast, before any cluster starts, on what the user can get wrong."""
    if not cfg.data.fallback_reference_answers:
        try:
            data_files(repo_path(cfg.data.regenerated))
        except DRelayError as exc:
            raise DRelayError(f"data.regenerated: {exc}") from exc
    if cfg.drafter.init_checkpoint:
        from drelay_model.drafter.checkpoint import read_checkpoint

        try:
            meta = read_checkpoint(repo_path(cfg.drafter.init_checkpoint))[2]
        except DRelayError as exc:
            raise DRelayError(f"drafter.init_checkpoint: {exc}") from exc
        continues_selector(cfg, meta)  # a selector.config that contradicts the saved selector fails here
    for field, path in (("output_dir", cfg.output_dir), ("ray.storage_path", cfg.ray.storage_path)):
        folder = repo_path(path)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DRelayError(f"{field}: cannot create '{folder}' ({exc.strerror})") from exc
        if not os.access(folder, os.W_OK):
            raise DRelayError(f"{field}: '{folder}' is not writable")


def run_training(
    cfg: RunConfig, *, extra_worker_config: dict | None = None, ray_callbacks: tuple = (), parent_run_id: str | None = None
) -> TrainResult:
    """Train under Ray Train and export the drafter. `ray_callbacks` join the trainer's RunConfig (a Tune
    trial passes `TuneReportCallback`); `parent_run_id` nests the MLflow run under that run (a sweep)."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig as RayRunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from pipelines.train.worker import train_loop_per_worker

    check_inputs(cfg)
    client = get_client(cfg.mlflow.tracking_uri)
    fail_stale_runs(cfg.mlflow.experiment, client=client, run_name=cfg.ray.run_name)
    worker_cfg = cfg.model_dump(mode="json")
    worker_cfg["data"]["regenerated"] = str(repo_path(cfg.data.regenerated))
    if cfg.drafter.init_checkpoint:
        worker_cfg["drafter"]["init_checkpoint"] = str(repo_path(cfg.drafter.init_checkpoint))
    tags = {"target": cfg.target.spec, "selector": cfg.selector.name, "git_commit": git_commit(), "hardware": hardware_description()}
    parent = None
    if parent_run_id:
        parent = TrackedRun(client, parent_run_id, client.get_run(parent_run_id).info.experiment_id, name="")
    with tracked_run(cfg.mlflow.experiment, run_name=cfg.ray.run_name, tags=tags, client=client, parent=parent) as run:
        run.log_params(_flat(cfg.model_dump(mode="json")))
        worker_cfg.update(extra_worker_config or {}, _mlflow_run_id=run.run_id, _mlflow_uri=client.tracking_uri)
        if not ray.is_initialized():
            ray.init(address=cfg.ray.address, include_dashboard=True, log_to_driver=True, configure_logging=True)
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config=worker_cfg,
            scaling_config=ScalingConfig(
                num_workers=cfg.ray.num_workers, use_gpu=cfg.ray.use_gpu, resources_per_worker={"CPU": cfg.ray.cpus_per_worker}
            ),
            run_config=RayRunConfig(
                name=cfg.ray.run_name,
                storage_path=str(repo_path(cfg.ray.storage_path)),
                failure_config=FailureConfig(max_failures=cfg.ray.max_failures),
                checkpoint_config=CheckpointConfig(num_to_keep=2),
                callbacks=list(ray_callbacks) or None,
            ),
        )
        result = trainer.fit()
        if result.checkpoint is None:
            raise DRelayError("training produced no checkpoint")
        final = repo_path(cfg.output_dir) / cfg.ray.run_name / "drafter"
        with result.checkpoint.as_directory() as d, atomic_directory(final) as tmp:
            shutil.copytree(Path(d) / "drafter", tmp, dirs_exist_ok=True)
        run.log_artifact(final, artifact_path="drafter")
        return TrainResult(checkpoint=final, metrics=dict(result.metrics or {}), mlflow_run_id=run.run_id)


def _flat(doc: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out
