"""Named registries that share one namespace: a task's `kind` names either a task kind
(crucible.ml.kinds) or an environment (crucible.ml.envs), never both."""
from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")
_TAKEN: dict[str, str] = {}  # name -> what it names ("kind", "environment")


class Registry(Generic[T]):
    def __init__(self, what: str, plural: str, unknown: type[ValueError]):
        self.what, self.plural, self.unknown = what, plural, unknown
        self._items: dict[str, T] = {}

    def register(self, item: T) -> T:
        name = getattr(item, "name", "")
        if not name or name in _TAKEN:
            raise ValueError(f"{self.what} name {name!r} is empty or already taken"
                             + (f" (by a {_TAKEN[name]})" if name in _TAKEN else ""))
        _TAKEN[name] = self.what
        self._items[name] = item
        return item

    def known(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def get(self, name: str) -> T:
        """The item called `name`; `unknown` (a ValueError) naming the known ones otherwise."""
        try:
            return self._items[name]
        except KeyError:
            raise self.unknown(f"unknown {self.what} {name!r}: known {self.plural} are "
                               f"{', '.join(self.known())}") from None
