"""HostTier: sealed records in this process's host memory, between the device pool and the tiers
below it (disk, Redis), for a server whose device is not the CPU.

It holds the same records, under the same keys, as every other tier (the stack encodes and verifies
them above it), least recently used first out by bytes within `capacity_bytes`. What it evicts
goes to the stack's demotion hook (`bind_demote`): under write-back the next tier down receives it.
The device side of the copies is the stack's: chunks leaving the device are copied into pinned host
buffers asynchronously (a CUDA event orders the writer after the copy), and a hit decodes into a
pinned staging buffer that is copied up with `non_blocking`, so the copy overlaps what the engine
does next.

On a CPU-only server the device pool already is host memory: `kvblocks serve` refuses
`--host-cache-size` there; the class itself works on any device (the tests run it on the CPU).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from kvblocks.spill.tier import TierHealth

Demote = Callable[[list[tuple[str, bytes]]], None]


class HostTier:
    """A bounded LRU of records in host memory. Thread-safe; never raises TierUnavailable."""

    name = "host"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"the host tier needs a positive size in bytes, got {capacity_bytes}")
        self._capacity = int(capacity_bytes)
        self._records: OrderedDict[str, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._demote: Demote | None = None
        self._counts = {"evictions": 0, "evicted_bytes": 0, "refused_too_large": 0}

    def bind_demote(self, demote: Demote) -> None:
        """`demote(items)` receives what LRU eviction removes (called outside the tier's lock)."""
        self._demote = demote

    def sizes(self, keys: Sequence[str]) -> list[int]:
        with self._lock:
            return [len(self._records.get(k, b"")) for k in keys]

    def get(self, keys: Sequence[str], limits: Sequence[int]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for key, limit in zip(keys, limits):
                value = self._records.get(key)
                if value is not None:
                    self._records.move_to_end(key)
                    value = value if len(value) <= limit else value[:limit]
                out.append(value)
        return out

    def put(self, items: Sequence[tuple[str, bytes]]) -> int:
        written, evicted = 0, []
        with self._lock:
            for key, value in items:
                if len(value) > self._capacity:
                    self._counts["refused_too_large"] += 1
                    continue
                self._used -= len(self._records.pop(key, b""))
                while self._used + len(value) > self._capacity:
                    old_key, old = self._records.popitem(last=False)
                    self._used -= len(old)
                    evicted.append((old_key, old))
                self._records[key] = bytes(value)
                self._used += len(value)
                written += len(value)
            self._counts["evictions"] += len(evicted)
            self._counts["evicted_bytes"] += sum(len(v) for _, v in evicted)
        if evicted and self._demote is not None:
            self._demote(evicted)
        return written

    def delete(self, keys: Sequence[str]) -> int:
        deleted = 0
        with self._lock:
            for key in keys:
                value = self._records.pop(key, None)
                if value is not None:
                    self._used -= len(value)
                    deleted += 1
        return deleted

    def scan(self, prefix: str) -> Iterator[str]:
        with self._lock:
            keys = [k for k in self._records if k.startswith(prefix)]
        return iter(keys)

    def used_bytes(self) -> int:
        return self._used

    def capacity_bytes(self) -> int | None:
        return self._capacity

    def records(self) -> int:
        return len(self._records)

    def health(self) -> TierHealth:
        return TierHealth("ok")

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        with self._lock:
            self._records.clear()
            self._used = 0
