"""`drelay submit` / `drelay jobs`: the runtime env a job gets, bad input in one line, and a real
local Ray head (started and stopped here, 127.0.0.1 only) running `drelay submit eval`."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cli import main
from pipelines.common.outputs import OUTPUT_ROOT_ENV, REPO_ROOT
from pipelines.cluster.submit import EXCLUDES, auth_headers, runtime_env
from pipelines.common.run_tags import REQUIRED

RAY = Path(sys.executable).with_name("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_runtime_env_ships_the_checkout_without_outputs_and_points_at_the_root(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.team:5000")
    (tmp_path / "env.yaml").write_text("env_vars: {HF_HOME: /mnt/hf}\nexcludes: [data/big]\n")
    env = runtime_env("/mnt/shared", extra_file=str(tmp_path / "env.yaml"), env=["A=1"], excludes=["bench"])
    assert env["working_dir"] == str(REPO_ROOT)
    assert {".git", ".venv", "outputs", "**/__pycache__"} <= set(env["excludes"]) and {"data/big", "bench"} <= set(
        env["excludes"]
    )
    assert env["env_vars"] == {"HF_HOME": "/mnt/hf", "MLFLOW_TRACKING_URI": "http://mlflow.team:5000", "A": "1",
                               OUTPUT_ROOT_ENV: "/mnt/shared", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    assert set(EXCLUDES) <= set(env["excludes"])


def test_auth_header_comes_from_the_token_file(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    (tmp_path / "tok").write_text("abc123\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "tok"))
    assert auth_headers() == {"Authorization": "Bearer abc123"}
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "none"))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert auth_headers() == {}


@pytest.mark.parametrize("argv, message", [
    (["submit", "--output-root", "/tmp/x", "--address", "http://127.0.0.1:{port}", "eval"], "cannot reach the Ray job server"),
    (["submit", "--output-root", "relative/dir", "--address", "http://127.0.0.1:{port}", "eval"], "must be an absolute path or a URI"),
    (["submit", "--address", "http://127.0.0.1:{port}", "eval"], "--output-root: not set"),
    (["jobs", "list", "--address", "http://127.0.0.1:{port}"], "cannot reach the Ray job server"),
])  # fmt: skip
def test_bad_submissions_are_one_line_exit_2(argv, message, monkeypatch, capsys):
    monkeypatch.delenv(OUTPUT_ROOT_ENV, raising=False)
    port = _free_port()  # nothing listens there
    rc = main([a.format(port=port) for a in argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and message in err, err


@pytest.fixture
def ray_head(tmp_path):
    """`ray start --head --block` on 127.0.0.1 in its own process group; killed (group) afterwards."""
    port, dash = _free_port(), _free_port()
    # The suite's own Ray instance may hold the default agent ports: this head takes free ones, or its
    # job agent never starts and every submission is refused ("No available agent").
    agent_ports = [f"--{flag}={_free_port()}" for flag in (
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port",
        "ray-client-server-port")]  # fmt: skip
    temp = Path(f"/tmp/drelay-ray-{os.getpid()}-{port}")  # short: Ray's socket paths have a length limit
    # Drain time 0: on SIGTERM the head stops its processes at once instead of first waiting up to 30 s
    # for a node drain that only Serve proxies use (none run here).
    env = {**os.environ, "PATH": f"{RAY.parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}  # fmt: skip
    cmd = [str(RAY), "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dash}", "--include-dashboard=true", "--num-cpus=2", f"--temp-dir={temp}", "--disable-usage-stats", *agent_ports]  # fmt: skip
    log = (tmp_path / "ray.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{address}/api/version", timeout=5)  # noqa: S310 - local head
                break
            except urllib.error.HTTPError:  # it answers (401 without the token: auth is on)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"ray head did not start: {(tmp_path / 'ray.log').read_text()[-2000:]}")
                time.sleep(1)
        yield address, temp
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _drelay_cli(*argv: str) -> subprocess.CompletedProcess:
    """`drelay ARGV` as a user runs it, in its own process: a test process may hold the suite's own
    Ray instance, and a client is never run inside a Ray driver."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    return subprocess.run([sys.executable, "-m", "cli", *argv], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip


@pytest.mark.slow
def test_submit_eval_to_a_real_ray_head(ray_head, tmp_path):
    address, temp = ray_head
    root = tmp_path / "shared"  # the job's MLflow store: <root>/mlflow.db
    argv = ["submit", "--address", address, "--output-root", str(root), "eval", "--target", "tiny-llama", "--random-drafter",
            "--limit", "1", "--max-new-tokens", "8", "--benchmarks", "gsm8k", "--no-progress", "--run-name", "submitted"]  # fmt: skip
    out = _drelay_cli(*argv)
    assert out.returncode == 0 and "SUCCEEDED" in out.stderr, out.stderr[-2000:]
    job_id = out.stdout.splitlines()[0]
    assert (root / "eval" / "submitted" / "config.json").is_file() and (root / "mlflow.db").is_file()
    unpacked = list(temp.glob("session_*/runtime_resources/working_dir_files/*/"))
    assert unpacked and not any((d / "outputs").exists() for d in unpacked)  # nothing written into the job's copy
    listed = _drelay_cli("jobs", "list", "--address", address)
    assert listed.returncode == 0 and job_id in listed.stdout, listed.stderr[-2000:]
    logs = _drelay_cli("jobs", "logs", job_id, "--address", address)
    assert logs.returncode == 0 and "Outputs:" in logs.stdout, logs.stderr[-2000:]

    from pipelines.common.tracking import get_client

    client = get_client(f"sqlite:///{root / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("drelay-eval").experiment_id], "attributes.run_name = 'submitted'")
    tags = runs[0].data.tags
    assert runs[0].info.status == "FINISHED" and all(tags.get(k) for k in REQUIRED), tags
    assert tags["drelay.kind"] == "eval" and tags["drelay.target"] == "tiny-llama" and tags["drelay.method"] == "ar,native"
