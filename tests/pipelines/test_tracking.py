"""pipelines.common.tracking: where runs go, runs that always end, stale-run cleanup (temporary SQLite stores)."""

from __future__ import annotations

import math
import os
import socket
import subprocess
from pathlib import Path

import pytest

from pipelines.common import tracking
from pipelines.common.tracking import HOST_TAG, PARENT_TAG, PID_TAG, fail_stale_runs, get_client, tracked_run


def _status(client, run_id: str) -> str:
    return client.get_run(run_id).info.status


def test_tracking_uri_defaults_to_repo_sqlite(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = tracking.tracking_uri()
    assert uri == f"sqlite:///{tracking.REPO_ROOT / 'outputs' / 'mlflow.db'}"
    assert tracking.artifact_root(uri) == tracking.REPO_ROOT / "outputs" / "mlartifacts"
    assert tracking.artifact_root("http://mlflow:5000") is None
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////x/y.db")
    assert tracking.tracking_uri() == "sqlite:////x/y.db"


def test_run_finishes_with_nested_children_and_artifacts_next_to_the_store(uri, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    client = get_client()
    with tracked_run("exp", run_name="parent", tags={"k": "v"}, params={"a": 1}) as parent:
        with parent.child("child", tags={"level": "c"}) as child:
            child.log_metrics({"x/tau": 2.5, "skip": None, "nan": math.nan})
            child.log_metrics({"series": 0.5}, step=3)
            child.log_table([{"id": "a", "v": 1}, {"id": "b", "v": 2}], "rows.json")
            (tmp_path / "f.txt").write_text("hi")
            child.log_artifact(tmp_path / "f.txt", "files")
    p, c = client.get_run(parent.run_id), client.get_run(child.run_id)
    assert p.info.status == c.info.status == "FINISHED"
    assert c.data.tags[PARENT_TAG] == parent.run_id and c.data.tags["level"] == "c"
    assert p.data.params == {"a": "1"} and p.data.tags["k"] == "v" and p.data.tags[PID_TAG] == str(os.getpid())
    assert c.data.metrics == {"x/tau": 2.5, "series": 0.5}
    assert [m.step for m in client.get_metric_history(child.run_id, "series")] == [3]
    assert {f.path for f in client.list_artifacts(child.run_id)} == {"rows.json", "files"}
    exp = client.get_experiment_by_name("exp")
    assert exp.artifact_location == (tmp_path / "mlartifacts" / "exp").as_uri()
    assert (tmp_path / "mlartifacts" / "exp" / child.run_id / "artifacts" / "files" / "f.txt").is_file()
    assert not (tmp_path / "mlruns").exists()


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt(), SystemExit(143)])
def test_errors_leave_every_open_run_failed(uri, error):
    client = get_client()
    ids = {}
    with pytest.raises(type(error)):
        with tracked_run("exp", run_name="parent") as parent:
            ids["parent"] = parent.run_id
            with parent.child("done") as done:
                ids["done"] = done.run_id
            with parent.child("open") as open_child:
                ids["open"] = open_child.run_id
                raise error
    assert _status(client, ids["parent"]) == "FAILED"
    assert _status(client, ids["open"]) == "FAILED"
    assert _status(client, ids["done"]) == "FINISHED"


def _running_run(client, exp_id: str, *, pid: str, host: str) -> str:
    run = client.create_run(exp_id, run_name="r", tags={HOST_TAG: host, PID_TAG: pid})
    return run.info.run_id


def test_fail_stale_runs_only_touches_dead_processes(uri):
    client = get_client()
    exp_id = tracking.ensure_experiment(client, "exp")
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = _running_run(client, exp_id, pid=str(dead.pid), host=socket.gethostname())
    live = _running_run(client, exp_id, pid=str(os.getpid()), host=socket.gethostname())
    remote = _running_run(client, exp_id, pid="1", host="some-other-host")
    assert fail_stale_runs("exp", client=client) == [stale]
    assert _status(client, stale) == "FAILED" and client.get_run(stale).data.tags["drelay.stale"] == "true"
    assert _status(client, live) == "RUNNING" and _status(client, remote) == "RUNNING"
    assert set(fail_stale_runs("exp", client=client, older_than_s=0)) == {live, remote}
    assert fail_stale_runs("no-such-experiment", client=client) == []


def test_deleted_experiment_is_a_clear_error(uri):
    from drelay_model.errors import DRelayError

    client = get_client()
    client.delete_experiment(tracking.ensure_experiment(client, "gone"))
    with pytest.raises(DRelayError, match="deleted"):
        tracking.ensure_experiment(client, "gone")


def test_provenance_helpers():
    assert tracking.git_commit() != ""
    assert tracking.git_commit(Path("/")) == "unknown"
    assert "cores" in tracking.hardware_description() or "x " in tracking.hardware_description()
