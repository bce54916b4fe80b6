"""A checkpoint pinned to a commit (`FOLDER@COMMIT`, pipelines/common/checkpoint_refs.py): the folder as
that commit holds it, written once and read from the cache after; accepted wherever a checkpoint is
(`--checkpoint`, `--variant`, `drafter.init_checkpoint`); bad pins are one line and write nothing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from cli import main
from drelay_model.drafter import BlockDrafter, DrafterConfig, save_drafter
from pipelines.common import checkpoint_refs
from pipelines.common.checkpoint_refs import pinned, resolve_ref, rooted_local
from pipelines.common.methods import resolve_method
from pipelines.common.outputs import OUTPUT_ROOT_ENV
from pipelines.eval.compare import parse_variant
from pipelines.train.config import RunConfig

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def _files(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.fixture
def history(tiny, tmp_path, monkeypatch):
    """A repository whose checkpoints/tiny was replaced in place: (repo, first commit, its files)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "--quiet", "-b", "main")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    folder = repo / "checkpoints" / "tiny"
    commits, kept = [], None
    for seed in (0, 1):
        torch.manual_seed(seed)
        save_drafter(BlockDrafter(DrafterConfig.for_target(tiny), tiny), folder)
        kept = kept or _files(folder)
        _git(repo, "add", ".")
        _git(repo, "commit", "--quiet", "-m", f"drafter {seed}")
        commits.append(_git(repo, "rev-parse", "HEAD"))
    monkeypatch.setattr(checkpoint_refs, "REPO_ROOT", repo)
    monkeypatch.setenv(OUTPUT_ROOT_ENV, str(tmp_path / "root"))
    return repo, commits[0], kept


def test_a_pin_is_the_folder_as_its_commit_holds_it_cached_once(history, tmp_path):
    repo, first, kept = history
    assert _files(repo / "checkpoints/tiny") != kept  # replaced in place since
    local = resolve_ref(f"checkpoints/tiny@{first[:8]}")
    assert local == str(tmp_path / "root" / "cache" / "git" / first / "checkpoints/tiny")
    assert _files(tmp_path / "root/cache/git" / first / "checkpoints/tiny") == kept
    shutil.rmtree(repo / ".git")  # read from the cache from now on
    assert resolve_ref(f"{repo}/checkpoints/tiny@{first}") == local  # an absolute folder inside the repository too
    assert resolve_ref("checkpoints/tiny") == "checkpoints/tiny"  # a plain folder is left to its caller


def test_every_checkpoint_field_takes_a_pin(history, tmp_path):
    _, first, kept = history
    ref = f"checkpoints/tiny@{first[:10]}"
    spec = resolve_method("native", target_spec="tiny-llama", checkpoint=ref)
    assert _files(Path(spec.checkpoint)) == kept
    variant = parse_variant(f"old={ref}:native")
    assert variant.spec == spec
    cfg = rooted_local(RunConfig.model_validate({"output_root": str(tmp_path / "out"), "drafter": {"init_checkpoint": ref}}))
    assert cfg.drafter.init_checkpoint == spec.checkpoint


def test_an_existing_folder_named_like_a_pin_is_that_folder(tmp_path):
    folder = tmp_path / "drafter@abcdef1"
    folder.mkdir()
    assert pinned(str(folder)) is None and resolve_ref(str(folder)) == str(folder)
    assert pinned("checkpoints/x@abcdef1") == ("checkpoints/x", "abcdef1")
    assert pinned("checkpoints/x@v1") is None  # a commit is 7–40 hex digits


def test_bad_pins_are_one_line_and_write_nothing(history, tmp_path, capsys):
    repo, first, _ = history
    for ref, message in (
        ("checkpoints/tiny@deadbeef0", "no commit deadbeef0"),
        (f"checkpoints/none@{first[:8]}", "holds no drafter checkpoint at checkpoints/none"),
        (f"{tmp_path}/elsewhere@{first[:8]}", "outside the repository"),
    ):
        rc = main(["eval", "--target", "tiny-llama", "--methods", "ar,native", "--checkpoint", ref, "--limit", "1"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and message in err, err
        rc = main(["compare", "--target", "tiny-llama", "--variant", f"a={ref}:native", "--no-mlflow"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and "--variant a:" in err and message in err, err
    assert not (tmp_path / "root" / "cache").exists()
