"""Selectors: choose one pool entry per slot. One file each; `registry.default_registry()` lists them.

May import: torch, drelay_model.{drafter, errors}, drelay_model.training.losses (shared loss math).
"""

from drelay_model.selectors.base import (
    Selection,
    SelectionContext,
    Selector,
    SelectorCapabilities,
    SelectorLossKnobs,
    SelectorTrainInputs,
    SelectorTrainLoss,
)
from drelay_model.selectors.native import NativeSelector
from drelay_model.selectors.registry import SelectorRegistry, default_registry, trainable_selectors

__all__ = [
    "NativeSelector",
    "Selection",
    "SelectionContext",
    "Selector",
    "SelectorCapabilities",
    "SelectorLossKnobs",
    "SelectorTrainInputs",
    "SelectorTrainLoss",
    "SelectorRegistry",
    "default_registry",
    "trainable_selectors",
]
