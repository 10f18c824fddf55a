"""A bounded ring of periodic samples of the cache's and engine's counters, so the past can be read
back (`GET /v1/cache/history`, `kvblocks stats --since`) without a Prometheus server.

A sample holds cumulative counters, never rates: the reader computes a rate from two neighbours,
as with Prometheus. A daemon thread takes one every `interval_s`; the ring keeps `window_s` of them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["CACHE_KEYS", "History", "tenant_view"]

# the cache's stats a sample keeps (the Redis ones only where the cache spills)
CACHE_KEYS = ("queries", "queried_tokens", "hit_tokens", "spill_hit_tokens", "evicted_tokens",
              "inserted_tokens", "resident_tokens", "capacity_tokens", "locked_tokens",
              "redis_errors", "redis_verify_failures", "redis_written_chunks", "snapshots")  # fmt: skip

Sample = dict


class History:
    """`take()` returns one sample (a dict with "t", "cache", "engine", "tenants")."""

    def __init__(
        self, take: Callable[[], Sample], interval_s: float = 5.0, window_s: float = 6 * 3600
    ) -> None:
        assert interval_s > 0 and window_s >= interval_s, (interval_s, window_s)
        self.take = take
        self.interval_s = interval_s
        self._ring: deque[Sample] = deque(maxlen=int(window_s / interval_s) + 1)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvblocks-history", daemon=True)

    def start(self) -> History:
        self.record()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def record(self) -> None:
        sample = self.take()
        with self._lock:
            self._ring.append(sample)

    def since(self, t0: float) -> list[Sample]:
        """Samples taken at or after `t0` (seconds since the epoch), oldest first."""
        with self._lock:
            return [s for s in self._ring if s["t"] >= t0]

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.record()


def sample_of(
    stats: dict | None, tenants: dict[str, dict], active: int, queued: int, counters: dict
) -> Sample:
    """One sample from the cache's stats, its per-tenant counters and the engine's load and counters."""
    cache = None if stats is None else {k: stats[k] for k in CACHE_KEYS if k in stats}
    return {
        "t": time.time(),
        "cache": cache,
        "engine": {"active": active, "queued": queued, **counters},
        "tenants": tenants,
    }


def tenant_view(sample: Sample, tenant: str) -> Sample:
    """What a tenant's key may see of a sample: its own counters, nothing of the server or the others."""
    own = sample["tenants"].get(tenant) or dict.fromkeys(
        ("queried_tokens", "hit_tokens", "spill_hit_tokens", "evicted_tokens"), 0
    )
    return {"t": sample["t"], "tenant": tenant, "cache": own}
