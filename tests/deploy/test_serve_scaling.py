"""Production behaviour on a real Ray Serve instance (slow): autoscaling 1 → 2 → 1 under sustained
load, and a replica killed by pid mid-load (every request completes or gets a clean error, and the
deployment recovers)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import socket
import threading
import time

import pytest
import requests

from deploy.serve.config import parse_config

MODEL = "tiny-scale"
CONFIG = {
    "model_id": MODEL,
    "engine": {"target": "tiny-llama:vocab=49152", "tokenizer": "smollm2-135m", "method": "ar", "max_batch": 4},
    "limits": {"max_tokens": 400, "max_waiting": 64},
    "autoscaling": {
        "min_replicas": 1,
        "max_replicas": 2,
        "target_ongoing_requests": 1,
        "upscale_delay_s": 2,
        "downscale_delay_s": 8,
    },
    "max_ongoing_requests": 64,
    "num_cpus": 0.5,
    "graceful_shutdown_timeout_s": 5,
}


def _running_replicas(app: str) -> int:
    from ray import serve

    states = serve.status().applications[app].deployments["drelay"].replica_states
    return int(states.get("RUNNING", 0))


def _post(url: str, i: int, max_tokens: int = 300) -> int:
    body = {"model": MODEL, "prompt": f"load {i}", "max_tokens": max_tokens, "temperature": 0}
    try:
        r = requests.post(f"{url}/v1/completions", json=body, timeout=300)
    except requests.RequestException:
        return 599  # connection dropped: not clean, the test fails on it
    if r.status_code == 200:
        assert r.json()["usage"]["completion_tokens"] == max_tokens
    else:
        assert "error" in r.json() or r.text  # an error answer, not a hang
    return r.status_code


def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(1)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def server(ray_session):
    from ray import serve

    from deploy.serve.commands import start

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = start(parse_config({**CONFIG, "port": port}), name="drelay-scale")
    _until(lambda: _ready(url), 300, "the app to be ready")
    yield url
    serve.shutdown()


def _ready(url: str) -> bool:
    try:
        return requests.get(f"{url}/ready", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def _load(url: str, stop: threading.Event, codes: list[int], clients: int = 6) -> cf.ThreadPoolExecutor:
    def loop(k: int) -> None:
        i = 0
        while not stop.is_set():
            codes.append(_post(url, k * 10_000 + i))
            i += 1

    pool = cf.ThreadPoolExecutor(clients)
    for k in range(clients):
        pool.submit(loop, k)
    return pool


@pytest.mark.slow
@pytest.mark.heavy
def test_autoscales_to_two_replicas_and_back(server):
    stop, codes = threading.Event(), []
    pool = _load(server, stop, codes)
    try:
        _until(lambda: _running_replicas("drelay-scale") == 2, 180, "a second replica under load")
    finally:
        stop.set()
        pool.shutdown(wait=True)
    assert codes and set(codes) == {200}, codes
    _until(lambda: _running_replicas("drelay-scale") == 1, 180, "scale-down to one replica when idle")


@pytest.mark.slow
@pytest.mark.heavy
def test_replica_killed_mid_load_recovers(server):
    stop, codes = threading.Event(), []
    pool = _load(server, stop, codes, clients=4)
    try:
        time.sleep(3)
        pid = requests.get(f"{server}/health", timeout=10).json()["pid"]
        os.kill(pid, signal.SIGKILL)
        time.sleep(5)
    finally:
        stop.set()
        pool.shutdown(wait=True)
    assert 599 not in codes and set(codes) <= {200, 500, 502, 503}, codes
    _until(
        lambda: _ready(server) and requests.get(f"{server}/health", timeout=10).json()["pid"] != pid,
        180,
        "a healthy replica after the kill",
    )
    with cf.ThreadPoolExecutor(4) as p:
        assert list(p.map(lambda i: _post(server, i, 20), range(8))) == [200] * 8
