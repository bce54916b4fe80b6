"""Shared fixtures for the pipeline tests: a throw-away MLflow SQLite store per test."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipelines.tracking import get_client


@pytest.fixture(scope="session")
def empty_db(tmp_path_factory) -> Path:
    """An initialised empty store, built once (table creation takes seconds) and copied per test."""
    db = tmp_path_factory.mktemp("template") / "mlflow.db"
    get_client(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def uri(empty_db, tmp_path, monkeypatch) -> str:
    """A fresh store for this test, made the default through MLFLOW_TRACKING_URI."""
    shutil.copy(empty_db, tmp_path / "mlflow.db")
    value = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", value)
    return value
