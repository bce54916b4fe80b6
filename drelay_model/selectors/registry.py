"""An explicit selector registry: names → selector classes, no import-time side effects.

`default_registry()` lists every selector the project ships, in one place. Tests and plugins build
their own `SelectorRegistry` or extend a copy. Duplicate names are rejected; an unknown name is
answered with the list of registered ones.
"""

from __future__ import annotations

from drelay_model.errors import DRelayError
from drelay_model.kernels.cpu_linear import CpuKernels, use_cpu_kernels
from drelay_model.selectors.base import Selector

SelectorFactory = type[Selector]


class SelectorRegistry:
    def __init__(self) -> None:
        self._factories: dict[str, SelectorFactory] = {}

    def register(self, name: str, factory: SelectorFactory) -> None:
        if not name or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"invalid selector name {name!r}")
        if name in self._factories:
            raise ValueError(f"selector '{name}' is already registered")
        self._factories[name] = factory

    def names(self) -> tuple[str, ...]:
        return tuple(self._factories)

    def factory(self, name: str) -> SelectorFactory:
        if name not in self._factories:
            raise DRelayError(f"unknown selector '{name}' (registered: {', '.join(self.names())})")
        return self._factories[name]

    def create(self, name: str, *, drafter=None, config: dict | None = None) -> Selector:
        """A fresh (untrained) selector; load trained weights with `load_state_dict`."""
        return _with_kernels(self.factory(name).build(drafter=drafter, config=config), drafter)

    def from_checkpoint(self, name: str, *, drafter, tensors: dict, meta: dict) -> Selector:
        """The selector `name` for a loaded drafter checkpoint.

        Convention: a checkpoint that holds a trained selector stores its weights as tensors named
        `selector.<param>` and `meta["selector"] = {"name": ..., "config": {...}}`. Untrainable
        selectors ignore both; a trainable one must find weights saved under its own name.
        """
        cls = self.factory(name)
        if not cls.capabilities.trainable:
            return _with_kernels(cls.build(drafter=drafter), drafter)
        saved = meta.get("selector") or {}
        if saved.get("name") != name:
            raise DRelayError(f"the checkpoint holds no trained '{name}' selector (it has: {saved.get('name') or 'none'})")
        selector = _with_kernels(cls.build(drafter=drafter, config=cls.saved_config(saved.get("config"))), drafter)
        state = {k.removeprefix("selector."): v for k, v in tensors.items() if k.startswith("selector.")}
        try:
            selector.load_state_dict(state)
        except RuntimeError as exc:
            raise DRelayError(f"the checkpoint's '{name}' selector weights do not fit: {str(exc).splitlines()[0]}") from exc
        return selector.eval()

    def __contains__(self, name: str) -> bool:
        return name in self._factories

    def copy(self) -> "SelectorRegistry":
        out = SelectorRegistry()
        out._factories = dict(self._factories)
        return out


def _with_kernels(selector: Selector, drafter) -> Selector:
    """A selector runs with the CPU kernel settings of the drafter it is built for (a drafter view
    without them: `CpuKernels.from_env()`)."""
    kernels = getattr(drafter, "cpu_kernels", None)
    use_cpu_kernels(selector, kernels if kernels is not None else CpuKernels.from_env())
    return selector


def default_registry() -> SelectorRegistry:
    """Every selector the project ships."""
    from drelay_model.selectors.dcoco import DCOCOSelector
    from drelay_model.selectors.dflash2 import DFlash2Selector
    from drelay_model.selectors.domino import DominoSelector
    from drelay_model.selectors.drelay import DRelaySelector
    from drelay_model.selectors.dspark import DSparkSelector
    from drelay_model.selectors.native import NativeSelector

    registry = SelectorRegistry()
    registry.register("native", NativeSelector)
    registry.register("drelay", DRelaySelector)
    registry.register("dcoco", DCOCOSelector)
    registry.register("dflash2", DFlash2Selector)
    registry.register("domino", DominoSelector)
    registry.register("dspark", DSparkSelector)
    return registry


def trainable_selectors(registry: SelectorRegistry | None = None) -> tuple[str, ...]:
    """Names of the selectors with parameters to train (what `selector.name` of a training config
    may be, besides "native"), in registry order."""
    registry = registry if registry is not None else default_registry()
    return tuple(n for n in registry.names() if registry.factory(n).capabilities.trainable)
