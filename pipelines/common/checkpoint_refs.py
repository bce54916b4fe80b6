"""What a checkpoint reference names on this machine: a folder, a registry version, or a folder at a commit.

    checkpoints/smollm2-135m                  a folder, as it is now
    models:/drelay-smollm2-135m@champion      a version in the MLflow model registry (registry.py)
    checkpoints/smollm2-135m@0123abcd         the folder as commit 0123abcd of this repository holds it

A pinned folder (`FOLDER@COMMIT`, 7–40 hex digits) keeps a figure reproducible after the folder
changes: the bundled drafter is replaced in place, and a result measured on the one before names it
this way. It is written once, atomically, to `<output root>/cache/git/<full commit>/<folder>` from
`git archive` and read from there after that. `resolve_ref` is the one place these forms are told
apart; a plain path comes back unchanged, so callers keep their own rules for relative paths. An
existing folder whose name happens to end in `@<hex>` is that folder, not a pin.
"""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path

from drelay_model.errors import DRelayError
from pipelines.common.git import git, said
from pipelines.common.outputs import REPO_ROOT, join, local_dir, output_root, rooted
from pipelines.common.registry import is_model_ref, resolve_checkpoint

_PIN = re.compile(r"^(?P<folder>.+)@(?P<commit>[0-9a-fA-F]{7,40})$")
CONFIG = "drafter_config.json"  # what makes a folder a drafter checkpoint (drelay_model/drafter/checkpoint.py)


def pinned(ref: str) -> tuple[str, str] | None:
    """(folder, commit) of a `FOLDER@COMMIT` reference, else None (also for an existing folder so named)."""
    m = _PIN.match(ref)
    if m is None or Path(ref).expanduser().exists():
        return None
    return m["folder"], m["commit"]


def resolve_ref(ref: str) -> str:
    """A local folder for `ref`: a registry version downloaded, a pinned folder written out, else `ref`."""
    if is_model_ref(ref):
        return resolve_checkpoint(ref)
    pin = pinned(ref)
    return ref if pin is None else str(folder_at_commit(*pin, ref=ref))


def rooted_local(cfg):
    """`rooted(cfg)` whose `drafter.init_checkpoint` is first made a folder on this machine (pins and
    registry versions resolved): what a run reads its paths from."""
    ref = cfg.drafter.init_checkpoint
    local = ref if ref is None else resolve_ref(ref)
    if local != ref:
        cfg = cfg.model_copy(update={"drafter": cfg.drafter.model_copy(update={"init_checkpoint": local})})
    return rooted(cfg)


def folder_at_commit(folder: str, commit: str, *, ref: str) -> Path:
    """`folder` (relative to the repository, or absolute inside it) as `commit` holds it, on disk."""
    path = Path(folder).expanduser()
    try:
        rel = path.resolve().relative_to(REPO_ROOT.resolve()) if path.is_absolute() else path
    except ValueError:
        raise DRelayError(f"checkpoint '{ref}': {folder} is outside the repository at {REPO_ROOT}") from None
    rel_posix = rel.as_posix().strip("/")
    cache = local_dir(join(output_root(), "cache", "git"), "pinned checkpoint cache")
    hits = [d / rel_posix for d in (cache.iterdir() if cache.is_dir() else ()) if d.name.startswith(commit.lower())]
    if len(hits) == 1 and (hits[0] / CONFIG).is_file():  # written before: no git needed
        return hits[0]
    try:
        found = git(REPO_ROOT, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    except OSError as exc:  # no git on this machine
        raise DRelayError(f"checkpoint '{ref}': a pinned checkpoint needs git ({exc.strerror})") from None
    if found.returncode != 0:
        raise DRelayError(
            f"checkpoint '{ref}': no commit {commit} in the repository at {REPO_ROOT} (a shallow clone lacks history)"
        )
    full = found.stdout.decode().strip()
    dest = cache / full / rel_posix
    listed = git(REPO_ROOT, "ls-tree", "-r", "--name-only", full, "--", rel_posix)
    if listed.returncode != 0 or f"{rel_posix}/{CONFIG}" not in listed.stdout.decode().splitlines():
        raise DRelayError(f"checkpoint '{ref}': commit {full[:10]} holds no drafter checkpoint at {rel_posix}")
    archive = git(REPO_ROOT, "archive", "--format=tar", full, "--", rel_posix)
    if archive.returncode != 0:
        raise DRelayError(f"checkpoint '{ref}': git archive failed ({said(archive)})")
    from drelay_model.atomic import atomic_directory

    with atomic_directory(dest) as tmp, tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            out = tmp / Path(member.name).relative_to(rel_posix)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(tar.extractfile(member).read())
    return dest
