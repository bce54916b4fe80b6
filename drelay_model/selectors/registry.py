"""An explicit selector registry: names → factories, no import-time side effects.

`default_registry()` lists every selector the project ships, in one place. Tests and plugins build
their own `SelectorRegistry` or extend a copy. Duplicate names are rejected; an unknown name is
answered with the list of registered ones.
"""

from __future__ import annotations

from collections.abc import Callable

from drelay_model.errors import DRelayError
from drelay_model.selectors.base import Selector

SelectorFactory = Callable[..., Selector]


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

    def create(self, name: str, **kwargs) -> Selector:
        return self.factory(name)(**kwargs)

    def __contains__(self, name: str) -> bool:
        return name in self._factories

    def copy(self) -> "SelectorRegistry":
        out = SelectorRegistry()
        out._factories = dict(self._factories)
        return out


def default_registry() -> SelectorRegistry:
    """Every selector the project ships."""
    from drelay_model.selectors.native import NativeSelector

    registry = SelectorRegistry()
    registry.register("native", NativeSelector)
    return registry
