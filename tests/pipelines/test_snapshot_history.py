"""A snapshot carried in git history (pipelines/train/snapshot_history.py, `drelay snapshot`): carry
leaves HEAD's tree as it was and history holding the weights; a fresh clone gets them back, bit for
bit, by itself when training starts; another run's snapshot is never restored; bad calls are one line."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from cli.main import main
from drelay_model.drafter import BlockDrafter, DrafterConfig
from drelay_model.target import tiny_target
from drelay_model.training.step import DraftTrainModule
from pipelines.train.snapshot import has_snapshot, save_snapshot
from pipelines.train.snapshot_history import carried, restore

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo, *args) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "--quiet", "-b", "main")
    _git(root, "config", "user.email", "t@example.com")
    _git(root, "config", "user.name", "t")
    (root / ".gitignore").write_text("/checkpoints/training/\n")
    (root / "README.md").write_text("x\n")
    _git(root, "add", ".")
    _git(root, "commit", "--quiet", "-m", "start")
    return root


def _snapshot(path, *, step: int, run_name: str = "long") -> None:
    torch.manual_seed(step)
    target = tiny_target("tiny-llama")
    module = DraftTrainModule(BlockDrafter(DrafterConfig.for_target(target, num_layers=1, top_k=8), target), None)
    save_snapshot(path, module, step=step, train_seconds=60.0 * step, run_name=run_name, selector=None)


def _files(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_carry_keeps_the_tree_and_a_fresh_clone_restores_the_newest_snapshot(repo, tmp_path, capsys):
    snap = repo / "checkpoints/training/long"
    _snapshot(snap, step=40)
    assert main(["snapshot", "carry", str(snap)]) == 0
    assert "out of the tree again" in capsys.readouterr().out
    _snapshot(snap, step=80)  # the next stop's snapshot, carried again
    newest = _files(snap)
    assert main(["snapshot", "carry", str(snap)]) == 0
    assert _git(repo, "ls-tree", "-r", "--name-only", "HEAD") == ".gitignore\nREADME.md"  # HEAD's tree as it was
    assert _git(repo, "status", "--porcelain") == "" and has_snapshot(snap)  # the files stay on disk, ignored
    assert len(_git(repo, "log", "--format=%H").split()) == 5

    clone = tmp_path / "clone"
    _git(tmp_path, "clone", "--quiet", str(repo), str(clone))
    fresh = clone / "checkpoints/training/long"
    assert not fresh.exists() and carried(fresh, run_name="other") is None
    commit, meta = restore(fresh, run_name="long")
    assert meta["step"] == 80 and _files(fresh) == newest  # the newest carry, bit for bit
    assert _git(clone, "status", "--porcelain") == ""  # the working tree only, never the index
    assert restore(fresh, run_name="long") is None  # a snapshot on disk is never overwritten
    assert main(["snapshot", "restore", str(fresh)]) == 0 and "already holds" in capsys.readouterr().out


def test_training_restores_its_own_runs_snapshot_before_ray_starts(repo, tmp_path, capsys):
    from pipelines.train.driver import restore_carried

    snap = repo / "checkpoints/training/long"
    _snapshot(snap, step=12)
    assert main(["snapshot", "carry", str(snap)]) == 0
    shutil.rmtree(snap)
    restore_carried(snap, run_name="another-run")  # another run's carried snapshot stays in history
    assert not snap.exists()
    from pipelines.train.config import load_config
    from pipelines.train.resume import resume_point

    def config(run_name: str):
        over = {
            "ray.run_name": run_name,
            "ray.storage_path": tmp_path / "ray",
            "train.snapshot_dir": snap,
            "train.max_minutes": 60,
        }
        return load_config(None, [f"{k}={v}" for k, v in over.items()])

    point = resume_point(config("long"))  # where the run would continue, before it restores anything
    assert (
        point.describe(config("long"))
        == f"continues from the snapshot carried in {point.source[-10:]} at step 12 (12.0 of 60 wall min)"
    )
    assert _git(repo, "rev-parse", "HEAD~1").startswith(point.source[-10:]) and not snap.exists()
    assert resume_point(config("another-run")) is None
    restore_carried(snap, run_name="long")
    assert has_snapshot(snap) and "restored run long's snapshot at step 12" in capsys.readouterr().err
    assert resume_point(config("long")).describe(config("long")) == "continues from its snapshot at step 12 (12.0 of 60 wall min)"


def test_bad_calls_are_one_line_errors_and_commit_nothing(repo, tmp_path, capsys):
    snap = repo / "checkpoints/training/long"
    outside = tmp_path / "outside"
    _snapshot(outside, step=3)
    (repo / "staged.txt").write_text("y\n")
    _git(repo, "add", "staged.txt")
    _snapshot(snap, step=3)
    cases = (
        (["snapshot", "carry", str(repo / "checkpoints/training/none")], "holds no snapshot"),
        (["snapshot", "carry", str(outside)], "is not inside a git work tree"),
        (["snapshot", "carry", str(snap)], "the git index has staged changes"),
        (["snapshot", "restore", str(repo / "checkpoints/training/none")], "no commit in this repository's history"),
    )
    for args, message in cases:
        assert main(args) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert len(_git(repo, "log", "--format=%H").split()) == 1
    _git(repo, "reset", "--quiet", "--", "staged.txt")
    _git(repo, "config", "core.hooksPath", str(tmp_path / "hooks"))  # a commit refused by a hook
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks/pre-commit").write_text("#!/bin/sh\necho refused >&2\nexit 1\n")
    (tmp_path / "hooks/pre-commit").chmod(0o755)
    assert main(["snapshot", "carry", str(snap)]) == 2
    err = capsys.readouterr().err
    assert "nothing committed: refused" in err and len(err.strip().splitlines()) == 1
    assert _git(repo, "diff", "--cached", "--name-only") == ""  # the index as it was
