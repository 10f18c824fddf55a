"""The tenant ledger: the engine work done for each tenant lately, in tokens, per unit of weight.

Fair shares are shares of work, and work is tokens: a tenant flooding with long prompts costs the
engine far more than one sending short ones, whatever their running counts. The scheduler charges
each step's prefill and decode tokens here; work done outside the packed step (tokenizing a prompt,
filling KV blocks) is charged by whoever does it, through `charge`; work measured in seconds (a tenant's
time at the tokenizing gate) through `charge_time`, at the engine's own rate of tokens per second, so a
second of tokenizing weighs what a second of the engine's work does. A charge decays with a half-life
(`usage` is exponentially weighted recent work, as in weighted fair queuing with decay), so a tenant
that was busy a minute ago is not held back now, and one that was idle does not bank credit.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

HALF_LIFE_S = 5.0  # how fast past work stops counting against a tenant
MAX_TENANTS = 4096  # entries kept before the negligible ones are dropped
START_RATE = 500.0  # tokens per second `charge_time` assumes before the engine has timed a step
STEP_MEMORY = 0.98  # a timed step's weight in the rate, per later step (about the last 50 steps count)


class TenantLedger:
    """Decayed tokens of work per tenant. `charge` may be called from any thread."""

    def __init__(
        self,
        weight_of: Callable[[str], float] = lambda tenant: 1.0,
        half_life_s: float = HALF_LIFE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if half_life_s <= 0:
            raise ValueError(f"need half_life_s > 0, got {half_life_s}")
        self.weight_of = weight_of
        self.rate = math.log(2) / half_life_s
        self.clock = clock
        self._work: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, when they were decayed to)
        self._lock = threading.Lock()
        self._timed = (0.0, 0.0)  # the engine's decayed (tokens, seconds) of its timed steps

    def ran(self, tokens: int, seconds: float) -> None:
        """The engine did `tokens` of work in `seconds` (one step): what `tokens_per_second` follows.
        Older steps weigh less (`STEP_MEMORY`), so the rate follows the machine's load."""
        if tokens <= 0 or seconds <= 0:
            return
        done, spent = self._timed
        self._timed = (done * STEP_MEMORY + tokens, spent * STEP_MEMORY + seconds)

    def tokens_per_second(self) -> float:
        """The engine's recent rate of work (START_RATE until it has timed a step)."""
        done, spent = self._timed
        return done / spent if spent > 0 else START_RATE

    def charge_time(self, tenant: str, seconds: float) -> None:
        """`seconds` of work outside the engine were done for `tenant`: charged as the tokens the
        engine does in that time. Tokenizing a token takes microseconds and computing it milliseconds,
        so charging tokenized tokens as computed ones would make a tenant that resends a long cached
        prompt look a thousand times busier than the engine's work for it."""
        self.charge(tenant, seconds * self.tokens_per_second())

    def charge(self, tenant: str, tokens: float) -> None:
        """`tokens` of work were done for `tenant` (prefill, decode, tokenizing, KV block fills)."""
        if tokens <= 0:
            return
        now = self.clock()
        with self._lock:
            if tenant not in self._work and len(self._work) >= MAX_TENANTS:
                self._forget(now)
            self._work[tenant] = (self._decayed(tenant, now) + tokens, now)

    def work(self, tenant: str) -> float:
        """`tenant`'s recent work in tokens (each charge decayed by its age)."""
        now = self.clock()
        with self._lock:
            return self._decayed(tenant, now)

    def usage(self, tenant: str) -> float:
        """Recent work per unit of weight: the least served tenant has the smallest."""
        return self.work(tenant) / self.weight_of(tenant)

    def recent(self, within_s: float) -> set[str]:
        """The tenants charged within the last `within_s` seconds."""
        since = self.clock() - within_s
        with self._lock:
            return {tenant for tenant, (_, then) in self._work.items() if then >= since}

    def _decayed(self, tenant: str, now: float) -> float:
        tokens, then = self._work.get(tenant, (0.0, now))
        return tokens * math.exp(-self.rate * (now - then))

    def _forget(self, now: float) -> None:
        """Drop tenants whose work decayed below a token, else the least busy one (lock held): the
        map stays bounded whatever tenants are named."""
        for tenant in [t for t in self._work if self._decayed(t, now) < 1.0]:
            del self._work[tenant]
        if len(self._work) >= MAX_TENANTS:
            del self._work[min(self._work, key=lambda t: self._decayed(t, now))]
