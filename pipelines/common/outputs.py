"""Where the platform writes: one output root for outputs, caches, Ray storage, the MLflow store and
shipped checkpoints.

    output root = RunConfig.output_root (a config field)  >  $DRELAY_OUTPUT_ROOT  >  <repo>/outputs

A relative path whose first component is `outputs` (`outputs/train`, `outputs/ray`, the defaults of
every config) is re-anchored under the output root; other relative paths stay relative to the
repository (configs, data, bundled checkpoints); absolute paths and URIs (`s3://…`, `gs://…`) pass
through untouched. With no root configured everything lands in the checkout's `outputs/`.
A submitted Ray job gets `$DRELAY_OUTPUT_ROOT` from `drelay submit`, so it writes to shared storage,
never into the temporary working directory Ray unpacks it into.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from drelay_model.errors import DRelayError

OUTPUT_ROOT_ENV = "DRELAY_OUTPUT_ROOT"
REPO_ROOT = Path(__file__).resolve().parents[2]
OUTPUTS = "outputs"  # the first component of every output path in configs and defaults
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_uri(path: str | Path) -> bool:
    """True for `scheme://…` (s3, gs, hdfs, file, …): never rewritten, never made repo-relative."""
    return isinstance(path, str) and bool(_URI.match(path))


def output_root(configured: str | None = None) -> Path | str:
    """The output root: `configured`, else `$DRELAY_OUTPUT_ROOT`, else `<repo>/outputs`.
    A URI comes back as a string; a relative root is relative to the repository."""
    root = configured or os.environ.get(OUTPUT_ROOT_ENV) or ""
    if not root.strip():
        return REPO_ROOT / OUTPUTS
    if is_uri(root):
        return root.rstrip("/")
    p = Path(root).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def root_is_configured(configured: str | None = None) -> bool:
    return bool(configured or os.environ.get(OUTPUT_ROOT_ENV, "").strip())


def resolve_path(path: str | Path, *, root: str | None = None) -> Path | str:
    """A config/CLI path as an absolute path or an untouched URI (see the module docstring)."""
    if is_uri(path):
        return str(path)
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    if p.parts and p.parts[0] == OUTPUTS:
        return join(output_root(root), *p.parts[1:])
    return REPO_ROOT / p


def join(base: Path | str, *parts: str) -> Path | str:
    """`base / parts…` for a path or a URI."""
    if isinstance(base, str) and is_uri(base):
        return "/".join([base.rstrip("/"), *parts])
    return Path(base).joinpath(*parts)


def local_dir(path: Path | str, field: str) -> Path:
    """`path` as a filesystem folder; a URI is refused (files written here need a mounted volume)."""
    if isinstance(path, str) and is_uri(path):
        raise DRelayError(f"{field}: '{path}' is a URI; this output needs a filesystem path (mount the shared storage)")
    return Path(path)


def ensure_writable_dir(path: Path | str, field: str, *, create: bool = True) -> Path | str:
    """Check folder `path` can be written (URIs are left to their filesystem) and create it unless
    `create=False`. Raises a one-line `DRelayError` naming `field` and then has created nothing:
    the check runs on the nearest existing ancestor before any folder is made."""
    if isinstance(path, str) and is_uri(path):
        return path
    folder = Path(path).absolute()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise DRelayError(f"{field}: cannot create '{folder}' ('{existing}' is not a folder)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise DRelayError(f"{field}: '{folder}' is not writable ('{existing}' is read-only for this user)")
    if create:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DRelayError(f"{field}: cannot create '{folder}' ({exc.strerror})") from exc
    return folder


def shipped_checkpoints_dir() -> Path | None:
    """Where `drelay study` ships drafters when an output root is configured (`<root>/checkpoints`,
    shared storage); None otherwise (then: the repository's bundled `checkpoints/`)."""
    if root_is_configured():
        return local_dir(join(output_root(), "checkpoints"), OUTPUT_ROOT_ENV)
    return None


def rooted(cfg):
    """A RunConfig whose paths are absolute, so workers on any node and every later step see the same
    locations: the output paths (output_dir, ray.storage_path, data.feature_cache_dir, an
    `outputs/…` init_checkpoint) under its output root, a repository-relative init_checkpoint and
    data.regenerated (a file or a glob) under the repository."""
    root = cfg.output_root

    def fix(value: str | None) -> str | None:
        return None if value is None else str(resolve_path(value, root=root))

    return cfg.model_copy(update={
        "output_dir": fix(cfg.output_dir),
        "ray": cfg.ray.model_copy(update={"storage_path": fix(cfg.ray.storage_path)}),
        "data": cfg.data.model_copy(update={"feature_cache_dir": fix(cfg.data.feature_cache_dir),
                                            "regenerated": fix(cfg.data.regenerated)}),
        "drafter": cfg.drafter.model_copy(update={"init_checkpoint": fix(cfg.drafter.init_checkpoint)}),
    })  # fmt: skip
