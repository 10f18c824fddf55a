"""The prefix cache core: a radix tree over token ids and a device KV pool, under one lock.

`PrefixCache` matches, stores, evicts and pins; it takes layer specs and tensors and never looks
into a framework's cache: a `PastBridge` (`kvblocks.cache.bridge`) injected at construction reads
KV out of one and builds one for a hit. `kvblocks.KVCacheTrie` (`kvblocks.adapters.hf_trie`) is this
class with the transformers bridge. Its rooms, each in its own module, work through one `Resident`
(tree, pool, lock): `snapshots` (recurrent-state policy and storage), `slots` (running requests'
slots), `reports` (counters, stats, inspection), `spill_link` (Redis fetch and promotion); the
contract's names for the rooms' methods (`stats`, `reserve`, `adopt`, ...) are kept here.
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvblocks.cache.bridge import PastBridge
from kvblocks.cache.eviction import EvictionPolicy
from kvblocks.cache.hit import Hit
from kvblocks.cache.layout import KVLayout, LayerSpec, StateLayout
from kvblocks.cache.namespace import Namespace, Scope
from kvblocks.cache.pool import KVPool
from kvblocks.cache.radix import TOKEN_DTYPE
from kvblocks.cache.resident import PinLimitError, Resident
from kvblocks.cache.slots import PoolFullError, RunningSlots
from kvblocks.cache.snapshots import DEFAULT_SNAPSHOT_EVERY, SnapshotPlan, Snapshots
from kvblocks.cache.spill_link import SpillLink
from kvblocks.cache.stats import Reports
from kvblocks.telemetry import tracing

if TYPE_CHECKING:
    from kvblocks.spill.stack import TierStack
    from kvblocks.telemetry.kv_events import KVEventPublisher

__all__ = ["Hit", "PinLimitError", "PoolFullError", "PrefixCache", "Salt", "TokenIds", "as_token_array"]

# A model with no attention layer has no KV memory to hold snapshots; its slots get this much.
STATE_ARENA_BYTES = 256

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
# A request's place inside the model's namespace: a plain cache salt, or a tenant and its salt.
Salt = str | Scope | None


def as_token_array(token_ids: TokenIds) -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() == 2 and token_ids.shape[0] == 1:
            token_ids = token_ids[0]
        if token_ids.dim() != 1:
            raise ValueError(
                f"token ids must be one sequence, got a tensor of shape {tuple(token_ids.shape)}"
            )
        token_ids = token_ids.cpu().numpy()
    return np.asarray(token_ids, dtype=TOKEN_DTYPE).reshape(-1)


class PrefixCache:
    """Token-prefix cache of KV tensors, shared by all requests to one model.

    Thread-safe: tree and pool bookkeeping run under one lock; gathers for a hit run outside it
    because the hit's lock keeps its slots from being reused. Redis reads also run outside it;
    what they return is promoted only if the device still holds the prefix it continues.

    Every lookup and mutation takes a `salt`: a cache salt, or a `Scope` (tenant + salt). Counters
    are kept per tenant too, and the inspection methods take `tenant=` to show one tenant only.
    """

    def __init__(
        self,
        specs: Sequence[LayerSpec],
        namespace: Namespace,
        *,
        bridge: PastBridge,
        capacity_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_pinned_tokens: int | None = None,
        spill: TierStack | None = None,
        eviction: str | EvictionPolicy | None = None,
        state: StateLayout | None = None,
        snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
    ) -> None:
        self.specs, self.namespace, self.state, self.bridge = list(specs), namespace, state, bridge
        # tokens every prefill forward takes (and a hit leaves uncached): 1, or 2 for a model whose
        # one-token step differs from its prefill
        self.min_prefill = bridge.min_prefill if state is not None else 1
        layout = KVLayout(dtype, tuple(specs))
        arena = STATE_ARENA_BYTES if state is not None and not layout.token_bytes() else 0
        self.resident = r = Resident(layout, capacity_tokens, device, arena, eviction, spill)
        self._tree, self._pool, self._lock, self._counters = r.tree, r.pool, r.lock, r.counters
        self.max_pinned_tokens = capacity_tokens // 2 if max_pinned_tokens is None else max_pinned_tokens
        self.spill = spill
        self.snapshots = Snapshots(state, snapshot_every, self.min_prefill, r)
        r.on_snapshot_drop = self.snapshots.dropped
        self.slots = RunningSlots(r)
        self.reports = Reports(r, state)
        self._spill = SpillLink(r, recurrent=state is not None)
        if spill is not None:
            spill.bind(layout, r.pool.device, self._spill.read_kv, namespace.key, state)

    def key_of(self, token_ids: TokenIds, salt: Salt) -> tuple[np.ndarray, Namespace]:
        """The ids as an array and the namespace they are looked up in."""
        return as_token_array(token_ids), self.namespace.with_salt(salt)

    # ---- lookups ---------------------------------------------------------------------------

    def match(self, token_ids: TokenIds, *, salt: Salt = None, whole: bool = False) -> Hit:
        """Lock the longest cached prefix of `token_ids`, leaving at least the last token uncached.

        At least one token is always recomputed so the model produces logits for the next one. On
        a device miss the spill tier is asked for the chunks that follow, which are verified and
        promoted into the pool first. With `whole`, no token is left out: a KV block
        (`kvblocks.blocks`) is read back, never continued, so all of it may hit.
        """
        ids, ns = self.key_of(token_ids, salt)
        limit = len(ids) if whole else max(len(ids) - self.min_prefill, 0)
        fetched, state = self._spill.fetch(ns, ids, limit) if self.spill is not None else (None, None)
        with self._lock:
            if fetched is not None:
                self._spill.promote(ns, ids[:limit], fetched)
            if state is not None:
                self.snapshots.store(ns, ids[: state[0]], state[1])
            m = self._tree.match(ns.key, ids[:limit], create=False)
            matched = m.length
            if self.state is not None:
                m = m.snapshot_prefix()
            self._counters.add(
                ns.tenant,
                queries=1,
                queried_tokens=len(ids),
                hit_tokens=m.length,
                snapshot_misses=m.length < matched,
            )
            hit = Hit(self, ns, m, m.length, matched)
            if fetched is not None:
                hit.tiers = dict(fetched.tiers)
            return hit

    def match_or_miss(self, token_ids: TokenIds, *, salt: Salt = None) -> Hit:
        """`match`, where any failure of the lookup (a spill tier fault, a bad namespace) is an empty
        hit: the request then prefills in full, and the fault stays with this lookup (its traceback
        on stderr, `lookup_errors` counted)."""
        with tracing.child("match") as span:
            try:
                hit = self.match(token_ids, salt=salt)
            except Exception:
                traceback.print_exc()
                with self._lock:
                    self._counters.add(None, lookup_errors=1)
                hit = self.hold([], salt=salt)
                tracing.annotate(span, lookup_error=True)
            tracing.annotate(span, cached_tokens=hit.length, namespace=hit.namespace.key)
            return hit

    def cached_length(self, token_ids: TokenIds, *, salt: Salt = None, servable: bool = False) -> int:
        """Resident prefix length of `token_ids`, without locking, counting or refreshing LRU; with
        `servable`, only up to the last recurrent-state snapshot (what a hit can use)."""
        ids, ns = self.key_of(token_ids, salt)
        with self._lock:
            m = self._tree.match(ns.key, ids, touch=False, create=False)
            if servable and self.state is not None:
                m = m.snapshot_prefix()
            return m.length

    def continuation(self, token_ids: TokenIds, max_tokens: int, *, salt: Salt = None) -> list[int]:
        """Tokens the trie holds right after all of `token_ids` (empty unless all are resident)."""
        ids, ns = self.key_of(token_ids, salt)
        with self._lock:
            m = self._tree.match(ns.key, ids, touch=False, create=False)
            if m.length < len(ids) or max_tokens <= 0:
                return []
            tokens: list[int] = self._tree.continuation(m, max_tokens).tolist()
            return tokens

    def continuations(
        self, token_ids: TokenIds, budget: int, depth: int, width: int, *, salt: Salt = None
    ) -> tuple[list[int], list[int]]:
        """The tree of tokens the trie holds after all of `token_ids` (`Radix.continuations`):
        (tokens, parents) in depth-first order; empty unless all of `token_ids` are resident."""
        ids, ns = self.key_of(token_ids, salt)
        with self._lock:
            m = self._tree.match(ns.key, ids, touch=False, create=False)
            if m.length < len(ids) or budget <= 0:
                return [], []
            return self._tree.continuations(m, budget, depth, width)

    def snapshot(self, token_ids: TokenIds, *, salt: Salt = None) -> torch.Tensor | None:
        """The recurrent-state snapshot kept after exactly `token_ids` (a copy), or None."""
        ids, ns = self.key_of(token_ids, salt)
        with self._lock:
            return self.snapshots.read(ns.key, ids)

    def snapshot_plan(self, start: int, prompt_length: int, matched: int) -> SnapshotPlan:
        """Where a request prefilling [start, prompt_length) snapshots its state, and the states it
        takes (`SnapshotPlan.after_forward`, one call per forward); empty without recurrent state."""
        return self.snapshots.plan(start, prompt_length, matched, self.bridge.capture)

    # ---- mutations -------------------------------------------------------------------------

    def insert(
        self,
        token_ids: TokenIds,
        past: Any,
        *,
        salt: Salt = None,
        snapshots: dict[int, torch.Tensor] | None = None,
    ) -> int:
        """Store the KV of the tokens of `token_ids` not cached yet; returns how many were stored.

        `past` is a framework cache (read through the bridge) whose first positions are `token_ids`;
        tokens beyond its length (e.g. the last sampled one) are skipped. When eviction cannot make
        room (too much locked or pinned) only the leading part that fits is stored. `snapshots` maps
        positions to recurrent-state snapshots taken there; those at resident positions without one
        are stored too. Without `snapshots`, a hybrid model's `past` is snapshotted where it stands
        when all of it is stored; a model without attention layers has no length to check that
        against and needs `snapshots` given.
        """
        ids, ns = self.key_of(token_ids, salt)
        held = self.bridge.length(past)
        n = len(ids) if held is None else min(len(ids), held)
        if snapshots is None and self.state is not None and held is not None and n == held:
            snapshots = {n: self.bridge.capture(past)}  # the state `past` stands at
        with self._lock:
            start, stored = self.resident.store(ns, ids[:n], lambda a, b: self.bridge.extract(past, a, b))
            kept = {p: blob for p, blob in (snapshots or {}).items() if 0 < p <= n}
            saved = {p: kept[p] for p in sorted(kept) if self.snapshots.store(ns, ids[:p], kept[p])}
        if self.spill is not None:
            self._spill.stored(ns, ids, start, stored, saved)
        return stored

    def evict(self, num_tokens: int) -> int:
        """Free up to `num_tokens` least-recently-used unlocked, unpinned tokens."""
        with self._lock:
            return self.resident.evict(num_tokens)

    def pin(self, token_ids: TokenIds, *, salt: Salt = None) -> int:
        """Exempt the resident prefix of `token_ids` from eviction; returns the pinned length L.

        Release it with `unpin` of exactly those L tokens (`token_ids[:L]`). Raises PinLimitError
        past `max_pinned_tokens`.
        """
        ids, ns = self.key_of(token_ids, salt)
        with self._lock:
            return self.resident.pin(ns.key, ids, self.max_pinned_tokens)

    def unpin(self, token_ids: TokenIds, *, salt: Salt = None) -> int:
        """Undo one `pin` of exactly this prefix; returns the unpinned length (0 if it was not pinned)."""
        ids, ns = self.key_of(token_ids, salt)
        with self._lock:
            return self.resident.unpin(ns.key, ids)

    def clear(self) -> int:
        """Evict every unlocked, unpinned token (what `/flush_cache` asks for); returns how many went.
        Running requests keep their locked prefixes and pins stay: unpin a prefix to let it go."""
        with self._lock:
            return self.resident.clear()

    def attach_events(self, events: KVEventPublisher) -> None:
        """Publish KV events (`kvblocks.telemetry.kv_events`) for what this cache stores and evicts
        from now on; the publisher starts by announcing what is resident already."""
        with self._lock:
            events.bind(self.namespace.key, (self._lock, self.reports.event_nodes))
            self.resident.events = events

    def close(self) -> None:
        """Flush and close the spill tier (queued writes finish first) and the events publisher."""
        self.resident.close()

    # ---- the rooms' methods under the contract's names -------------------------------------

    def stats(self, *, tenant: str | None = None) -> dict[str, int]:
        """Counters since creation plus current occupancy; rates are for the reader to compute.

        With `tenant`, that tenant's own counters and tokens only (capacity is the server's);
        without, the whole trie plus the spill tier's and the events publisher's counters.
        """
        return self.reports.stats(tenant)

    def tenant_counters(self) -> dict[str, dict[str, int]]:
        return self.reports.tenant_counters()

    def reserve(self, n: int) -> np.ndarray:
        return self.slots.reserve(n)

    def evictable_tokens(self) -> int:
        return self.slots.evictable_tokens()

    def hold(self, token_ids: TokenIds, *, salt: Salt = None) -> Hit:
        """Lock the whole resident prefix of `token_ids` (no token left out, nothing counted as a
        lookup): a running request keeps what it just adopted from being evicted under it."""
        ids, ns = self.key_of(token_ids, salt)
        with self._lock:
            m = self._tree.match(ns.key, ids, create=False)
            return Hit(self, ns, m, m.length)

    def release_slots(self, slots: np.ndarray) -> None:
        self.slots.release_slots(slots)

    def adopt(self, token_ids: TokenIds, slots: np.ndarray, start: int, *, salt: Salt = None) -> int:
        ids, ns = self.key_of(token_ids, salt)
        return self.slots.adopt(ns, ids, slots, start)

    @property
    def pool(self) -> KVPool:
        """The device pool; a packed forward writes a running request's KV into slots from `reserve`."""
        return self._pool

    @property
    def token_bytes(self) -> int:
        return self._pool.token_bytes

    @property
    def eviction_policy(self) -> str:
        """What leaves a full pool first: `gdsf` or `lru` (`kvblocks.cache.eviction`)."""
        return self._tree.policy.name

    @property
    def pinned_tokens(self) -> int:
        return self._tree.pinned_tokens
