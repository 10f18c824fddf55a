"""Redis as a `Tier`: records by key in Redis, Redis Cluster or Valkey.

Reads are a pipelined STRLEN (`sizes`: a value of another type answers -1, unread) and a pipelined
GETRANGE bounded by what a record may weigh (`get`), on the lookup client; writes are a pipelined
SET with the record's TTL, deletes a pipelined UNLINK, on the write client. Any Redis failure raises
TierUnavailable (the stack counts it and leaves the tier alone for a while); Redis' memory is bounded
by its own maxmemory, so `capacity_bytes` reports that and the tier evicts nothing itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from kvblocks.spill.redis_conn import REDIS_FAILURES, RedisConnection, wrong_type
from kvblocks.spill.tier import TierHealth, TierUnavailable, Value


class RedisStore:
    """The record store behind the Redis tier. `ttl_ms` (None: forever) is set on every write."""

    name = "redis"
    shared = True  # every replica using this Redis restores from it (optional Tier attribute)
    # logged by the stack when its records are not sealed: other programs can reach this store
    trust_warning = ""

    def __init__(self, connection: RedisConnection, *, ttl_ms: int | None, scan_batch: int = 500) -> None:
        self.connection, self.ttl_ms, self.scan_batch = connection, ttl_ms, scan_batch
        self.url = connection.url

    # ---- reads (the lookup client) -----------------------------------------------------------

    def sizes(self, keys: Sequence[str]) -> list[int]:
        replies = self.connection.pipeline("read", [("strlen", k) for k in keys])
        return [-1 if wrong_type(r) else int(r) for r in replies]

    def get(self, keys: Sequence[str], limits: Sequence[int]) -> list[Value | None]:
        calls = [("getrange", k, 0, limit - 1) for k, limit in zip(keys, limits)]
        # a key replaced by another type since STRLEN answered: no record there
        return [None if wrong_type(r) or not r else r for r in self.connection.pipeline("read", calls)]

    # ---- writes (the write client) -----------------------------------------------------------

    def put(self, items: Sequence[tuple[str, Value]]) -> int:
        self.connection.pipeline("write", [("set", k, v, None, self.ttl_ms) for k, v in items])
        return sum(len(v) for _, v in items)

    def delete(self, keys: Sequence[str]) -> int:
        return sum(self.connection.pipeline("write", [("unlink", k) for k in keys]))

    def scan(self, prefix: str) -> Iterator[str]:
        """Every key under `prefix`, in SCAN batches; a failure midway raises TierUnavailable."""
        try:
            keys = self.connection.client().scan_iter(match=f"{prefix}*", count=self.scan_batch)
            while batch := list(itertools.islice(keys, self.scan_batch)):
                yield from (k.decode() if isinstance(k, bytes) else k for k in batch)
        except REDIS_FAILURES as exc:
            self.connection.drop()
            raise TierUnavailable(f"Redis at {self.url}: {exc}") from exc

    # ---- sizes, health, deployment ------------------------------------------------------------

    def used_bytes(self) -> int:
        """Redis' `used_memory` (every client's data, not only these records: Redis reports no less)."""
        return int(self._info("memory").get("used_memory", 0))

    def capacity_bytes(self) -> int | None:
        maxmemory = int(self._info("memory").get("maxmemory", 0))
        return maxmemory or None

    def records(self) -> int:
        """Keys in the database (DBSIZE; a cluster's, summed over its nodes)."""
        reply = self.connection.run("read", lambda c: c.dbsize())
        return sum(reply.values()) if isinstance(reply, dict) else int(reply)

    def health(self) -> TierHealth:
        try:
            self.connection.run("read", lambda c: c.ping())
        except TierUnavailable as exc:
            return TierHealth("down", str(exc))
        return TierHealth("ok")

    def counters(self) -> dict[str, int]:
        return {}

    def server_warnings(self) -> list[str]:
        """Deployment problems worth a line at start: today, a Redis that can grow without bound."""
        try:
            config = self.connection.client().config_get("maxmemory")
        except REDIS_FAILURES:  # unreachable, or CONFIG is disabled (managed Redis): nothing to say
            return []
        values = config.values() if isinstance(config, dict) else ()
        if any(str(v) == "0" for v in values):
            ttl = (
                "records never expire"
                if self.ttl_ms is None
                else f"records expire after {self.ttl_ms / 1000:g} s"
            )
            return [
                f"kvblocks: Redis at {self.url} has no maxmemory, so it grows until the host runs out of "
                f"memory ({ttl}); set maxmemory and maxmemory-policy allkeys-lru"
            ]
        return []

    def close(self) -> None:
        self.connection.close()

    def _info(self, section: str) -> dict[str, Any]:
        info: dict[str, Any] = self.connection.run("read", lambda c: c.info(section))
        if self.connection.cluster and info and all(isinstance(v, dict) for v in info.values()):
            merged: dict[str, int] = {}
            for node in info.values():  # RedisCluster answers per node
                for k in ("used_memory", "maxmemory"):
                    merged[k] = merged.get(k, 0) + int(node.get(k, 0))
            return merged
        return info
