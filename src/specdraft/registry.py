"""Name -> object registries: the one place where methods, backends and heads are dispatched.

Most registries are filled by their own layer. A few are seams that a higher layer fills by design, so that no
lower package imports a higher one: each method's ``extract --method`` layer preset (``models``), and the optional
vLLM and Mooncake engines and backends (``integrations``); ``tests/test_layering.py`` lists them (``SEAMS``) and
fails on any other registration from above. The CLI loads those layers explicitly; for library use the first ``get``
or ``in`` that misses loads the installed ``specdraft.plugins`` entry points (:func:`load_plugins`) and looks again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from specdraft.errors import SpecdraftError

T = TypeVar("T")

PLUGIN_GROUP = "specdraft.plugins"
_plugins_loaded = False


def load_plugins() -> None:
    """Load (once) every ``specdraft.plugins`` entry point; one that names a callable is called."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    from importlib.metadata import entry_points

    for point in entry_points(group=PLUGIN_GROUP):
        loaded = point.load()
        if callable(loaded):
            loaded()


class Registry(Generic[T]):
    """A named mapping with a decorator for registration and helpful lookup errors."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        if name not in self._items:
            load_plugins()
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(sorted(self._items)) or "none"
            raise SpecdraftError(f"unknown {self.kind} {name!r}; choose one of: {known}") from None

    def names(self) -> list[str]:
        """The names registered so far (no plugin loading: class bodies call this while modules import)."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        if name not in self._items:
            load_plugins()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
