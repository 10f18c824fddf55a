"""HostTier: sealed records in this process's host memory, between the device pool and the tiers
below it (disk, Redis), for a server whose device is not the CPU.

It holds the same records, under the same keys, as every other tier (the stack encodes and verifies
them above it), least recently used first out by bytes within `capacity_bytes` (`spill.lru`, the
disk tier's order too). What it evicts goes to the stack's demotion hook (`bind_demote`): under
write-back the next tier down receives it.

On CUDA each record is kept in a pinned host tensor (`pin_memory`, on by default where CUDA is
available) and a hit hands back a view of it, no copy; the copies to and from the device are the
stack's (`spill.transfer`): chunks leaving the device are copied into pinned buffers asynchronously
on a side stream (an event orders the writer after the copy), and a hit decodes into a pinned
staging buffer copied up `non_blocking` on that stream, which the current stream waits for. Without
CUDA nothing is pinned (pinning needs its driver): records are ordinary bytes.

On a CPU-only server the device pool already is host memory: `kvblocks serve` refuses
`--host-cache-size` there; the class itself works on any device (the tests run it on the CPU).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from kvblocks.spill.lru import BytesLRU
from kvblocks.spill.tier import TierHealth, Value
from kvblocks.spill.transfer import pinned_copy

Demote = Callable[[list[tuple[str, Value]]], None]


class HostTier:
    """A bounded LRU of records in host memory. Thread-safe; never raises TierUnavailable."""

    name = "host"

    def __init__(self, capacity_bytes: int, *, pin_memory: bool | None = None) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"the host tier needs a positive size in bytes, got {capacity_bytes}")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        elif pin_memory and not torch.cuda.is_available():
            raise ValueError("the host tier pins its records only where CUDA is available")
        self.pin_memory = pin_memory
        self._lru = BytesLRU(int(capacity_bytes))
        self._records: dict[str, bytes | torch.Tensor] = {}
        self._lock = threading.Lock()
        self._demote: Demote | None = None
        self._counts = {"evictions": 0, "evicted_bytes": 0, "refused_too_large": 0}

    def bind_demote(self, demote: Demote) -> None:
        """`demote(items)` receives what LRU eviction removes (called outside the tier's lock)."""
        self._demote = demote

    def sizes(self, keys: Sequence[str]) -> list[int]:
        with self._lock:
            return [self._lru.size(k) for k in keys]

    def get(self, keys: Sequence[str], limits: Sequence[int]) -> list[Value | None]:
        """Each record (a read-only view of its pinned tensor when pinned), cut to its limit."""
        out: list[Value | None] = []
        with self._lock:
            for key, limit in zip(keys, limits):
                record = self._records.get(key)
                if record is None:
                    out.append(None)
                    continue
                self._lru.touch([key])
                value = _view(record)
                out.append(value if len(value) <= limit else value[:limit])
        return out

    def put(self, items: Sequence[tuple[str, Value]]) -> int:
        written = 0
        evicted: list[tuple[str, Value]] = []
        stored = [(key, self._store(value)) for key, value in items if len(value) <= self._lru.capacity]
        with self._lock:
            self._counts["refused_too_large"] += len(items) - len(stored)
            for key, record in stored:
                size = _nbytes(record)
                self._records.pop(key, None)
                self._lru.pop(key)
                while not self._lru.fits(size):
                    old = self._lru.victim()
                    assert old is not None  # the record fits the capacity, so something is held
                    self._lru.pop(old)
                    evicted.append((old, _view(self._records.pop(old))))
                self._records[key] = record
                self._lru.add(key, size)
                written += size
            self._counts["evictions"] += len(evicted)
            self._counts["evicted_bytes"] += sum(len(v) for _, v in evicted)
        if evicted and self._demote is not None:
            self._demote(evicted)
        return written

    def delete(self, keys: Sequence[str]) -> int:
        deleted = 0
        with self._lock:
            for key in keys:
                if self._records.pop(key, None) is not None:
                    self._lru.pop(key)
                    deleted += 1
        return deleted

    def scan(self, prefix: str) -> Iterator[str]:
        with self._lock:
            keys = [k for k in self._records if k.startswith(prefix)]
        return iter(keys)

    def used_bytes(self) -> int:
        return self._lru.used

    def capacity_bytes(self) -> int | None:
        return self._lru.capacity

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
            self._lru.reset(())

    def _store(self, value: Value) -> bytes | torch.Tensor:
        """What the tier keeps of `value`: a pinned copy, or the bytes themselves."""
        return pinned_copy(value) if self.pin_memory else bytes(value)


def _nbytes(record: bytes | torch.Tensor) -> int:
    return record.numel() if isinstance(record, torch.Tensor) else len(record)


def _view(record: bytes | torch.Tensor) -> Value:
    """The record's bytes; a pinned tensor's as a read-only view (it keeps the tensor alive)."""
    return record.numpy().data.toreadonly() if isinstance(record, torch.Tensor) else record
