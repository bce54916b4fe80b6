"""Run a study: its training runs stage by stage (skipping finished ones), then the replay comparison
of their exported checkpoints, then (with `ship:`) copy one run's checkpoint to checkpoints/<target>/."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from drelay_model.atomic import atomic_directory
from drelay_model.drafter.heads import carry_heads
from drelay_model.errors import DRelayError
from pipelines.common.methods import check_selector_weights, trained_selector
from pipelines.common.checkpoint_refs import resolve_ref, rooted_local
from pipelines.common.outputs import shipped_checkpoints_dir
from pipelines.common import paths
from pipelines.common.paths import repo_path
from pipelines.eval.compare_run import CompareJob, run_compare
from pipelines.study.spec import StudySpec, final_checkpoint, finished, run_configs
from pipelines.train.config import RunConfig
from pipelines.train.driver import check_inputs, run_training
from pipelines.train.resume import resume_point


def plan(spec: StudySpec, only: list[str]) -> tuple[dict[str, RunConfig], list[str]]:
    """Every run's config (validated up front) and the labels to train; prints one line per run."""
    configs = {label: rooted_local(c) for label, c in run_configs(spec, repo_path).items()}
    unknown = [x for x in only if x not in configs]
    if unknown:
        raise DRelayError(f"--only: unknown run label(s) {', '.join(unknown)} (have: {', '.join(configs)})")
    todo = [label for label in configs if not only or label in only]
    for label in todo:
        cfg = configs[label]
        done = finished(cfg, repo_path)
        resume = None if done else resume_point(cfg)
        state = "done" if done else (resume.describe(cfg) if resume else "to train")
        budget = f"{cfg.train.max_steps} steps" + (
            f" or {cfg.train.max_minutes:g} {cfg.train.budget_clock} min" if cfg.train.max_minutes else ""
        )
        print(f"[study] {label}: run {cfg.ray.run_name}, {budget}, selector {cfg.selector.name} — {state}")
    return configs, todo


def dry_run(configs: dict[str, RunConfig], todo: list[str]) -> None:
    check_inputs(configs[todo[0]])


def study_parent_run(spec: StudySpec, configs: dict[str, RunConfig]) -> str:
    """The study's MLflow parent run (kind `study`), in the training runs' experiment so that they, and
    the comparison, nest under it in the UI. Created once; its id is kept in
    `outputs/studies/<name>/mlflow.json`, so a resumed study nests its new runs under the same parent."""
    from pipelines.common.run_tags import run_tags
    from pipelines.common.tracking import ensure_experiment, get_client

    first = configs[spec.run_labels()[0]]
    client = get_client(first.mlflow.tracking_uri)
    record = repo_path(f"outputs/studies/{spec.name}/mlflow.json")
    if record.is_file():
        known = json.loads(record.read_text())
        if known.get("tracking_uri") == client.tracking_uri:
            return known["run_id"]
    exp = ensure_experiment(client, first.mlflow.experiment)
    tags = run_tags("study", target=first.target.spec, method=",".join(c.selector.name for c in configs.values()))
    run = client.create_run(exp, run_name=spec.name, tags=tags)
    client.log_param(run.info.run_id, "runs", ",".join(configs))
    record.parent.mkdir(parents=True, exist_ok=True)
    tmp = record.with_suffix(".tmp")
    tmp.write_text(json.dumps({"run_id": run.info.run_id, "tracking_uri": client.tracking_uri}) + "\n")
    tmp.replace(record)
    return run.info.run_id


def end_study_run(configs: dict[str, RunConfig], run_id: str) -> None:
    from pipelines.common.tracking import get_client

    get_client(next(iter(configs.values())).mlflow.tracking_uri).set_terminated(run_id, "FINISHED")


def train_runs(configs: dict[str, RunConfig], todo: list[str], *, parent_run_id: str | None = None) -> None:
    for label in todo:
        cfg = configs[label]
        if finished(cfg, repo_path):
            continue
        print(f"[study] training {label} …", flush=True)
        result = run_training(cfg, parent_run_id=parent_run_id)
        print(
            f"[study] {label}: {result.checkpoint} · "
            + json.dumps({k: round(v, 4) for k, v in result.metrics.items() if k.startswith("val/")})
        )


def compare_and_ship(spec: StudySpec, configs: dict[str, RunConfig], *, progress: bool, parent_run_id: str | None = None) -> None:
    missing = [label for label in configs if not finished(configs[label], repo_path)]
    if missing:
        raise DRelayError(f"runs not finished: {', '.join(missing)}")
    if spec.compare is not None:
        _compare(spec, configs, progress, parent_run_id)
    if spec.ship is not None:
        _ship(configs[spec.ship], final_checkpoint(configs[spec.ship], repo_path))


def check_compare_checkpoints(spec: StudySpec) -> None:
    """The comparison's checkpoints from outside the study exist and run their selectors (their own, a
    rule, or a head installed beside them by `drelay heads add`): checked before anything trains."""
    for label, (folder, selector) in _outside(spec).items():
        if not folder.is_dir():
            raise DRelayError(f"compare.checkpoints.{label}: checkpoint directory '{folder}' not found")
        try:
            check_selector_weights(folder, selector or trained_selector(folder))
        except DRelayError as exc:
            raise DRelayError(f"compare.checkpoints.{label}: {exc}") from None


def _outside(spec: StudySpec) -> dict[str, tuple[Path, str | None]]:
    """compare.checkpoints: label → (the directory, the selector it names or None); a pinned folder
    (`FOLDER@COMMIT`) is the one written out from that commit."""
    out = {}
    for label, ref in (spec.compare.checkpoints if spec.compare is not None else {}).items():
        folder, sep, selector = ref.rpartition(":") if ":" in ref else (ref, "", "")
        try:
            out[label] = (Path(repo_path(resolve_ref(folder))), selector if sep else None)
        except DRelayError as exc:
            raise DRelayError(f"compare.checkpoints.{label}: {exc}") from None
    return out


def _compare(spec: StudySpec, configs: dict[str, RunConfig], progress: bool, parent_run_id: str | None) -> None:
    c = spec.compare
    variants = []
    for label, ref in spec.compared().items():
        run_label, _, selector = ref.partition(":")
        path = final_checkpoint(configs[run_label], repo_path)
        variants.append(f"{label}={path}" + (f":{selector}" if selector else ""))
    for label, (folder, selector) in _outside(spec).items():
        variants.append(f"{label}={folder}" + (f":{selector}" if selector is not None else ""))
    run_compare(CompareJob(
        variants=tuple(variants), baseline=c.baseline, target=configs[spec.run_labels()[0]].target.spec,
        benchmarks=c.benchmarks, limit=c.limit, data_dir=str(repo_path(c.data_dir)) if c.data_dir else None,
        decode=c.decode, run_name=f"{spec.name}-compare", out=str(repo_path(c.out or f"outputs/compare/{spec.name}")), progress=progress,
        parent_run_id=parent_run_id, bootstrap_resamples=c.bootstrap_resamples, bootstrap_seed=c.bootstrap_seed,
    ))  # fmt: skip


def _ship(cfg: RunConfig, checkpoint) -> None:
    dest = (shipped_checkpoints_dir() or paths.BUNDLED_CHECKPOINTS) / cfg.target.spec  # read at call time
    with atomic_directory(dest) as tmp:
        shutil.copytree(checkpoint, tmp, dirs_exist_ok=True)
        carried = carry_heads(dest, tmp) if dest.is_dir() else []  # heads that still fit the shipped drafter
    print(f"[study] shipped {checkpoint} → {dest}" + (f" (kept heads: {', '.join(carried)})" if carried else ""))
