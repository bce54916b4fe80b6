"""One sweep trial: a real Ray Train run inside a Tune trial (Ray 2.60's function-trainable pattern).

The Tune trial driver (`run_trial`, a small CPU share) builds the trial's training config — the base
with the sampled values at their dotted paths, a run name and output folders of its own — and calls
`run_training`, which runs a `TorchTrainer` whose workers report `val/tau` at every validation step.
`ValidationReport` forwards those reports to Tune, so ASHA can stop the trial at a rung. A trial
that is restarted (failed, or an interrupted sweep resumed) reuses its run name and Ray storage, so
Ray Train continues it from its latest checkpoint.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipelines.train.config import RunConfig, _set_dotted
from pipelines.tune.config import SweepConfig, load_doc


@dataclass(frozen=True)
class TrialContext:
    """What every trial of a sweep shares (passed to the trainable with `tune.with_parameters`)."""

    name: str
    base_doc: dict
    sweep_dir: str  # absolute
    max_steps: int
    metric: str
    parent_run_id: str
    tracking_uri: str
    experiment: str
    num_workers: int | None
    cpus_per_worker: int | None


def context_for(sweep: SweepConfig, base_doc: dict, sweep_dir: Path, *, parent_run_id: str, tracking_uri: str) -> TrialContext:
    base = RunConfig.model_validate(base_doc)
    return TrialContext(
        name=sweep.name, base_doc=base_doc, sweep_dir=str(sweep_dir), max_steps=sweep.scheduler.max_steps or base.train.max_steps,
        metric=sweep.metric, parent_run_id=parent_run_id, tracking_uri=tracking_uri, experiment=sweep.experiment,
        num_workers=sweep.resources.num_workers, cpus_per_worker=sweep.resources.cpus_per_worker,
    )  # fmt: skip


def trial_run_name(ctx: TrialContext, trial_id: str) -> str:
    """`<sweep>-<trial id>`: unique per trial, stable when the trial is restarted."""
    return f"{ctx.name}-{trial_id}".replace("_", "-")


def trial_config(ctx: TrialContext, params: dict[str, Any], trial_id: str) -> RunConfig:
    """The base config with the sampled values, the trial's budget, run name and folders."""
    doc = copy.deepcopy(ctx.base_doc)
    for path, value in params.items():
        _set_dotted(doc, path, value)
    fixed = {
        "train.max_steps": ctx.max_steps,
        "ray.run_name": trial_run_name(ctx, trial_id),
        "ray.storage_path": str(Path(ctx.sweep_dir) / "train"),
        "output_dir": str(Path(ctx.sweep_dir) / "trials"),
        "mlflow.tracking_uri": ctx.tracking_uri,
        "mlflow.experiment": ctx.experiment,
    }
    if ctx.num_workers is not None:
        fixed["ray.num_workers"] = ctx.num_workers
    if ctx.cpus_per_worker is not None:
        fixed["ray.cpus_per_worker"] = ctx.cpus_per_worker
    for path, value in fixed.items():
        _set_dotted(doc, path, value)
    return load_doc(doc, f"trial {trial_id}")


def best_config_doc(ctx: TrialContext, params: dict[str, Any]) -> dict:
    """A ready-to-train config for the best values: the trial's, under a run name of its own and the
    base's output folders (so `drelay train --config best.yaml` does not write into the sweep)."""
    cfg = trial_config(ctx, params, "best")
    base = RunConfig.model_validate(ctx.base_doc)
    doc = cfg.model_dump(mode="json")
    doc["ray"]["storage_path"], doc["output_dir"] = base.ray.storage_path, base.output_dir
    doc["mlflow"] = base.mlflow.model_dump(mode="json")
    return doc


def _report_callback(metric: str, max_steps: int):
    """`TuneReportCallback` forwarding the reports that carry the sweep's metric (validation steps;
    Tune rejects a result without it), except the last: a scheduler may stop a trial at any result it
    sees, ending its process, so the final result goes to Tune only after the drafter is exported and
    the MLflow run closed (`run_trial`)."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class ValidationReport(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if metrics and metric in metrics[0] and metrics[0].get("step", 0) < max_steps:
                super().after_report(run_context, metrics, checkpoint)

    return ValidationReport()


def run_trial(config: dict, ctx: dict) -> None:
    """The Tune trainable: `config` = {"params": sampled values by dotted path}."""
    from ray import tune

    from pipelines.train.driver import run_training

    context = TrialContext(**ctx)
    trial_id = tune.get_context().get_trial_id()
    cfg = trial_config(context, config["params"], trial_id)
    callback = _report_callback(context.metric, context.max_steps)
    result = run_training(cfg, ray_callbacks=(callback,), parent_run_id=context.parent_run_id)
    tune.report({**result.metrics, "checkpoint_path": str(result.checkpoint)})


def context_dict(ctx: TrialContext) -> dict:
    return asdict(ctx)
