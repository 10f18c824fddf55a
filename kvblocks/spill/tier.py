"""The one interface every spill tier implements: a store of sealed records by key.

A tier knows bytes, not KV: the record codec (`spill.records`) and sealing sit above it, shared by
every tier, and the stack that walks the tiers (lookup in order, promotion upward, demotion on
eviction) sits above that. A tier is thread-safe, bounds every blocking call by its own timeouts,
and never raises for what it stores: an outage raises `TierUnavailable` (the caller counts a miss
and stays quiet for a while), a damaged or foreign value is the caller's to verify and `delete`.

A tier may also have these, which the stack (`spill.stack.TierStack`) uses where present and does
without otherwise (they are optional so a tier needs no more than the Protocol):
- `bind_demote(fn)`: the tier evicts by its own size bound and calls `fn(items)` with the
  (key, value)s it evicted, outside its locks; under write-back the stack writes them one tier down;
- `records() -> int`: how many records it holds, for `kvblocks stats` and `/metrics`;
- `discard(keys) -> int`: `delete` for records the codec refused (the disk tier counts them as
  damaged files);
- `needs_verified_records: bool`: the tier leaves damage inside a value to the codec (the disk tier),
  so the stack refuses a codec that does not verify its records (the LMCache format);
- `server_warnings() -> list[str]`: deployment problems worth a line at start;
- `shared: bool`: other processes restore from this tier (Redis; a disk two servers share): KV
  events report chunks evicted from the device as still stored there;
- `trust_warning: str`: logged when the stack's records are not sealed (no secret) and other
  programs can reach this tier's store (Redis).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

# A record's bytes as a tier holds them: bytes, or a read-only view of them (the host tier's pinned
# records); whoever reads a value takes either.
Value = bytes | memoryview


class TierUnavailable(RuntimeError):
    """The tier cannot answer now (connection refused, disk gone, timeout): a miss, never an error."""


@dataclass(frozen=True, slots=True)
class TierHealth:
    """`state` is "ok", "degraded" (answers, but cannot write: full, read-only) or "down"."""

    state: str
    reason: str = ""


@runtime_checkable
class Tier(Protocol):
    """A bounded store of records keyed by strings (`<prefix>:<namespace>:<chunk hash>[:state]`)."""

    name: str  # "host", "disk", "redis": the label in counters, metrics and explain

    def sizes(self, keys: Sequence[str]) -> list[int]:
        """Stored length in bytes of each key's value; 0 where absent. A value that is present
        but cannot be a record (wrong type) is -1. Raises TierUnavailable."""
        ...

    def get(self, keys: Sequence[str], limits: Sequence[int]) -> list[Value | None]:
        """Each key's value, reading at most `limits[i]` bytes of it; None where absent. A value is
        bytes or a read-only bytes-like view (the host tier's pinned records). Raises TierUnavailable."""
        ...

    def put(self, items: Sequence[tuple[str, Value]]) -> int:
        """Store each (key, value), replacing what is there; returns the bytes written. A tier at its
        capacity evicts by its own policy first. Raises TierUnavailable."""
        ...

    def delete(self, keys: Sequence[str]) -> int:
        """Remove the keys that exist; returns how many. Raises TierUnavailable."""
        ...

    def scan(self, prefix: str) -> Iterator[str]:
        """Every key that starts with `prefix` (for admin clears and inspection)."""
        ...

    def used_bytes(self) -> int:
        """Bytes the tier holds now (its own records only)."""
        ...

    def capacity_bytes(self) -> int | None:
        """The tier's size bound, or None when something else bounds it (Redis maxmemory)."""
        ...

    def health(self) -> TierHealth: ...

    def counters(self) -> dict[str, int]:
        """The tier's own counters (evictions, write failures, files dropped as damaged...), unprefixed;
        the stack adds `<name>_` and the read/write counters it keeps per tier."""
        ...

    def close(self) -> None: ...
