"""`drelay tune`: run a sweep on Ray Tune, every trial a Ray Train run, tracked in MLflow.

Layout under `<output_dir>/<name>/`:
    tune/              the Tune experiment (what `--resume` restores)
    train/<run>/       each trial's Ray Train run and checkpoints (a restarted trial continues there)
    trials/<run>/      each finished trial's exported drafter
    sweep.json         the MLflow parent run id (a resumed sweep keeps logging under it)
    trials.csv, parallel_coordinates.png, metric_vs_params.png, best.yaml

MLflow: the sweep is a parent run; each trial a nested run (its sampled values among its params, its
`val/tau` curve, a `drelay.checkpoint` tag pointing at its checkpoint); the parent holds the trial
table, the plots and the best trial's id.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ray.tune import Callback

from drelay_model.errors import DRelayError
from pipelines.common.ray_start import start_ray
from pipelines.common.tracking import HOST_TAG, PID_TAG, TrackedRun, ensure_experiment, get_client
from pipelines.common.paths import repo_path
from pipelines.train.driver import check_inputs
from pipelines.tune.config import SweepConfig
from pipelines.tune.report import SweepResult, start_reference, summarize, trial_runs, write_best
from pipelines.tune.trial import TrialContext, context_dict, context_for, run_trial, trial_config, trial_run_name


def sweep_dir_for(sweep: SweepConfig) -> Path:
    return repo_path(sweep.output_dir) / sweep.name


def preflight(sweep: SweepConfig, base_doc: dict, *, resume: bool) -> Path:
    """Checks that need the file system, before anything is written; returns the sweep folder."""
    folder = sweep_dir_for(sweep)
    state = folder / "tune"
    if resume and not state.is_dir():
        raise DRelayError(f"--resume: no sweep to resume in '{folder}'")
    if not resume and folder.exists() and any(folder.iterdir()):
        raise DRelayError(f"sweep '{sweep.name}' already has results in '{folder}': pass --resume to continue it, or rename it")
    base = load_base_cfg(base_doc)
    if base.train.validation_prompts < 1:
        raise DRelayError("base: train.validation_prompts must be ≥ 1 (a sweep ranks trials by validation τ)")
    ctx = context_for(sweep, base_doc, folder, parent_run_id="", tracking_uri="")
    first = {path: space.endpoints()[0] for path, space in sweep.space.items()}
    check_inputs(trial_config(ctx, first, "check"))  # data and init checkpoint exist; creates the folders
    return folder


def load_base_cfg(base_doc: dict):
    from pipelines.train.config import RunConfig

    return RunConfig.model_validate(base_doc)


@contextmanager
def parent_run(sweep: SweepConfig, folder: Path, client, *, resume: bool) -> Iterator[TrackedRun]:
    """The sweep's MLflow parent run: created once (its id kept in sweep.json), reopened on resume;
    FINISHED when the sweep completes, FAILED on any error or interrupt."""
    exp_id = ensure_experiment(client, sweep.experiment)
    record = folder / "sweep.json"
    tags = {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid())}
    if resume and record.is_file():
        run_id = json.loads(record.read_text())["parent_run_id"]
        client.update_run(run_id, status="RUNNING")
        for key, value in tags.items():
            client.set_tag(run_id, key, value)
    else:
        run_id = client.create_run(exp_id, run_name=sweep.name, tags={**tags, "drelay.sweep": "true"}).info.run_id
        record.write_text(json.dumps({"parent_run_id": run_id, "experiment": sweep.experiment}) + "\n")
    handle = TrackedRun(client, run_id, exp_id, sweep.name)
    try:
        yield handle
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")


def search_space(sweep: SweepConfig) -> dict:
    """Tune domains keyed by dotted path, under "params"."""
    from ray import tune

    out = {}
    for path, space in sweep.space.items():
        if sweep.search == "grid":
            out[path] = tune.grid_search(list(space.values))
        elif space.values is not None:
            out[path] = tune.choice(list(space.values))
        else:
            out[path] = (tune.loguniform if space.log else tune.uniform)(space.low, space.high)
    return {"params": out}


def _tune_config(sweep: SweepConfig, max_steps: int):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    s = sweep.scheduler
    if s.name == "asha":
        scheduler = ASHAScheduler(time_attr="step", max_t=max_steps, grace_period=min(s.grace_period, max_steps),
                                  reduction_factor=s.reduction_factor)  # fmt: skip
    else:
        scheduler = FIFOScheduler()
    if sweep.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        search = OptunaSearch(seed=sweep.seed)  # TPE by default
        limit = sweep.max_concurrent_trials  # Tune wraps a Searcher in a ConcurrencyLimiter
    else:
        search = BasicVariantGenerator(random_state=sweep.seed, max_concurrent=sweep.max_concurrent_trials)
        limit = None  # the generator limits itself (Tune ignores the setting for generators)
    return tune.TuneConfig(
        metric=sweep.metric, mode=sweep.mode, search_alg=search, scheduler=scheduler,
        num_samples=sweep.num_samples, max_concurrent_trials=limit,
    )  # fmt: skip


def check_cluster_fits(sweep: SweepConfig, base) -> None:
    """One trial's CPUs (its driver's share + its workers') must fit the cluster, or it waits forever."""
    import ray

    workers = sweep.resources.num_workers or base.ray.num_workers
    per_worker = sweep.resources.cpus_per_worker or base.ray.cpus_per_worker
    need, have = sweep.resources.driver_cpu + workers * per_worker, ray.cluster_resources().get("CPU", 0.0)
    if need > have:
        raise DRelayError(
            f"resources: a trial needs {need:g} CPUs (driver_cpu {sweep.resources.driver_cpu:g} + {workers} workers × "
            f"{per_worker}) but the Ray cluster has {have:g}"
        )


def _release_dead_creators(job_id: str | None = None) -> tuple[int, int]:
    """One pass over the live, non-detached placement groups that actors made: remove each whose creator
    is dead; returns (how many were removed, how many of job `job_id`'s (hex) are still held). Placement
    groups made by a driver (Tune's, per trial) never count: a driver's creator id is
    ActorID::NilFromJob, whose 12 unique bytes are 0xff (an ActorID then ends with its job's id)."""
    import ray
    from ray._private.state import state
    from ray.core.generated.gcs_pb2 import PlacementGroupTableData
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    job = bytes.fromhex(job_id) if job_id else None
    released = held = 0
    for raw in state._connect_and_get_accessor().get_placement_group_table():  # Ray-internal: the raw GCS rows
        pg = PlacementGroupTableData.FromString(raw)
        made_by_actor = pg.creator_actor_id[:12] != b"\xff" * 12
        if pg.state == PlacementGroupTableData.REMOVED or not made_by_actor or pg.is_detached:
            continue
        if pg.creator_actor_dead:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(pg.placement_group_id)))
            released += 1
        elif pg.creator_actor_id[12:] == job:
            held += 1
    return released, held


def release_orphaned_placement_groups() -> int:
    """Remove placement groups whose creating actor is dead; returns how many.

    A trial that ASHA stops ends its process, and with it the Ray Train controller that it created;
    the controller's worker-group placement group (its workers' CPUs) lives on with the job. Ray
    Train's own PlacementGroupCleaner frees it through the state API, which needs the dashboard and
    fails on a host running more than one Ray instance ("Found multiple active Ray instances"), leaving
    later trials waiting for CPUs that never come back. Placement groups made by the driver (Tune's, per
    trial) and detached ones are never touched."""
    return _release_dead_creators()[0]


def release_after_the_last_trial(timeout_s: float = 30.0) -> int:
    """After `Tuner.fit` every trial has ended, so each placement group an actor of this job still holds
    belongs to a stopped trial's controller, which Ray may still be tearing down: release each one once
    its creator is dead, waiting at most `timeout_s`. Returns how many were released."""
    import ray

    job_id = ray.get_runtime_context().get_job_id()
    deadline, released = time.monotonic() + timeout_s, 0
    while True:
        removed, held = _release_dead_creators(job_id)
        released += removed
        if not held or time.monotonic() >= deadline:
            return released
        time.sleep(0.5)


class ReleaseOrphanedPlacementGroups(Callback):
    """Runs `release_orphaned_placement_groups` from the sweep driver at most every `every_s` seconds."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s, self.last = every_s, 0.0

    def on_step_end(self, iteration, trials, **info):
        if time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            release_orphaned_placement_groups()


def _trainable(sweep: SweepConfig, ctx: TrialContext):
    from ray import tune

    fn = tune.with_parameters(run_trial, ctx=context_dict(ctx))
    return tune.with_resources(fn, {"cpu": sweep.resources.driver_cpu})


def run_sweep(sweep: SweepConfig, base_doc: dict, *, resume: bool = False) -> SweepResult:
    """Run (or `resume`) a sweep to completion, then write its table, plots and best config."""
    from ray import tune

    folder = preflight(sweep, base_doc, resume=resume)
    base = load_base_cfg(base_doc)
    start_ray(address=base.ray.address, include_dashboard=True, log_to_driver=True, configure_logging=True)
    check_cluster_fits(sweep, base)
    client = get_client(base.mlflow.tracking_uri)
    with parent_run(sweep, folder, client, resume=resume) as parent:
        ctx = context_for(sweep, base_doc, folder, parent_run_id=parent.run_id, tracking_uri=client.tracking_uri)
        if not resume:
            parent.log_params({"sweep.search": sweep.search, "sweep.scheduler": sweep.scheduler.name,
                               "sweep.metric": sweep.metric, "sweep.num_samples": sweep.num_samples,
                               "sweep.max_steps": ctx.max_steps, **{f"space.{k}": v.model_dump() for k, v in sweep.space.items()}})  # fmt: skip
        trainable = _trainable(sweep, ctx)
        path = str(folder / "tune")
        if resume:
            tuner = tune.Tuner.restore(path, trainable=trainable, resume_unfinished=True, resume_errored=True)
        else:
            tuner = tune.Tuner(
                trainable, param_space=search_space(sweep), tune_config=_tune_config(sweep, ctx.max_steps),
                run_config=tune.RunConfig(name="tune", storage_path=str(folder), verbose=1, callbacks=[ReleaseOrphanedPlacementGroups()],
                                          failure_config=tune.FailureConfig(max_failures=base.ray.max_failures)),
            )  # fmt: skip
        grid = tuner.fit()
        release_after_the_last_trial()  # of trials stopped after the callback's last pass
        return summarize(sweep, ctx, grid, parent, client, folder, start=start_reference(base, folder))


__all__ = ["SweepResult", "run_sweep", "trial_run_name", "trial_runs", "write_best"]  # re-exported from report
