"""A small name -> object registry with helpful lookup errors.

Used for datasets, partitioners, models and fusion methods. Aliases resolve to a canonical name, so the legacy
FedML / PFNM names (``homo``, ``hetero-dir``) and the flwr-datasets names point at the same implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from rayfuse.errors import InputError, suggest

T = TypeVar("T")

__all__ = ["Registry"]


class Registry(Generic[T]):
    """Map names (and aliases) to objects.

    Parameters
    ----------
    kind : str
        What is registered, in words ("method", "dataset"...), used in error messages.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._aliases: dict[str, str] = {}
        self._loaders: list[Callable[[], object]] = []

    def add_loader(self, loader: Callable[[], object]) -> None:
        """Run ``loader`` (e.g. importing plug-in modules) before the first lookup."""
        self._loaders.append(loader)

    def _load(self) -> None:
        while self._loaders:
            self._loaders.pop(0)()

    def register(self, name: str, obj: T, *, aliases: tuple[str, ...] = ()) -> T:
        if name in self._items and self._items[name] is not obj:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._items[name] = obj
        for alias in aliases:
            self._aliases[alias] = name
        return obj

    def canonical(self, name: str) -> str:
        self._load()
        return self._aliases.get(name, name)

    def get(self, name: str, *, path: str = "name") -> T:
        """Return the object registered as ``name``; raise :class:`InputError` naming ``path`` otherwise."""
        canonical = self.canonical(name)
        try:
            return self._items[canonical]
        except KeyError:
            choices = self.names(include_aliases=True)
            raise InputError(path, f"a {self.kind} in {{{', '.join(choices)}}}", name, suggest(name, choices).strip(" ()")) from None

    def __contains__(self, name: object) -> bool:
        self._load()
        return isinstance(name, str) and (name in self._items or name in self._aliases)

    def names(self, *, include_aliases: bool = False) -> list[str]:
        self._load()
        names = sorted(self._items)
        return names + sorted(self._aliases) if include_aliases else names

    def aliases_of(self, name: str) -> list[str]:
        self._load()
        return sorted(a for a, target in self._aliases.items() if target == name)

    def items(self) -> Iterator[tuple[str, T]]:
        self._load()
        return iter(sorted(self._items.items()))
