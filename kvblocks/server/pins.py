"""`cache_control` hints: a prompt prefix a client asked to keep is pinned in the trie for its TTL.

Pins are per tenant and bounded twice: in count (`MAX_PINS_PER_TENANT`, oldest released first)
and in tokens, by the tenant's share of the trie's cap on pinned tokens (`max_pinned_tokens`):
`cap x weight / sum of the weights of every tenant the keys file names` (an open server has one
tenant, which may use the whole cap). The shares sum to the cap, so one tenant's pins can never
refuse another's within that other's share. The shares are of the configured tenants, not of those
pinning now: a share that moved with who pins would have to be taken back from a tenant already
holding it, and an unused share wastes nothing (unpinned tokens stay cached, evictable).

A hint beyond a share (or the cap) is not honoured: the answer stands, the prefix stays evictable,
the refusal is counted per tenant and logged once per tenant. A pin is released by a timer on the
event loop when its TTL ends; a repeated hint for the same prefix extends it instead of pinning it
twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvblocks.cache.trie import PinLimitError

MAX_PINS_PER_TENANT = 8
log = logging.getLogger("kvblocks.server")


@dataclass(slots=True)
class _Pin:
    ids: tuple[int, ...]
    salt: object
    timer: asyncio.TimerHandle


@dataclass(slots=True)
class PrefixPins:
    """The live pins of every tenant, oldest first. `weights`: every configured tenant's weight."""

    cache: object
    weights: dict[str, float] = field(default_factory=lambda: {"": 1.0})
    max_per_tenant: int = MAX_PINS_PER_TENANT
    refused: Counter = field(default_factory=Counter)  # hints not honoured, by tenant
    _pins: dict[object, OrderedDict] = field(default_factory=dict)

    def share(self, tenant: str) -> int:
        """The most tokens `tenant`'s pins may hold."""
        weight = self.weights.get(tenant, 1.0)
        total = sum(self.weights.values()) + (0.0 if tenant in self.weights else weight)
        return int(self.cache.max_pinned_tokens * weight / total)

    def pinned(self, tenant: str) -> int:
        """The tokens `tenant`'s pins hold (a prefix that two of its pins share counts once)."""
        return held(self._pins.get(tenant, {}).values())

    def pinned_by_tenant(self) -> dict[str, int]:
        """Read by /metrics from a worker thread: each dict is copied in one C call under the GIL."""
        return {tenant: held(list(pins.values())) for tenant, pins in dict(self._pins).items()}

    def keep(self, ids: list[int], salt, tenant, ttl_s: float) -> int:
        """Pin the resident part of `ids` for `ttl_s` seconds; returns the pinned length (0 when
        nothing was resident or the hint was refused)."""
        pins = self._pins.setdefault(tenant, OrderedDict())
        loop = asyncio.get_running_loop()
        key = (salt, tuple(ids))
        if key in pins:
            pins[key].timer.cancel()
            pins.move_to_end(key)
            pins[key].timer = loop.call_later(ttl_s, self.release, tenant, key)
            return len(pins[key].ids)
        try:
            length = self.cache.pin(ids, salt=salt)
        except PinLimitError as exc:
            self._refuse(tenant, str(exc))
            return 0
        if length == 0:
            return 0
        pin = _Pin(tuple(ids[:length]), salt, loop.call_later(ttl_s, self.release, tenant, key))
        wanted, share = held([*pins.values(), pin]), self.share(tenant)
        if wanted > share:  # pinned first to learn what is resident: undone at once
            pin.timer.cancel()
            self.cache.unpin(list(pin.ids), salt=salt)
            self._refuse(tenant, f"its pins would hold {wanted} tokens, over its share of {share}")
            return 0
        pins[key] = pin
        while len(pins) > self.max_per_tenant:
            self.release(tenant, next(iter(pins)))
        return length

    def release(self, tenant, key) -> None:
        pin = self._pins.get(tenant, {}).pop(key, None)
        if pin is None:
            return
        pin.timer.cancel()
        self.cache.unpin(list(pin.ids), salt=pin.salt)

    def _refuse(self, tenant: str, why: str) -> None:
        if not self.refused[tenant]:
            log.warning(
                "kvblocks: cache_control prefix of tenant '%s' not pinned: %s (logged once per tenant; "
                "kvblocks_tenant_pins_refused_total counts them)",
                tenant,
                why,
            )
        self.refused[tenant] += 1


def held(pins: Iterable[_Pin]) -> int:
    """Tokens pinned by `pins`: per namespace, the size of the trie of their prefixes, which is the
    sum of their lengths less what each shares with its predecessor in sorted order."""
    by_salt: dict[object, list[tuple[int, ...]]] = defaultdict(list)
    for pin in pins:
        by_salt[pin.salt].append(pin.ids)
    total = 0
    for prefixes in by_salt.values():
        previous: tuple[int, ...] = ()
        for ids in sorted(prefixes):
            shared = next((i for i, (a, b) in enumerate(zip(previous, ids)) if a != b), None)
            total += len(ids) - (min(len(previous), len(ids)) if shared is None else shared)
            previous = ids
    return total
