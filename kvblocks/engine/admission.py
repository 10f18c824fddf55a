"""The waiting room: bounded queues per tenant, and the weighted fair order the engine admits from.

A request waits in its tenant's FIFO. Submitting is refused (`QueueFullError`, a 429 at the server)
when the tenant's queue or the whole room is full, so one client cannot grow the engine's memory or
its per-step work without bound. Admission asks for tenants in fair order: least recent work per
unit of weight first, counting the tokens the `TenantLedger` was charged for the tenant plus
`REQUEST_TOKENS` for each request it has running (then the one whose oldest request waited longest),
skipping tenants at their `max_running`. A tenant flooding with thousands of long prompts therefore
gets its weighted share of the engine and no more while others wait. Each step looks at a few queue
heads per tenant, never a whole queue.

Given the batch's `places`, a tenant also starts no request beyond its weighted share of them while
other tenants are active (waiting, running, or served within `recent_s`): with or without
`max_running`, a flooder's rows leave room in each step for the others, whose next request then
starts at once. Alone, a tenant may take every place.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvblocks.engine.ledger import TenantLedger

if TYPE_CHECKING:
    from kvblocks.engine.request import Request

REQUEST_TOKENS = 64  # the work a running request counts as in fair order (about a prompt chunk)


@dataclass(slots=True, frozen=True)
class TenantLimits:
    """A tenant's bounds in the engine. None: only the server-wide bound applies."""

    max_running: int | None = None
    max_waiting: int | None = None
    weight: float = 1.0


LimitsOf = Callable[[str], TenantLimits]


class QueueFullError(Exception):
    """The request cannot wait: its tenant's queue or the whole room is full. Try again later."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(slots=True, frozen=True)
class RoomLimits:
    """Server-wide bounds; a tenant's own `max_waiting` (keys file) replaces `max_waiting_per_tenant`."""

    max_waiting: int = 1024
    max_waiting_per_tenant: int = 256

    def __post_init__(self) -> None:
        if self.max_waiting < 1 or self.max_waiting_per_tenant < 1:
            raise ValueError(
                f"need max_waiting >= 1 and max_waiting_per_tenant >= 1, got {self.max_waiting} "
                f"and {self.max_waiting_per_tenant}"
            )


def no_limits(_: str) -> TenantLimits:
    return TenantLimits()


class WaitingRoom:
    """Per-tenant FIFOs of waiting items (anything with `tenant`, `submitted` and `cancelled`).

    `put_all` and `put_front` may be called from any thread; the rest only from the engine thread
    (removals), which is why a removal needs the lock only for the counts other threads read."""

    def __init__(
        self,
        limits: RoomLimits | None = None,
        limits_of: LimitsOf = no_limits,
        on_cancelled: Callable[[], None] = lambda: None,
        ledger: TenantLedger | None = None,
    ) -> None:
        self.limits = limits or RoomLimits()
        self.limits_of = limits_of
        self.ledger = ledger or TenantLedger(lambda tenant: limits_of(tenant).weight)
        self.on_cancelled = on_cancelled  # called for each cancelled request dropped from a line
        self._queues: dict[str, deque[Request]] = {}
        self._size = 0
        self._lock = threading.Lock()
        self._nonempty = threading.Condition(self._lock)

    def __len__(self) -> int:
        return self._size

    def waiting(self, tenant: str) -> int:
        queue = self._queues.get(tenant)
        return 0 if queue is None else len(queue)

    def can_put(self, tenant: str, n: int) -> QueueFullError | None:
        """Why `n` more requests of `tenant` cannot wait now (None: they can). Lock held."""
        cap = self.limits_of(tenant).max_waiting or self.limits.max_waiting_per_tenant
        mine = self.waiting(tenant)
        if mine + n > cap:
            return QueueFullError(
                f"too many requests waiting for this tenant ({mine} waiting, {n} more asked, at most "
                f"{cap}); retry later",
                self._retry_after(mine),
            )
        if self._size + n > self.limits.max_waiting:
            return QueueFullError(
                f"the server is at capacity ({self._size} requests waiting, at most "
                f"{self.limits.max_waiting}); retry later",
                self._retry_after(self._size),
            )
        return None

    def tenants(self) -> set[str]:
        """The tenants with requests waiting."""
        with self._lock:
            return {tenant for tenant, queue in self._queues.items() if queue}

    def put_all(self, tenant: str, items: Iterable[Request]) -> None:
        """Queue every item or none of them (a request's branches wait together)."""
        items = list(items)
        with self._lock:
            full = self.can_put(tenant, len(items))
            if full is not None:
                raise full
            self._queues.setdefault(tenant, deque()).extend(items)
            self._size += len(items)
            self._nonempty.notify_all()

    def put_front(self, tenant: str, item: Request) -> None:
        """A preempted request goes back first in its tenant's line, whatever the bounds."""
        with self._lock:
            self._queues.setdefault(tenant, deque()).appendleft(item)
            self._size += 1
            self._nonempty.notify_all()

    def wait(self, timeout: float) -> None:
        """Block until something waits (or `timeout` passes, or `wake` is called)."""
        with self._lock:
            if not self._size:
                self._nonempty.wait(timeout)

    def wait_for(self, tenants: Set[str], timeout: float) -> None:
        """Block until one of `tenants` has a request waiting (or `timeout` passes, or `wake`)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not any(self._queues.get(t) for t in tenants):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._nonempty.wait(left)

    def wake(self) -> None:
        with self._lock:
            self._nonempty.notify_all()

    def remove(self, tenant: str, item: Request) -> None:
        with self._lock:
            queue = self._queues[tenant]
            queue.remove(item)  # near the head: admission only takes from the first few
            self._size -= 1
            if not queue:
                del self._queues[tenant]

    def heads(self, tenant: str, look: int) -> list[Request]:
        """The first `look` items of `tenant`'s line; cancelled ones at its head leave it first."""
        dropped = 0
        with self._lock:
            queue = self._queues.get(tenant)
            while queue and queue[0].cancelled.is_set():
                queue.popleft()
                self._size -= 1
                dropped += 1
            if queue is not None and not queue:
                del self._queues[tenant]
            heads = [] if not queue else [queue[i] for i in range(min(look, len(queue)))]
        for _ in range(dropped):
            self.on_cancelled()
        return heads

    def fair_order(
        self,
        running: Mapping[str, int],
        skip: Set[str] = frozenset(),
        places: int | None = None,
        recent_s: float = 0.0,
    ) -> list[str]:
        """Tenants with waiting work that may run one more request, the least served first: least
        recent work (charged tokens, plus `REQUEST_TOKENS` a running request and the one it would
        start) per unit of weight. With `places`, a tenant at its share of them (`place_shares`) may
        not run one more."""
        with self._lock:
            heads = [(tenant, queue[0].submitted) for tenant, queue in self._queues.items() if queue]
        shares = self.place_shares(places, running, recent_s) if places is not None else {}
        order = []
        for tenant, since in heads:
            limits = self.limits_of(tenant)
            now = running.get(tenant, 0)
            at_max = limits.max_running is not None and now >= limits.max_running
            if tenant in skip or at_max or now >= shares.get(tenant, now + 1):
                continue
            work = self.ledger.work(tenant) + (now + 1) * REQUEST_TOKENS
            order.append((work / limits.weight, since, tenant))
        return [tenant for *_, tenant in sorted(order)]

    def place_shares(self, places: int, running: Mapping[str, int], recent_s: float) -> dict[str, int]:
        """Each active tenant's weighted share of `places` (at least one), where more than one is
        active: waiting here, running (`running`) or charged within `recent_s`. Empty: one alone."""
        active = self._active(running, recent_s)
        if len(active) < 2:
            return {}
        weights = {t: self.limits_of(t).weight for t in active}
        total = sum(weights.values())
        return {t: max(1, int(places * w / total)) for t, w in weights.items()}

    def busier(self, tenant: str, running: Iterable[str], recent_s: float) -> bool:
        """Whether another active tenant (waiting here, in `running`, or charged within `recent_s`)
        has less recent work per weight than `tenant`: whatever `tenant`'s work holds up in a step,
        that tenant's next request or token waits for."""
        others = self._active({t: 1 for t in running}, recent_s) - {tenant}
        mine = self.ledger.usage(tenant)
        return any(self.ledger.usage(t) < mine for t in others)

    def _active(self, running: Mapping[str, int], recent_s: float) -> set[str]:
        busy = {t for t, n in running.items() if n > 0}
        return self.tenants() | busy | (self.ledger.recent(recent_s) if recent_s > 0 else set())

    def items(self) -> list[Request]:
        """Every waiting item (a copy, safe from any thread)."""
        with self._lock:
            return [item for queue in self._queues.values() for item in queue]

    def _retry_after(self, ahead: int) -> int:
        """Seconds a client is told to wait: grows with the line ahead of it, within [1, 30]."""
        return max(1, min(30, ahead // 64))
