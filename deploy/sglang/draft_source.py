"""Where an SGLang server's draft comes from: a `drelay export --format sglang` directory as given,
or a drafter checkpoint — a local folder or an MLflow registry reference `models:/<name>@<alias>` /
`models:/<name>/<version>` — exported to SGLang's format on first use and cached.

Cache: `<output root>/cache/sglang/<name>/<version>-<dtype>-ctx<N>` for a registered version (the
version is immutable, so an export is made once per version, dtype and context length); a local
checkpoint folder is keyed by its path and its weights file's size and mtime. Exports are atomic
(export.py), so replicas starting together on one node at worst export twice, never half.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from deploy.sglang.export import export_sglang
from deploy.sglang.model import ARCHITECTURE, CONFIG
from drelay_model.errors import DRelayError


def is_export(path: Path) -> bool:
    """A directory holding a DRELAY draft export (config.json naming DRelayDraftModel)."""
    try:
        doc = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return ARCHITECTURE in (doc.get("architectures") or [])


def _cache_dir(name: str) -> Path:
    from pipelines.common.outputs import join, local_dir, output_root

    return local_dir(join(output_root(), "cache", "sglang", name), "SGLang draft cache")


def _export_once(checkpoint: str, dest: Path, *, context_length: int, dtype: str) -> Path:
    if not is_export(dest):
        try:
            export_sglang(checkpoint, dest, context_length=context_length, dtype=dtype)
        except DRelayError:
            if not is_export(dest):  # another replica may have finished the same export first
                raise
    return dest


def resolve_draft(ref: str, *, context_length: int, dtype: str = "bfloat16") -> Path:
    """The export directory SGLang loads for `ref` (see the module docstring). An export must carry
    at least `context_length` (the served target's); errors are one line naming the field."""
    if ref.startswith("models:/"):
        from pipelines.common.registry import resolve_checkpoint

        local = Path(resolve_checkpoint(ref))  # <output root>/cache/models/<name>/<version>
        dest = _cache_dir(local.parent.name) / f"{local.name}-{dtype}-ctx{context_length}"
        return _export_once(str(local), dest, context_length=context_length, dtype=dtype)
    path = Path(ref).expanduser()
    if is_export(path):
        have = json.loads((path / CONFIG).read_text()).get("max_position_embeddings")
        if not have or int(have) < context_length:
            raise DRelayError(
                f"sglang.draft_model_path: the export '{path}' carries context length {have}, below the target's "
                f"{context_length}; re-export with --context-length {context_length} (or give the checkpoint)"
            )
        return path
    weights = path / "drafter.safetensors"
    if not weights.is_file():
        raise DRelayError(
            f"sglang.draft_model_path: '{ref}' is neither an SGLang export, a drafter checkpoint nor models:/<name>@<alias>"
        )
    stat = weights.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    dest = _cache_dir("local") / f"{path.name}-{key}-{dtype}-ctx{context_length}"
    return _export_once(str(path), dest, context_length=context_length, dtype=dtype)
