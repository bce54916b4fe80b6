"""Drafter checkpoints: a directory with `drafter.safetensors` (trainable weights and the draft-vocab
mapping, never the target's frozen embedding/head) and `drafter_config.json`.

Saving is atomic (write into a temp dir, then rename), so an interrupted save never leaves a
half-written checkpoint. Loading validates everything a user can get wrong and raises a one-line
`DRelayError`: missing files, corrupted JSON or tensors, a config for another target, wrong shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from drelay_model.atomic import atomic_directory
from drelay_model.drafter.config import DrafterConfig
from drelay_model.drafter.model import BlockDrafter
from drelay_model.errors import DRelayError

WEIGHTS = "drafter.safetensors"
CONFIG = "drafter_config.json"


def save_drafter(
    drafter: BlockDrafter,
    path: str | Path,
    *,
    extra_tensors: dict | None = None,
    meta: dict | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `drafter` (and optionally a selector's tensors under a prefix) to directory `path`;
    `dtype` stores the floating-point tensors in that precision (loading casts them back to the
    drafter's: `load_state_dict` copies into its float32 parameters)."""
    from safetensors.torch import save_file

    def stored(v: torch.Tensor) -> torch.Tensor:
        v = v.detach().contiguous().cpu()
        return v.to(dtype) if dtype is not None and v.is_floating_point() else v

    path = Path(path)
    with atomic_directory(path) as tmp:
        tensors = {k: stored(v) for k, v in drafter.state_dict().items()}
        tensors.update({k: stored(v) for k, v in (extra_tensors or {}).items()})
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        doc = {"drafter": drafter.config.to_dict(), "meta": meta or {}}
        (tmp / CONFIG).write_text(json.dumps(doc, indent=2))
    return path


def read_checkpoint(path: str | Path) -> tuple[DrafterConfig, dict[str, torch.Tensor], dict]:
    """Read and validate a checkpoint directory → (config, tensors, meta)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_dir():
        raise DRelayError(f"checkpoint '{path}' not found (expected a directory with {WEIGHTS} and {CONFIG})")
    for name in (WEIGHTS, CONFIG):
        if not (path / name).is_file():
            raise DRelayError(f"checkpoint '{path}' is missing {name}")
    try:
        doc = json.loads((path / CONFIG).read_text())
        config = DrafterConfig.from_dict(doc["drafter"])
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DRelayError(f"checkpoint '{path}': {CONFIG} is corrupted ({type(exc).__name__}: {exc})") from exc
    try:
        tensors = load_file(str(path / WEIGHTS))
    except (SafetensorError, OSError, ValueError) as exc:
        raise DRelayError(f"checkpoint '{path}': {WEIGHTS} is corrupted ({exc})") from exc
    return config, tensors, doc.get("meta", {})


def load_drafter(path: str | Path, target) -> tuple[BlockDrafter, dict[str, torch.Tensor], dict]:
    """Load a drafter bound to `target`. Returns (drafter, remaining tensors, meta); the remaining
    tensors are whatever the checkpoint holds beyond the drafter (e.g. a trained selector)."""
    config, tensors, meta = read_checkpoint(path)
    config.check_target(target)
    drafter = BlockDrafter(config, target, draft_to_target=tensors.get("draft_to_target"))
    own = drafter.state_dict()
    mine = {k: v for k, v in tensors.items() if k in own}
    missing = sorted(set(own) - set(mine))
    if missing:
        raise DRelayError(f"checkpoint '{path}' is missing drafter tensors: {', '.join(missing[:5])}")
    for name, value in mine.items():
        if value.shape != own[name].shape:
            raise DRelayError(
                f"checkpoint '{path}': tensor '{name}' has shape {tuple(value.shape)}, "
                f"the drafter expects {tuple(own[name].shape)}"
            )
    drafter.load_state_dict(mine)
    rest = {k: v for k, v in tensors.items() if k not in own}
    return drafter.eval(), rest, meta
