"""MLflow tracking shared by evaluation and training: where runs go, and runs that always end.

Where: `$MLFLOW_TRACKING_URI`, else `sqlite:///<repo>/outputs/mlflow.db` (MLflow 3.17 has no file
store). Experiments are created with an explicit `artifact_location` — `<db dir>/mlartifacts/<name>`
for SQLite stores (`<repo>/outputs/mlartifacts` by default) — so artifacts never land in `./mlruns`;
remote servers (http, postgres) choose their own.

Runs: `tracked_run(...)` is a context manager over `MlflowClient` (no global "active run" state, so
nested runs can be opened in any order and several may be open at once). It always terminates the
run: FINISHED on success, FAILED on any exception — KeyboardInterrupt and SystemExit included — so no
run is left RUNNING by a Python-level failure. A hard kill cannot be caught; `fail_stale_runs` cleans
those up afterwards (every run records its host and pid for that purpose).

mlflow is imported lazily: importing this module costs nothing.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from drelay_model.errors import DRelayError
from pipelines.common.paths import REPO_ROOT

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
PARENT_TAG = "mlflow.parentRunId"
HOST_TAG, PID_TAG = "drelay.host", "drelay.pid"
_MAX_PARAM = 6000  # MLflow's limit on a param value


def tracking_uri() -> str:
    """`$MLFLOW_TRACKING_URI`, else a SQLite store in the output root (its folder is created on demand)."""
    from pipelines.common.outputs import OUTPUT_ROOT_ENV, ensure_writable_dir, local_dir, output_root

    uri = os.environ.get(TRACKING_URI_ENV)
    if uri:
        return uri
    root = local_dir(output_root(), f"{OUTPUT_ROOT_ENV} (set {TRACKING_URI_ENV} for a URI output root)")
    return f"sqlite:///{ensure_writable_dir(root, OUTPUT_ROOT_ENV) / 'mlflow.db'}"


def artifact_root(uri: str) -> Path | None:
    """Where experiments of a SQLite store keep artifacts: `<db dir>/mlartifacts`; None otherwise."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts"


def get_client(uri: str | None = None):
    """An `MlflowClient` for `uri` (default `tracking_uri()`), with MLflow's INFO chatter muted."""
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri or tracking_uri())


def ensure_experiment(client, name: str) -> str:
    """The id of experiment `name`, created (with an artifact location) if it does not exist."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        root = artifact_root(client.tracking_uri)
        location = None
        if root is not None:
            (root / name).mkdir(parents=True, exist_ok=True)
            location = (root / name).as_uri()
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException:  # created concurrently by another process
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage != "active":
        raise DRelayError(f"MLflow experiment '{name}' is deleted; restore it or choose another --experiment")
    return exp.experiment_id


class TrackedRun:
    """A handle on one open run; every method logs to that run only."""

    def __init__(self, client, run_id: str, experiment_id: str, name: str) -> None:
        self.client, self.run_id, self.experiment_id, self.name = client, run_id, experiment_id, name

    def log_metrics(self, metrics: Mapping[str, float | None], *, step: int | None = None) -> None:
        """Log finite numeric values in one batch (None and NaN are skipped)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, float(v), now, step or 0) for key, v in metrics.items() if v is not None and math.isfinite(float(v))]
        for i in range(0, len(batch), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:_MAX_PARAM]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)[:_MAX_PARAM]) for k, v in tags.items()])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        """Log rows (dicts with the same keys) as an MLflow table artifact (JSON, shown in the UI)."""
        if not rows:
            return
        columns = {k: [r.get(k) for r in rows] for k in rows[0]}
        self.client.log_table(self.run_id, columns, artifact_file)

    def child(self, run_name: str, **kwargs) -> AbstractContextManager["TrackedRun"]:
        """A nested run under this one (a context manager, like `tracked_run`)."""
        return tracked_run(self.experiment_id, run_name=run_name, parent=self, client=self.client, **kwargs)


def attach(client, run_id: str) -> TrackedRun:
    """A handle on an existing run (e.g. a sweep's or a study's parent, to nest new runs under it)."""
    run = client.get_run(run_id)
    return TrackedRun(client, run_id, run.info.experiment_id, run.info.run_name)


@contextmanager
def tracked_run(
    experiment: str,
    *,
    run_name: str,
    tags: Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
    parent: TrackedRun | None = None,
    client=None,
) -> Iterator[TrackedRun]:
    """Start a run (nested under `parent` if given) and always end it: FINISHED, or FAILED on error.

    `experiment` is a name (created if missing) or, for nested runs, the parent's experiment id.
    """
    client = client or (parent.client if parent else get_client())
    exp_id = parent.experiment_id if parent else ensure_experiment(client, experiment)
    all_tags = {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid()), **(tags or {})}
    if parent is not None:
        all_tags[PARENT_TAG] = parent.run_id
    run = client.create_run(exp_id, run_name=run_name, tags={k: str(v) for k, v in all_tags.items()})
    handle = TrackedRun(client, run.info.run_id, exp_id, run_name)
    try:
        if params:
            handle.log_params(params)
        yield handle
    except BaseException:
        _terminate(client, handle.run_id, "FAILED")
        raise
    _terminate(client, handle.run_id, "FINISHED")


def _terminate(client, run_id: str, status: str) -> None:
    """End a run; a failure to record the end must not hide the error that caused it."""
    try:
        client.set_terminated(run_id, status)
    except Exception as exc:  # noqa: BLE001 - best effort while unwinding
        logging.getLogger(__name__).warning("could not mark MLflow run %s %s: %s", run_id, status, exc)


def fail_stale_runs(experiment: str, *, client=None, older_than_s: float | None = None, run_name: str | None = None) -> list[str]:
    """Mark RUNNING runs of an experiment FAILED when their process is gone; returns their ids.

    A run is stale if it was started on this host by a pid that no longer exists, or — when
    `older_than_s` is given — if it started more than that many seconds ago (for runs from other
    hosts or tools). Live runs of this host are never touched. `run_name` restricts the search.
    """
    client = client or get_client()
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    query = "attributes.status = 'RUNNING'"
    if run_name:
        query += f" and attributes.run_name = '{run_name}'"
    host, now_ms, stale = socket.gethostname(), time.time() * 1000, []
    for run in client.search_runs([exp.experiment_id], query, max_results=5000):
        tags = run.data.tags
        dead_here = tags.get(HOST_TAG) == host and not _pid_alive(tags.get(PID_TAG))
        too_old = older_than_s is not None and run.info.start_time < now_ms - 1000 * older_than_s
        if dead_here or too_old:
            client.set_tag(run.info.run_id, "drelay.stale", "true")
            client.set_terminated(run.info.run_id, "FAILED")
            stale.append(run.info.run_id)
    return stale


def _pid_alive(pid: str | None) -> bool:
    if not pid or not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def git_commit(repo: Path = REPO_ROOT) -> str:
    """HEAD's commit (with '-dirty' when the work tree has changes), or 'unknown' outside git."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=10
        )
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def hardware_description() -> str:
    """One line naming the compute: GPU model(s) when CUDA is used, else the CPU and its core count."""
    import torch

    if torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        return f"{torch.cuda.device_count()}x {'/'.join(sorted(names))}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.get_num_threads()} threads"
