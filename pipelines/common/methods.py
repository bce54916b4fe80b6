"""The method spec: what decodes — `ar`, or a registered selector over a drafter checkpoint.

    resolve_method(name, target_spec=…, checkpoint=…)  → MethodSpec   (names and paths checked once,
                                                                      the bundled default filled in)
    check_selector_weights(checkpoint, name)           the checkpoint runs selector `name`: its own
                                                       trained selector, or a head installed beside it
                                                       (`heads/<name>.safetensors`, `drelay heads add`)
    load_method(spec, target)                          → (drafter, selector); (None, None) for AR

Every command (generate, eval, compare, study) resolves its methods here; nothing else spells "ar",
looks up the registry for a method name, or picks the default checkpoint.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from drelay_model.drafter import BlockDrafter, DrafterConfig, load_drafter
from drelay_model.drafter.checkpoint import read_checkpoint
from drelay_model.drafter.heads import read_head
from drelay_model.errors import DRelayError
from drelay_model.selectors import Selector, default_registry, trainable_selectors
from drelay_model.target import TargetModel, load_target
from pipelines.common.paths import bundled_checkpoint
from pipelines.common.checkpoint_refs import resolve_ref

AR = "ar"
NATIVE = "native"  # the drafter's own argmax path; also "trained without a selector"
LEGACY_NONE = "none"  # what configs said for NATIVE before; accepted with a deprecation note


@dataclass(frozen=True)
class MethodSpec:
    """A resolved method. `checkpoint` is a drafter directory (None for AR and random drafters)."""

    name: str
    checkpoint: str | None = None
    random_drafter: bool = False

    @property
    def is_ar(self) -> bool:
        return self.name == AR


def method_names() -> tuple[str, ...]:
    return (AR, *default_registry().names())


def check_method(name: str) -> str:
    if name not in method_names():
        raise DRelayError(f"unknown method '{name}' (choose from: {', '.join(method_names())})")
    return name


def training_selector(name: str) -> str:
    """A run config's `selector.name`: `native` (drafter only) or a trainable selector. The legacy
    spelling `none` becomes `native` with a FutureWarning; anything else is a ValueError."""
    if name == LEGACY_NONE:
        warnings.warn("selector.name: 'none' is deprecated, write 'native'", FutureWarning, stacklevel=2)
        return NATIVE
    allowed = (NATIVE, *trainable_selectors())
    if name not in allowed:
        raise ValueError(f"'{name}' is not a trainable selector (choose from: {', '.join(allowed)})")
    return name


def trained_selector(checkpoint: str | Path) -> str:
    """The selector a checkpoint was trained with (meta["selector"]["name"]), else `native`."""
    _, _, meta = read_checkpoint(checkpoint)  # a missing or corrupt checkpoint is a DRelayError
    name = (meta.get("selector") or {}).get("name") or NATIVE
    return NATIVE if name == LEGACY_NONE else name


def resolve_method(name: str, *, target_spec: str, checkpoint: str | None = None, random_drafter: bool = False,
                   hint: str = "pass --checkpoint DIR (or --method ar)") -> MethodSpec:  # fmt: skip
    """Check the name, pick the checkpoint (given — a directory, FOLDER@COMMIT or an MLflow registry reference — else the
    one bundled for the target) and check it exists."""
    check_method(name)
    if name == AR:
        return MethodSpec(AR)
    if random_drafter:
        if checkpoint:
            raise DRelayError("--random-drafter and --checkpoint exclude each other")
        return MethodSpec(name, None, True)
    path = checkpoint or bundled_checkpoint(target_spec)
    if path is not None:  # models:/<name>@<alias>, models:/<name>/<version> or FOLDER@COMMIT → a local folder
        path = resolve_ref(str(path))
    if path is None:
        raise DRelayError(f"method '{name}' needs a drafter checkpoint: none is bundled for target '{target_spec}'; {hint}")
    if not Path(path).is_dir():
        raise DRelayError(f"checkpoint '{path}' not found (method '{name}')")
    check_selector_weights(path, name)
    return MethodSpec(name, str(path))


def needs_head(name: str, meta: dict) -> bool:
    """Selector `name` runs on a head beside the checkpoint (`heads/<name>.safetensors`, installed by
    `drelay heads add`) when it is trainable and the checkpoint's own selector (`meta`) is another."""
    return default_registry().factory(name).capabilities.trainable and (meta.get("selector") or {}).get("name") != name


def check_selector_weights(checkpoint: str | Path, name: str) -> None:
    """Fail now, with the one-line error `load_method` would give, when `checkpoint` cannot run selector
    `name`: neither its own trained selector nor an installed head that fits its drafter."""
    if not default_registry().factory(name).capabilities.trainable:
        return  # a rule runs on any drafter
    _, _, meta = read_checkpoint(checkpoint)  # a missing or corrupt checkpoint is a DRelayError
    if needs_head(name, meta):
        read_head(checkpoint, name)


def load_method(spec: MethodSpec, target: TargetModel) -> tuple[BlockDrafter | None, Selector | None]:
    """(drafter, selector) of a resolved method; (None, None) for autoregressive decoding."""
    if spec.is_ar:
        return None, None
    registry = default_registry()
    if spec.random_drafter:
        torch.manual_seed(0)
        drafter = BlockDrafter(DrafterConfig.for_target(target), target).to(target.device).eval()
        return drafter, registry.create(spec.name, drafter=drafter).to(target.device).eval()
    drafter, extra, meta = load_drafter(spec.checkpoint, target)
    if needs_head(spec.name, meta):
        extra, meta = read_head(spec.checkpoint, spec.name)  # a head beside the checkpoint's own (`drelay heads add`)
    return drafter, registry.from_checkpoint(spec.name, drafter=drafter, tensors=extra, meta=meta).to(target.device)


def load_target_spec(spec: str, *, device: str = "cpu", dtype: str = "float32") -> TargetModel:
    """The target for a CLI spec on `device` (auto|cpu|cuda) in `dtype` (float32|bfloat16)."""
    return load_target(spec, device=device, dtype=dtype)
