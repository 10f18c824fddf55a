"""The running requests' face of the cache: slots a packed forward writes into before they are shared.

The batched engine (`kvblocks.engine`) reserves pool slots for a request's own tokens, writes their
KV there during its forwards, and at the end hands them to the trie (`adopt`, no copy) or back to the
pool (`release_slots`); `PrefixCache.hold` then locks what it adopted so it is not evicted under it.
"""

from __future__ import annotations

import numpy as np

from kvblocks.cache.namespace import Namespace
from kvblocks.cache.radix import SLOT_DTYPE
from kvblocks.cache.resident import Resident


class PoolFullError(MemoryError):
    """The pool cannot hand out the slots asked for: everything resident is locked or pinned."""


class RunningSlots:
    """Slot ownership between running requests and the tree (under the resident's lock)."""

    def __init__(self, resident: Resident) -> None:
        self._resident = resident

    def reserve(self, n: int) -> np.ndarray:
        """`n` free pool slots for a running request's own tokens, evicting unlocked, unpinned tokens
        to make room; the caller owns them until it passes them to `adopt` or `release_slots`.
        Raises PoolFullError (nothing taken) when too much is locked or pinned."""
        r = self._resident
        with r.lock:
            slots = r.reserve(n)
            if slots is None:
                raise PoolFullError(f"{n} slots asked for, {r.pool.num_free} free after eviction")
            return slots

    def evictable_tokens(self) -> int:
        """Resident tokens neither locked nor pinned: what `reserve` may evict beyond the free slots
        (a walk of the whole tree)."""
        with self._resident.lock:
            return sum(
                len(n.tokens) + (0 if n.snap is None else len(n.snap))
                for n in self._resident.tree.iter_nodes()
                if n.lock_ref == 0 and n.pin_ref == 0
            )

    def release_slots(self, slots: np.ndarray) -> None:
        """Give back slots from `reserve` that hold nothing worth keeping (a rejected draft's, a
        cancelled request's)."""
        with self._resident.lock:
            self._resident.pool.release(np.asarray(slots, dtype=SLOT_DTYPE))

    def adopt(self, ns: Namespace, ids: np.ndarray, slots: np.ndarray, start: int) -> int:
        """Store a request's KV without copying it: `slots[i]` holds position `i` of `ids` in this
        pool. Positions before `start` are the tree's own (the request's locked hit, which the caller
        still holds); the slots from `start` on are the caller's (from `reserve`) and all pass to the
        cache: those of positions another request stored meanwhile are freed, the rest become the
        tree's. Returns how many tokens were attached."""
        r = self._resident
        slots = np.asarray(slots, dtype=SLOT_DTYPE)
        if len(slots) != len(ids) or not 0 <= start <= len(ids):
            raise ValueError(f"{len(ids)} tokens need as many slots and 0 <= start <= {len(ids)}")
        with r.lock:
            m = r.tree.match(ns.key, ids)
            if m.length < start:
                raise ValueError(f"only {m.length} of the {start} tokens before `start` are resident")
            r.pool.release(slots[start : m.length])
            if m.length == len(ids):
                return 0
            r.counters.seen(ns)
            r.attach(ns, m, ids, slots[m.length :])
        if r.spill is not None:
            r.spill.on_insert(ns.key, ids, m.length)
        return len(ids) - m.length
