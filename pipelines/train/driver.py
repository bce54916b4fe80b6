"""The training driver: validate inputs, open the MLflow run, run a Ray Train `TorchTrainer`, export.

    drelay train --config platform/experiments/smollm2-135m/train.yaml [section.key=value ...]

Runs locally (a Ray cluster started on demand) or on a cluster (`ray.address`, or submit this same
command as a Ray job). Resume: re-running with the same `ray.run_name` and `ray.storage_path`
continues from the latest checkpoint; a killed worker is restarted from it (`ray.max_failures`).
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from drelay_model.atomic import atomic_directory
from drelay_model.errors import DRelayError
from pipelines.train.config import RunConfig
from pipelines.train.data import data_files
from pipelines.train.model_io import continues_selector
from pipelines.common.paths import repo_path
from pipelines.common.checkpoint_refs import rooted_local
from pipelines.common.outputs import ensure_writable_dir, local_dir
from pipelines.common.ray_start import start_ray
from pipelines.common.provenance import write_provenance
from pipelines.common.registry import register_checkpoint
from pipelines.common.run_tags import run_tags
from pipelines.common.tracking import attach, fail_stale_runs, get_client, tracked_run


@dataclass(frozen=True)
class TrainResult:
    checkpoint: Path  # the exported drafter checkpoint (drafter.safetensors + drafter_config.json)
    metrics: dict
    mlflow_run_id: str


def check_inputs(cfg: RunConfig) -> None:
    """Fail fast, before any cluster starts, on what the user can get wrong."""
    check_device(cfg)
    check_memory(cfg)
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
    ensure_writable_dir(local_dir(repo_path(cfg.output_dir), "output_dir"), "output_dir")
    ensure_writable_dir(repo_path(cfg.ray.storage_path), "ray.storage_path")
    if cfg.train.snapshot_dir:
        from pipelines.train.snapshot import check_snapshot

        snapshot = local_dir(repo_path(cfg.train.snapshot_dir), "train.snapshot_dir")
        ensure_writable_dir(snapshot.parent, "train.snapshot_dir")
        restore_carried(snapshot, run_name=cfg.ray.run_name)
        check_snapshot(snapshot, run_name=cfg.ray.run_name)


def restore_carried(snapshot, *, run_name: str) -> None:
    """A fresh clone: the run's snapshot, carried in git history (`drelay snapshot carry`), back on disk."""
    from pipelines.train.snapshot_history import restore

    found = restore(snapshot, run_name=run_name)
    if found is not None:
        commit, meta = found
        print(f"[train] train.snapshot_dir: restored run {run_name}'s snapshot at step {meta.get('step')} from commit"
              f" {commit[:12]} (git history)", file=sys.stderr)  # fmt: skip


def scaling_config(cfg: RunConfig):
    """Ray Train scaling: CPUs (and, with use_gpu, GPUs of an optional accelerator type) per worker."""
    from ray.train import ScalingConfig

    resources = {"CPU": cfg.ray.cpus_per_worker}
    if cfg.ray.use_gpu:
        resources["GPU"] = cfg.ray.gpus_per_worker
    return ScalingConfig(
        num_workers=cfg.ray.num_workers,
        use_gpu=cfg.ray.use_gpu,
        resources_per_worker=resources,
        accelerator_type=cfg.ray.accelerator_type,
    )


def torch_config(cfg: RunConfig):
    """Ray Train's process-group settings (the backend left to Ray: gloo on CPU, NCCL on GPUs) and
    `ray.timeout_s`, how long a collective waits for every rank (rank 0 validates meanwhile)."""
    from ray.train.torch import TorchConfig

    return TorchConfig(timeout_s=cfg.ray.timeout_s)


def check_device(cfg: RunConfig) -> None:
    """target.device=cuda needs GPUs: ray.use_gpu, and CUDA here when Ray runs a local cluster."""
    if cfg.target.device != "cuda":
        return
    if not cfg.ray.use_gpu:
        raise DRelayError("target.device: 'cuda' needs ray.use_gpu=true (workers get GPUs only then)")
    if cfg.ray.address is None:
        from drelay_model.device import resolve_device

        resolve_device("cuda")  # a one-line DRelayError without CUDA


def check_memory(cfg: RunConfig) -> None:
    """A GPU run whose memory plan (`drelay plan`) exceeds the local GPU is refused in one line.
    Checked where CUDA is visible to the driver (a single node or a GPU head); workers elsewhere
    are planned with `drelay plan --gpu-memory`."""
    import torch

    if not (cfg.ray.use_gpu and torch.cuda.is_available()):
        return
    from pipelines.train.plan import check_fits, plan_from_config

    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    check_fits(plan_from_config(cfg, gib))


def run_training(
    cfg: RunConfig, *, extra_worker_config: dict | None = None, ray_callbacks: tuple = (), parent_run_id: str | None = None
) -> TrainResult:
    """Train under Ray Train and export the drafter. `ray_callbacks` join the trainer's RunConfig (a Tune
    trial passes `TuneReportCallback`); `parent_run_id` nests the MLflow run under that run (a sweep)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig as RayRunConfig
    from ray.train.torch import TorchTrainer

    from pipelines.train.selector_stage import selector_stage_loop
    from pipelines.train.worker import train_loop_per_worker

    cfg = rooted_local(cfg)
    check_inputs(cfg)
    client = get_client(cfg.mlflow.tracking_uri)
    fail_stale_runs(cfg.mlflow.experiment, client=client, run_name=cfg.ray.run_name)
    worker_cfg = cfg.model_dump(mode="json")
    worker_cfg["data"]["regenerated"] = str(repo_path(cfg.data.regenerated))
    if cfg.drafter.init_checkpoint:
        worker_cfg["drafter"]["init_checkpoint"] = str(repo_path(cfg.drafter.init_checkpoint))
    if cfg.train.snapshot_dir:
        worker_cfg["train"]["snapshot_dir"] = str(repo_path(cfg.train.snapshot_dir))
    tags = run_tags("train", target=cfg.target.spec, method=cfg.selector.name)
    parent = None
    if parent_run_id:
        parent = attach(client, parent_run_id)
    with tracked_run(cfg.mlflow.experiment, run_name=cfg.ray.run_name, tags=tags, client=client, parent=parent) as run:
        run.log_params(_flat(cfg.model_dump(mode="json")))
        worker_cfg.update(extra_worker_config or {}, _mlflow_run_id=run.run_id, _mlflow_uri=client.tracking_uri)
        start_ray(
            address=cfg.ray.address,
            include_dashboard=True,
            log_to_driver=True,
            configure_logging=True,
            runtime_env=cfg.ray.runtime_env or None,
        )
        trainer = TorchTrainer(
            selector_stage_loop if cfg.train.stage == "selector" else train_loop_per_worker,  # the head alone, on cached blocks
            train_loop_config=worker_cfg,
            torch_config=torch_config(cfg),
            scaling_config=scaling_config(cfg),
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
            write_provenance(tmp, run_id=run.run_id, tracking_uri=client.tracking_uri, experiment=cfg.mlflow.experiment)
        run.log_artifact(final, artifact_path="drafter")
        if cfg.mlflow.registered_model:
            register_checkpoint(run.run_id, cfg.mlflow.registered_model, client=client)
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
