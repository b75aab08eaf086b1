"""Name -> object registries: the one place where methods, backends and heads are dispatched."""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from specdraft.errors import SpecdraftError

T = TypeVar("T")


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
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(sorted(self._items)) or "none"
            raise SpecdraftError(f"unknown {self.kind} {name!r}; choose one of: {known}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
