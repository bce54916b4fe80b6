"""Tracking-server mode: a real `mlflow server` (SQLite backend, 127.0.0.1, started and stopped here)
and a Ray Train run whose rank-0 worker logs its metrics to it over HTTP; the trained drafter is
registered (alias `champion`) and resolved back through the server's artifact proxy."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
MLFLOW = Path(sys.executable).with_name("mlflow")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    port = _free_port()
    cmd = [str(MLFLOW), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}", "--artifacts-destination", (tmp_path / "art").as_uri()]  # fmt: skip
    log = (tmp_path / "mlflow.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5)  # noqa: S310 - local server
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"mlflow server did not start: {(tmp_path / 'mlflow.log').read_text()[-2000:]}")
                time.sleep(0.5)
        yield url
    finally:
        # SIGKILL to the whole group (the server's job consumers share it): a graceful stop waits
        # seconds on idle connections, and nothing the test reads is left unwritten (SQLite commits).
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)
        log.close()


def _tiny_data(path: Path) -> Path:
    from drelay_model.decoding import GenerationConfig, SpeculativeEngine
    from drelay_model.target import tiny_target

    target = tiny_target("tiny-llama")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.vocab_size, (8,), generator=g).tolist() for _ in range(16)]
    outs = SpeculativeEngine(target).generate(prompts, GenerationConfig(max_new_tokens=16)).tokens
    path.write_text("".join(json.dumps({"seq_id": f"s{i}", "input_ids": p + o, "response_start": 8}) + "\n"
                            for i, (p, o) in enumerate(zip(prompts, outs))))  # fmt: skip
    return path


def test_ray_train_logs_through_the_tracking_server(mlflow_server, ray_session, tmp_path, monkeypatch):
    from pipelines.common.registry import resolve_checkpoint
    from pipelines.train.config import load_config
    from pipelines.common.tracking import get_client
    from pipelines.train.driver import run_training

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("DRELAY_OUTPUT_ROOT", str(tmp_path / "root"))
    data = _tiny_data(tmp_path / "tiny.jsonl")
    over = {"target.spec": "tiny-llama", "data.regenerated": str(data), "data.validation_fraction": 0.1, "train.max_steps": 4,
            "train.checkpoint_every": 2, "train.validate_every": 4, "train.seqs_per_step": 2, "train.anchors_per_seq": 4,
            "train.validation_prompts": 1, "train.warmup_steps": 1, "ray.num_workers": 1, "ray.run_name": "http-run",
            "drafter.num_layers": 1, "drafter.top_k": 8, "mlflow.registered_model": "tiny-http"}  # fmt: skip
    cfg = load_config(None, [f"{k}={v}" for k, v in over.items()])
    result = run_training(cfg)

    assert str(result.checkpoint).startswith(str(tmp_path / "root" / "train"))  # the output root, not the repo
    client = get_client()
    assert client.tracking_uri == mlflow_server
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert {m.step for m in client.get_metric_history(run.info.run_id, "loss/support")} == {1, 2, 3, 4}  # from the worker
    tags = run.data.tags
    assert tags["drelay.kind"] == "train" and tags["drelay.target"] == "tiny-llama" and tags["drelay.method"] == "native"
    assert tags["drelay.hardware"].endswith("× 1 worker")  # set by rank 0, not the driver
    local = Path(resolve_checkpoint("models:/tiny-http@champion"))
    assert json.loads((local / "provenance.json").read_text())["mlflow_run_id"] == run.info.run_id
