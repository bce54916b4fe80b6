"""Turn user-facing names (target spec, method, checkpoint) into loaded model objects."""

from __future__ import annotations

from pathlib import Path

import torch

from drelay_model.drafter import BlockDrafter, DrafterConfig, load_drafter
from drelay_model.errors import DRelayError
from drelay_model.selectors import Selector, default_registry
from drelay_model.target import TargetModel, load_target

AR = "ar"
REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_CHECKPOINTS = REPO_ROOT / "checkpoints"


def bundled_checkpoint(target_spec: str) -> Path | None:
    """The checkpoint shipped in the repo for a target, if any (checkpoints/<target>/)."""
    path = BUNDLED_CHECKPOINTS / target_spec
    return path if path.is_dir() else None


def method_names() -> tuple[str, ...]:
    return (AR, *default_registry().names())


def load_method(
    method: str,
    target: TargetModel,
    *,
    target_spec: str,
    checkpoint: str | None,
    random_drafter: bool = False,
) -> tuple[BlockDrafter | None, Selector | None]:
    """(drafter, selector) for a method name; (None, None) for autoregressive decoding."""
    if method == AR:
        return None, None
    registry = default_registry()
    if method not in registry:
        raise DRelayError(f"unknown method '{method}' (choose from: {', '.join(method_names())})")
    if random_drafter:
        torch.manual_seed(0)
        drafter = BlockDrafter(DrafterConfig.for_target(target), target).eval()
        return drafter, registry.create(method, drafter=drafter).eval()
    path = checkpoint or bundled_checkpoint(target_spec)
    if path is None:
        raise DRelayError(
            f"method '{method}' needs a drafter checkpoint: none is bundled for target '{target_spec}'; "
            "pass --checkpoint DIR (or --method ar)"
        )
    drafter, extra, meta = load_drafter(path, target)
    return drafter, registry.from_checkpoint(method, drafter=drafter, tensors=extra, meta=meta)


def load_target_spec(spec: str, *, device: str = "cpu", dtype: str = "float32") -> TargetModel:
    """The target for a CLI spec on `device` (auto|cpu|cuda) in `dtype` (float32|bfloat16)."""
    return load_target(spec, device=device, dtype=dtype)
