"""The running requests' face of the cache: slots a packed forward writes into before they are shared.

The batched engine (`kvblocks.engine`) reserves pool slots for a request's own tokens, writes their
KV there during its forwards, and at the end hands them to the trie (`adopt`, no copy) or back to the
pool (`release_slots`). `hold` locks what a request just adopted so it is not evicted under it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvblocks.cache.hit import Hit
from kvblocks.cache.radix import SLOT_DTYPE

if TYPE_CHECKING:
    from kvblocks.cache.trie import PrefixCache, Salt, TokenIds


class PoolFullError(MemoryError):
    """The pool cannot hand out the slots asked for: everything resident is locked or pinned."""


class RunningSlots:
    """Slot ownership between running requests and the trie of one cache (under the cache's lock)."""

    def __init__(self, cache: PrefixCache) -> None:
        self._cache = cache

    def reserve(self, n: int) -> np.ndarray:
        """`n` free pool slots for a running request's own tokens, evicting unlocked, unpinned tokens
        to make room; the caller owns them until it passes them to `adopt` or `release_slots`.
        Raises PoolFullError (nothing taken) when too much is locked or pinned."""
        cache, pool = self._cache, self._cache.pool
        with cache._lock:
            if n > pool.num_free:
                cache._evict(n - pool.num_free)
            if n > pool.num_free:
                raise PoolFullError(f"{n} slots asked for, {pool.num_free} free after eviction")
            return pool.alloc(n)

    def evictable_tokens(self) -> int:
        """Resident tokens neither locked nor pinned: what `reserve` may evict beyond the free slots
        (a walk of the whole tree)."""
        with self._cache._lock:
            return sum(
                len(n.tokens) + (0 if n.snap is None else len(n.snap))
                for n in self._cache._tree.iter_nodes()
                if n.lock_ref == 0 and n.pin_ref == 0
            )

    def hold(self, token_ids: TokenIds, *, salt: Salt = None) -> Hit:
        """Lock the whole resident prefix of `token_ids` (no token left out, nothing counted as a
        lookup): a running request keeps what it just adopted from being evicted under it."""
        cache = self._cache
        ids, ns = cache.key_of(token_ids, salt)
        with cache._lock:
            m = cache._tree.match(ns.key, ids, create=False)
            return Hit(cache, ns, m, m.length)

    def release_slots(self, slots: np.ndarray) -> None:
        """Give back slots from `reserve` that hold nothing worth keeping (a rejected draft's, a
        cancelled request's)."""
        with self._cache._lock:
            self._cache.pool.release(np.asarray(slots, dtype=SLOT_DTYPE))

    def adopt(self, token_ids: TokenIds, slots: np.ndarray, start: int, *, salt: Salt = None) -> int:
        """Store a request's KV without copying it: `slots[i]` holds position `i` of `token_ids` in
        this pool. Positions before `start` are the tree's own (the request's locked hit, which the
        caller still holds); the slots from `start` on are the caller's (from `reserve`) and all pass
        to the cache: those of positions another request stored meanwhile are freed, the rest become
        the tree's. Returns how many tokens were attached."""
        cache = self._cache
        ids, ns = cache.key_of(token_ids, salt)
        slots = np.asarray(slots, dtype=SLOT_DTYPE)
        if len(slots) != len(ids) or not 0 <= start <= len(ids):
            raise ValueError(f"{len(ids)} tokens need as many slots and 0 <= start <= {len(ids)}")
        with cache._lock:
            m = cache._tree.match(ns.key, ids)
            if m.length < start:
                raise ValueError(f"only {m.length} of the {start} tokens before `start` are resident")
            cache.pool.release(slots[start : m.length])
            if m.length == len(ids):
                return 0
            cache._counters.seen(ns)
            cache._attach(ns, m, ids, slots[m.length :])
        if cache.spill is not None:
            cache.spill.on_insert(ns.key, ids, m.length)
        return len(ids) - m.length
