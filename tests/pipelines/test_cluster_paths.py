"""Where the platform writes: the output root (config field > $DRELAY_OUTPUT_ROOT > <repo>/outputs),
URIs passed through untouched, and an unwritable root refused in one line with nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from drelay_model.errors import DRelayError
from cli import main
from pipelines.common import outputs as paths
from pipelines.common.outputs import OUTPUT_ROOT_ENV, REPO_ROOT, ensure_writable_dir, output_root, resolve_path, rooted
from pipelines.train.config import RunConfig
from pipelines.train.driver import repo_path


def test_default_is_the_checkout_and_the_env_var_moves_only_outputs(monkeypatch, tmp_path):
    monkeypatch.delenv(OUTPUT_ROOT_ENV, raising=False)
    assert output_root() == REPO_ROOT / "outputs"
    assert repo_path("outputs/ray") == REPO_ROOT / "outputs" / "ray"
    monkeypatch.setenv(OUTPUT_ROOT_ENV, str(tmp_path / "shared"))
    assert repo_path("outputs/ray") == tmp_path / "shared" / "ray"
    assert repo_path("outputs") == tmp_path / "shared"
    assert repo_path("data/regenerated/x.jsonl") == REPO_ROOT / "data/regenerated/x.jsonl"  # inputs stay in the repo
    assert repo_path("/abs/elsewhere") == Path("/abs/elsewhere")
    assert output_root("relative/root") == REPO_ROOT / "relative/root"  # a config field beats the env var


@pytest.mark.parametrize("uri", ["s3://bucket/team/ray", "gs://bucket/x", "hdfs://nn:8020/y"])
def test_uris_pass_through_untouched(uri, monkeypatch):
    monkeypatch.delenv(OUTPUT_ROOT_ENV, raising=False)
    assert repo_path(uri) == uri  # was REPO_ROOT / "s3:/bucket/…"
    monkeypatch.setenv(OUTPUT_ROOT_ENV, uri)
    assert resolve_path("outputs/train/run") == f"{uri}/train/run"


def test_rooted_config_anchors_every_output_path(monkeypatch, tmp_path):
    monkeypatch.setenv(OUTPUT_ROOT_ENV, "/ignored/because/the/field/wins")
    cfg = rooted(RunConfig.model_validate({"output_root": str(tmp_path), "ray": {"storage_path": "s3://b/ray"},
                                           "drafter": {"init_checkpoint": "outputs/train/a/drafter"}}))  # fmt: skip
    assert cfg.output_dir == str(tmp_path / "train")
    assert cfg.ray.storage_path == "s3://b/ray"
    assert cfg.data.feature_cache_dir == str(tmp_path / "feature_cache")
    assert cfg.drafter.init_checkpoint == str(tmp_path / "train/a/drafter")


def test_unwritable_root_is_one_line_and_creates_nothing(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(DRelayError, match="^out: cannot create '.*' \\('.*a-file' is not a folder\\)$"):
        ensure_writable_dir(blocker / "sub" / "dir", "out")
    with pytest.raises(DRelayError, match="is a URI"):
        paths.local_dir("s3://b/x", "--out")


def test_eval_with_an_unwritable_output_root_exits_2_before_any_work(monkeypatch, tmp_path, capsys):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv(OUTPUT_ROOT_ENV, str(blocker / "root"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'never.db'}")
    rc = main(["eval", "--target", "tiny-llama", "--random-drafter", "--limit", "1", "--max-new-tokens", "4", "--run-name", "x"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--out" in err and "not a folder" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not-a-dir"]  # no MLflow store, no output folder
