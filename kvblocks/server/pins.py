"""`cache_control` hints: a prompt prefix a client asked to keep is pinned in the trie for its TTL.

Pins are per tenant and bounded (`MAX_PINS_PER_TENANT`, oldest released first), so one tenant's
hints cannot fill the cache with unevictable tokens. A pin is released by a timer on the event loop
when its TTL ends; a repeated hint for the same prefix extends it instead of pinning it twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
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
    """The live pins of every tenant, oldest first."""

    cache: object
    max_per_tenant: int = MAX_PINS_PER_TENANT
    _pins: dict[object, OrderedDict] = field(default_factory=dict)

    def keep(self, ids: list[int], salt, tenant, ttl_s: float) -> int:
        """Pin the resident part of `ids` for `ttl_s` seconds; returns the pinned length."""
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
        except PinLimitError as exc:  # a hint, not an order: the answer stands, the prefix stays evictable
            log.warning("kvblocks: cache_control prefix not pinned: %s", exc)
            return 0
        if length == 0:
            return 0
        pins[key] = _Pin(tuple(ids[:length]), salt, loop.call_later(ttl_s, self.release, tenant, key))
        while len(pins) > self.max_per_tenant:
            self.release(tenant, next(iter(pins)))
        return length

    def release(self, tenant, key) -> None:
        pin = self._pins.get(tenant, {}).pop(key, None)
        if pin is None:
            return
        pin.timer.cancel()
        self.cache.unpin(list(pin.ids), salt=pin.salt)
