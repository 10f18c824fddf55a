"""BytesLRU: names with sizes in least-recently-used order under a bound in bytes, the one eviction
order of the tiers that keep their own size bound (host memory, disk).

It holds sizes, not values: the host tier keeps its records beside it, the disk tier its files. It
decides who goes (`victim`), the owner removes what it holds and calls `pop`. Not thread-safe: each
owner calls it under its own lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator


class BytesLRU:
    """Sizes by name, least recent first; `used` is their sum, `capacity` the bound it is kept under."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a size bound must be positive, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, name: object) -> bool:
        return name in self._sizes

    def __iter__(self) -> Iterator[str]:
        """Least recent first."""
        return iter(self._sizes)

    def size(self, name: str) -> int:
        """Its size, 0 when absent."""
        return self._sizes.get(name, 0)

    def add(self, name: str, size: int, *, recent: bool = True) -> None:
        """Insert or replace `name`, as the most recent (or, with `recent=False`, the least recent:
        what another process wrote, which this one has not used yet)."""
        self.used += size - self._sizes.pop(name, 0)
        self._sizes[name] = size
        if not recent:
            self._sizes.move_to_end(name, last=False)

    def touch(self, names: Iterable[str]) -> None:
        """Make each present name the most recent, in order (the last one ends most recent)."""
        for name in names:
            if name in self._sizes:
                self._sizes.move_to_end(name)

    def pop(self, name: str) -> int:
        """Remove `name`; its size, 0 when absent."""
        size = self._sizes.pop(name, 0)
        self.used -= size
        return size

    def fits(self, size: int, name: str | None = None) -> bool:
        """Whether `size` bytes under `name` (replacing what `name` holds) stay within the bound."""
        return self.used - (self.size(name) if name is not None else 0) + size <= self.capacity

    def victim(self, keep: str | None = None) -> str | None:
        """The least recent name other than `keep` (None when there is none): what goes first."""
        for name in self._sizes:
            if name != keep:
                return name
        return None

    def reset(self, entries: Iterable[tuple[str, int]]) -> None:
        """Replace everything with `entries`, least recent first."""
        self._sizes = OrderedDict(entries)
        self.used = sum(self._sizes.values())
