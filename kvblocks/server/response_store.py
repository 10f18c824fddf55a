"""Stored responses (`/v1/responses` with `store`), bounded per tenant in count, bytes and time.

An entry is kept as compact JSON bytes: what it is charged is what it holds in memory (a Python
object tree of the same conversation takes about five times its JSON), and every read is a fresh
copy that no caller can alter in place. Entries are charged to the tenant that stored them:

- a tenant's new entry first pushes out that tenant's own oldest entries (never another's) until
  its count and its bytes fit its budget;
- when all tenants together are over the total, the tenant most over its fair share (bytes per
  unit of weight, the keys file's `weight`) loses its oldest entry, until the total fits;
- an entry larger than the per-tenant budget is never stored (`put` says so);
- expired entries are swept by a timer on the event loop, whether or not their tenant comes back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvblocks.server.errors import APIError

MAX_STORED_PER_TENANT = 256
STORED_TTL_S = 3600.0
STORED_BYTES_PER_TENANT = 64 << 20
STORED_BYTES_TOTAL = 512 << 20
# What an entry costs besides its JSON: its id, the Stored record, the dict slot and two bytes
# headers (measured with sys.getsizeof: about 400 bytes), so a budget bounds empty entries too.
ENTRY_OVERHEAD = 512
EVICTION_REASONS = ("expired", "count_cap", "own_budget", "server_budget")
log = logging.getLogger("kvblocks.server")


def as_json(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass(slots=True)
class Stored:
    """One stored response: the conversation as chat messages (the reply included) and the
    response object, both as JSON."""

    messages_json: bytes
    response_json: bytes
    expires: float

    @property
    def messages(self) -> list[dict]:
        return json.loads(self.messages_json)

    @property
    def response(self) -> dict:
        return json.loads(self.response_json)

    @property
    def nbytes(self) -> int:
        return len(self.messages_json) + len(self.response_json) + ENTRY_OVERHEAD


@dataclass(slots=True)
class ResponseStore:
    """Each tenant's stored responses, oldest first. `weight(tenant)` is its share of the total."""

    per_tenant_bytes: int = STORED_BYTES_PER_TENANT
    total_bytes: int = STORED_BYTES_TOTAL
    ttl_s: float = STORED_TTL_S
    per_tenant: int = MAX_STORED_PER_TENANT
    weight: Callable[[str], float] = lambda tenant: 1.0
    evicted: Counter = field(default_factory=Counter)  # entries dropped, by EVICTION_REASONS
    refused: int = 0  # entries larger than the per-tenant budget, never stored
    _kept: dict[str, OrderedDict[str, Stored]] = field(default_factory=dict)
    _bytes: dict[str, int] = field(default_factory=dict)
    _total: int = 0
    _sweep: asyncio.TimerHandle | None = None

    def __post_init__(self) -> None:
        assert self.per_tenant_bytes <= self.total_bytes, "one tenant's budget cannot exceed the total"

    def check_fits(self, nbytes: int) -> None:
        """Refuse (400, `store`) a request whose entry, before any output, is already over budget."""
        if nbytes + ENTRY_OVERHEAD > self.per_tenant_bytes:
            raise APIError(
                400,
                f"this conversation takes {nbytes} bytes to store, over the {self.per_tenant_bytes} "
                "bytes a tenant may keep in stored responses; send 'store': false (and the whole "
                "conversation in 'input' instead of 'previous_response_id')",
                param="store",
                code="stored_responses_budget",
            )

    def put(self, tenant: str, response_id: str, messages: list[dict], response: dict) -> bool:
        """Store an entry for `tenant`; False (nothing stored, nothing dropped) when it alone is
        larger than the per-tenant budget."""
        entry = Stored(as_json(messages), as_json(response), time.monotonic() + self.ttl_s)
        size = entry.nbytes
        if size > self.per_tenant_bytes:
            self.refused += 1
            log.warning(
                "kvblocks: stored response of tenant '%s' not kept: %d bytes, over the per-tenant budget of %d",
                tenant,
                size,
                self.per_tenant_bytes,
            )
            return False
        self.sweep()
        kept = self._kept.setdefault(tenant, OrderedDict())
        while kept and len(kept) >= self.per_tenant:
            self._drop_oldest(tenant, "count_cap")
        while kept and self._bytes.get(tenant, 0) + size > self.per_tenant_bytes:
            self._drop_oldest(tenant, "own_budget")
        self._kept.setdefault(tenant, OrderedDict())[response_id] = entry  # `kept` went if emptied
        self._charge(tenant, size)
        while self._total > self.total_bytes:
            self._drop_oldest(self._most_over_share(), "server_budget")
        self._arm_timer()
        return response_id in self._kept.get(tenant, ())

    def get(self, tenant: str, response_id: str) -> Stored:
        stored = self._kept.get(tenant, {}).get(response_id)
        if stored is None or stored.expires <= time.monotonic():
            raise APIError(
                404,
                f"no stored response with id '{response_id}'",
                param="previous_response_id",
                code="not_found",
            )
        return stored

    def delete(self, tenant: str, response_id: str) -> None:
        self.get(tenant, response_id)
        self._remove(tenant, response_id)

    # Read by /metrics from a worker thread: each dict is copied whole in one C call under the GIL
    # before Python code walks it, so the event loop's changes never break the walk.
    def bytes_by_tenant(self) -> dict[str, int]:
        return dict(self._bytes)

    def entries_by_tenant(self) -> dict[str, int]:
        return {tenant: len(kept) for tenant, kept in dict(self._kept).items()}

    def sweep(self) -> None:
        """Drop every expired entry. A tenant's entries expire in the order they were stored (one
        TTL for all), so each tenant's sweep stops at its first live entry."""
        now = time.monotonic()
        for tenant in list(self._kept):
            kept = self._kept[tenant]
            while kept and next(iter(kept.values())).expires <= now:
                self._drop_oldest(tenant, "expired")

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    def _arm_timer(self) -> None:
        """One timer, set for the earliest expiry: it sweeps, then sets itself for the next one."""
        if self._sweep is not None or not self._kept:
            return
        first = min(next(iter(kept.values())).expires for kept in self._kept.values())
        loop = asyncio.get_running_loop()
        self._sweep = loop.call_later(max(first - time.monotonic(), 0.0), self._on_timer)

    def _on_timer(self) -> None:
        self._sweep = None
        self.sweep()
        self._arm_timer()

    def _most_over_share(self) -> str:
        return max(self._bytes, key=lambda t: self._bytes[t] / self.weight(t))

    def _drop_oldest(self, tenant: str, reason: str) -> None:
        self._remove(tenant, next(iter(self._kept[tenant])))
        self.evicted[reason] += 1

    def _remove(self, tenant: str, response_id: str) -> None:
        self._charge(tenant, -self._kept[tenant].pop(response_id).nbytes)
        if not self._kept[tenant]:
            del self._kept[tenant], self._bytes[tenant]

    def _charge(self, tenant: str, nbytes: int) -> None:
        self._bytes[tenant] = self._bytes.get(tenant, 0) + nbytes
        self._total += nbytes
