"""A long run's snapshot carried to a fresh machine by git history, not by the tree.

The tracked tree stays under 60 MiB (the GPU machine copies at most 64 MiB of the checkout), and a
long run's snapshot (the drafter and its head in bfloat16, ~22 MB for the CPU default) does not fit
beside the bundled float32 checkpoint. So a snapshot travels in two commits:

    carry:    commit A adds the snapshot folder (forced past .gitignore);
              commit B takes it out of the index again; the files stay on disk, ignored.
              HEAD's tree is what it was, and A holds the weights.
    restore:  on a fresh clone, the newest commit whose tree holds DIR/drafter_config.json of the same
              run is read back into the working tree (never the index), the config file last, so a
              stop mid-restore leaves no half snapshot that `has_snapshot` would accept.

A training run whose `train.snapshot_dir` is empty restores it by itself before Ray starts
(`pipelines/train/driver.py`), so the same command continues on a fresh machine. Each carry adds the
snapshot's bytes to the repository's history: carry once per stop, not per checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from drelay_model.drafter.checkpoint import CONFIG, read_checkpoint
from drelay_model.errors import DRelayError
from pipelines.common.git import git, said
from pipelines.train.snapshot import has_snapshot, is_snapshot_of


def work_tree(path: Path) -> Path | None:
    """The git work tree that holds `path` (which may not exist yet), or None outside one or without git."""
    probe = path
    while not probe.is_dir():
        probe = probe.parent
    if shutil.which("git") is None:
        return None
    found = git(probe, "rev-parse", "--show-toplevel")
    return Path(found.stdout.decode().strip()) if found.returncode == 0 else None


def _carried_meta(repo: Path, commit: str, rel: str) -> dict | None:
    shown = git(repo, "show", f"{commit}:{rel}/{CONFIG}")
    if shown.returncode != 0:
        return None
    try:
        return json.loads(shown.stdout).get("meta") or {}
    except (ValueError, AttributeError):
        return None


def _locate(path: Path) -> tuple[Path, str] | None:
    """(the work tree holding `path`, `path` relative to it in git's spelling), or None outside one."""
    repo = work_tree(path)
    return None if repo is None else (repo, path.relative_to(repo).as_posix())


def carried(path: Path, *, run_name: str | None = None) -> tuple[str, dict] | None:
    """The newest commit whose tree holds a snapshot in `path` (of `run_name`, when given) → (commit, its meta)."""
    located = _locate(path.resolve())
    return None if located is None else _newest(*located, run_name)


def _newest(repo: Path, rel: str, run_name: str | None) -> tuple[str, dict] | None:
    log = git(repo, "log", "--format=%H", "--", f"{rel}/{CONFIG}")
    for commit in log.stdout.decode().split() if log.returncode == 0 else []:
        meta = _carried_meta(repo, commit, rel)
        if meta is not None and is_snapshot_of(meta, run_name):
            return commit, meta
    return None


def restore(path: Path, *, run_name: str | None = None) -> tuple[str, dict] | None:
    """Write the newest carried snapshot into `path` when it holds none → (commit, meta), else None."""
    path = path.resolve()
    located = None if has_snapshot(path) else _locate(path)
    found = None if located is None else _newest(*located, run_name)
    if found is None:
        return None
    (repo, rel), (commit, meta) = located, found
    listed = git(repo, "ls-tree", "-r", "--name-only", commit, "--", f"{rel}/")
    names = sorted(listed.stdout.decode().split("\n"), key=lambda n: n.endswith(f"/{CONFIG}"))  # the config last
    for name in filter(None, names):
        blob = git(repo, "show", f"{commit}:{name}")
        if blob.returncode != 0:
            raise DRelayError(f"train.snapshot_dir: cannot read {name} from commit {commit[:12]}: {said(blob)}")
        dest = repo / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".restoring")
        tmp.write_bytes(blob.stdout)
        tmp.replace(dest)
    return commit, meta


def carry(path: Path) -> tuple[str, str]:
    """Commit the snapshot in `path`, then take it out of the tree again → (the commit holding it, HEAD).
    Needs an index with nothing else staged, so that neither commit takes anything but the snapshot."""
    path = path.resolve()
    if not has_snapshot(path):
        raise DRelayError(f"snapshot carry: '{path}' holds no snapshot ({CONFIG} missing)")
    meta = read_checkpoint(path)[2]
    if not meta.get("snapshot"):
        raise DRelayError(f"snapshot carry: '{path}' is a drafter checkpoint, not a training snapshot")
    located = _locate(path)
    if located is None:
        raise DRelayError(f"snapshot carry: '{path}' is not inside a git work tree")
    repo, rel = located
    if git(repo, "diff", "--cached", "--quiet").returncode != 0:
        raise DRelayError("snapshot carry: the git index has staged changes; commit or unstage them first")
    what = f"run {meta.get('run_name')} at step {meta.get('step')}"
    steps = (
        ("add", "--force", "--", rel),
        ("commit", "--quiet", "-m", f"Training snapshot of {what}"),
        ("rm", "-r", "--cached", "--quiet", "--", rel),
        ("commit", "--quiet", "-m", f"Training snapshot of {what}: out of the tree, kept in history"),
    )
    for i, step in enumerate(steps):
        done = git(repo, *step)
        if done.returncode == 0:
            continue
        if i < 2:  # nothing committed yet: leave the index as it was
            git(repo, "reset", "--quiet", "--", rel)
            raise DRelayError(f"snapshot carry: git {step[0]} failed, nothing committed: {said(done)}")
        raise DRelayError(f"snapshot carry: git {step[0]} failed with the snapshot committed in HEAD; take it out of the"
                          f" tree with `git rm -r --cached {rel} && git commit`: {said(done)}")  # fmt: skip
    head = git(repo, "rev-parse", "HEAD").stdout.decode().strip()
    holder = git(repo, "rev-parse", "HEAD~1").stdout.decode().strip()
    return holder, head
