"""A Ray cluster of two nodes on one box: a head and a second node, each its own `ray start` process
with 3 logical CPUs and a resource naming it (`cluster_nodes.py`).

- `drelay train` (a driver connected with `ray.address`) runs 2 DDP workers of 2 CPUs each: no node
  holds two, so there is one worker per node. The second node is killed mid-run (every one of its
  processes, by pid); Ray Train counts one worker-group failure (`ray.max_failures`), waits for the
  resources of a 2-worker group and, when a replacement node joins — what KubeRay or an autoscaler
  does for a lost node — restarts both workers from the last checkpoint. The MLflow run is one run:
  every step logged, the steps before that checkpoint once, FINISHED.
- `drelay submit tune`: a sweep submitted as a Ray job; its two concurrent trials (one 2-CPU worker
  each) run on both nodes.

Node ids come from Ray's own records: the state API's node table, and Ray Train's run history
(`RAY_TRAIN_ENABLE_STATE_TRACKING=1` on every node and the driver): attempts, workers, node ids.

Heavy: 9 minutes here on 2 busy shared cores (`make test-heavy`; docs/cluster.md).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from pipelines.common.outputs import REPO_ROOT
from tests.pipelines.cluster_nodes import LocalCluster
from tests.pipelines.test_tune import tiny_data_file, write_sweep

pytestmark = pytest.mark.heavy

CPUS_PER_NODE = 3  # one 2-CPU worker per node, never two; room for the trial drivers (0.1 CPU)
STEPS, CHECKPOINT_EVERY = 40, 5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Head + node `b`, torn down by pid at the end (on failure too)."""
    c = LocalCluster(tmp_path_factory.mktemp("nodes"), cpus_per_node=CPUS_PER_NODE,
                     env={"RAY_TRAIN_ENABLE_STATE_TRACKING": "1", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"})  # fmt: skip
    try:
        c.start_head()
        c.add_node("b")
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return tiny_data_file(tmp_path_factory.mktemp("data") / "tiny.jsonl")


def _second(cluster: LocalCluster) -> str:
    """The live non-head node (`b`, or its replacement)."""
    names = [n for n in cluster.node_ids() if n != "head"]
    assert len(names) == 1, names
    return names[0]


def _start(cluster: LocalCluster, argv: list[str], log: Path, **env) -> subprocess.Popen:
    """`drelay ARGV` as a user runs it against this cluster: its own process (and process group)."""
    full = {**cluster.env, "PYTHONPATH": str(REPO_ROOT), **env}
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "cli", *argv], cwd=REPO_ROOT, env=full, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _finish(proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Wait (bounded) for a `drelay` process; it must exit 0. Killed (its group) if it runs over."""
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        _stop(proc)
    assert rc == 0, log.read_text()[-3000:]


def _steps(client, run_id: str) -> list[int]:
    return [m.step for m in client.get_metric_history(run_id, "loss/support")]


def _max_step(client, run_name: str) -> int:
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, f"attributes.run_name = '{run_name}'") if experiments else []
    return max((max(_steps(client, r.info.run_id), default=0) for r in runs), default=0)


def _run_by_name(cluster: LocalCluster, name: str) -> dict:
    runs = [r for r in cluster.train_runs() if r["name"] == name]
    assert len(runs) == 1, [r["name"] for r in cluster.train_runs()]
    return runs[0]


def _attempt_nodes(attempt: dict) -> list[str]:
    return sorted(w["node_id"] for w in attempt["workers"])


def test_train_spans_both_nodes_and_survives_losing_one(cluster, data, tmp_path):
    from drelay_model.drafter import load_drafter
    from drelay_model.target import tiny_target
    from pipelines.common.tracking import get_client

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = {
        "target": {"spec": "tiny-llama"},
        "drafter": {"num_layers": 1, "top_k": 8},
        "data": {"regenerated": str(data), "validation_fraction": 0.1},
        "train": {"max_steps": STEPS, "checkpoint_every": CHECKPOINT_EVERY, "validate_every": STEPS, "seqs_per_step": 4,
                  "anchors_per_seq": 8, "validation_prompts": 2, "warmup_steps": 2},
        "ray": {"num_workers": 2, "cpus_per_worker": 2, "max_failures": 1, "address": cluster.gcs_address,
                "storage_path": str(tmp_path / "ray"), "run_name": "two-node"},
        "mlflow": {"tracking_uri": uri},
        "output_dir": str(tmp_path / "out"),
    }  # fmt: skip
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    client = get_client(uri)
    client.search_experiments()  # the store's tables exist before two processes open it
    before = cluster.node_ids()
    log = tmp_path / "train.log"
    proc = _start(cluster, ["train", "--config", str(tmp_path / "train.yaml")], log)
    try:
        seen, deadline = 0, time.monotonic() + 420
        while seen <= CHECKPOINT_EVERY and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.25)
            seen = _max_step(client, "two-node")
        assert CHECKPOINT_EVERY < seen < STEPS, f"the run was not caught between its first checkpoint and its end: {seen}"
        cluster.kill_node("b")  # mid-run, past the step-5 checkpoint
        cluster.add_node("c")  # the replacement
    except BaseException:
        _stop(proc)
        raise
    _finish(proc, log, timeout_s=600)

    # Ray Train's record: the first attempt had one worker on each node; it failed with the node; the
    # attempt that finished ran on the head and the replacement.
    run = _run_by_name(cluster, "two-node")
    attempts = sorted((a for a in run["attempts"] if a["workers"]), key=lambda a: a["start_time_ns"])
    after = cluster.node_ids()
    assert run["status"] == "FINISHED"
    assert _attempt_nodes(attempts[0]) == sorted([before["head"], before["b"]]) and attempts[0]["status"] == "ERRORED"
    assert _attempt_nodes(attempts[-1]) == sorted([after["head"], after["c"]]) and attempts[-1]["status"] == "FINISHED"

    # MLflow: one run, every step logged; the steps up to the last checkpoint before the kill once (the
    # restart continued from a checkpoint, not from scratch), the few after it at most twice.
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], "attributes.run_name = 'two-node'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    counts = Counter(_steps(client, runs[0].info.run_id))
    last_checkpoint = seen // CHECKPOINT_EVERY * CHECKPOINT_EVERY
    assert set(counts) == set(range(1, STEPS + 1)) and max(counts.values()) <= 2, counts
    assert all(counts[s] == 1 for s in range(1, last_checkpoint + 1)), (seen, counts)
    drafter_meta = load_drafter(tmp_path / "out" / "two-node" / "drafter", tiny_target("tiny-llama"))[2]
    assert drafter_meta["step"] == STEPS


def test_submitted_sweep_runs_its_trials_on_both_nodes(cluster, data, tmp_path):
    """Two concurrent trials, one 2-CPU worker each: a 3-CPU node holds one such worker, so the second
    trial's worker runs on the other node, whichever node each trial's driver (0.1 CPU) landed on."""
    from pipelines.common.tracking import PARENT_TAG, get_client

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    get_client(uri).search_experiments()
    path = write_sweep(tmp_path, data, space={"train.lr": {"values": [1e-2, 5e-3]}}, scheduler={"name": "fifo"},
                       metric="loss/support", mode="min", max_concurrent_trials=2,
                       resources={"num_workers": 1, "cpus_per_worker": 2})  # fmt: skip
    nodes = cluster.node_ids()
    assert set(nodes) == {"head", _second(cluster)}
    # The job ships this checkout minus the bundled checkpoints and data (the tiny target needs neither).
    argv = ["submit", "--address", cluster.dashboard, "--output-root", str(tmp_path / "shared"), "--exclude", "/checkpoints",
            "--exclude", "/data", "tune", "--config", str(path)]  # fmt: skip
    log = tmp_path / "submit.log"
    _finish(_start(cluster, argv, log, MLFLOW_TRACKING_URI=uri), log, timeout_s=900)
    assert "SUCCEEDED" in log.read_text()

    rows = list(csv.DictReader((tmp_path / "sweeps" / "tiny-sweep" / "trials.csv").open()))
    assert len(rows) == 2 and all(r["status"] == "completed" for r in rows), rows
    workers = {}
    for row in rows:
        run = _run_by_name(cluster, row["run_name"])
        assert run["status"] == "FINISHED"
        (finished,) = [a for a in run["attempts"] if a["status"] == "FINISHED"]
        workers[row["run_name"]] = _attempt_nodes(finished)
    assert sorted(n for w in workers.values() for n in w) == sorted(nodes.values()), (workers, nodes)

    client = get_client(uri)
    parent_id = json.loads((tmp_path / "sweeps" / "tiny-sweep" / "sweep.json").read_text())["parent_run_id"]
    parent = client.get_run(parent_id)
    children = client.search_runs([parent.info.experiment_id], f"tags.`{PARENT_TAG}` = '{parent_id}'")
    assert parent.info.status == "FINISHED" and sorted(c.info.status for c in children) == ["FINISHED", "FINISHED"]
