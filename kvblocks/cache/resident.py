"""What is on the device: the radix tree and the pool slots it indexes, kept consistent under one lock.

Every room of a cache (`trie`, `snapshots`, `slots`, `spill_link`, `stats`) works through this one
object. It stores KV runs, attaches slots to the tree and evicts to make room; what leaves is
remembered for `explain`, announced to the events publisher and, in write-back mode, spilled first.
Nothing here knows requests, salts or model frameworks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvblocks.cache.eviction import EvictionPolicy, make_policy
from kvblocks.cache.explain import EvictionLedger
from kvblocks.cache.layout import KVLayout
from kvblocks.cache.namespace import Namespace
from kvblocks.cache.pool import KVPool
from kvblocks.cache.radix import Match, Node, RadixTree
from kvblocks.cache.stats import TenantCounters

if TYPE_CHECKING:
    from kvblocks.spill.stack import TierStack
    from kvblocks.telemetry.kv_events import KVEventPublisher

# (start, end) -> per-layer [end - start, 2, H, D] KV, None for layers that cache nothing
KVSource = Callable[[int, int], list[torch.Tensor | None]]


class PinLimitError(ValueError):
    """Pinning this prefix would exceed the trie's cap on pinned tokens."""


class Resident:
    """The tree, the pool, the lock that guards both, and the counters of what they did."""

    def __init__(
        self,
        layout: KVLayout,
        capacity_tokens: int,
        device: torch.device | str,
        arena_bytes: int,
        eviction: str | EvictionPolicy | None,
        spill: TierStack | None,
    ) -> None:
        self.layout = layout
        self.pool = KVPool(layout, capacity_tokens, device, arena_bytes=arena_bytes)
        self.tree = RadixTree(make_policy(eviction))
        self.lock = threading.RLock()
        self.counters = TenantCounters()
        self.ledger = EvictionLedger()
        self.spill = spill
        self.events: KVEventPublisher | None = None
        # set by the snapshot room: a snapshot leaves the device (tree.evict's second hook)
        self.on_snapshot_drop: Callable[[Node], None] = lambda node: None

    def store(self, ns: Namespace, ids: np.ndarray, source: KVSource) -> tuple[int, int]:
        """Under the lock: store the KV of the not-yet-resident tail of `ids`, as much as fits;
        returns (first new position, count)."""
        m = self.tree.match(ns.key, ids)
        need = len(ids) - m.length
        if need <= 0:
            return m.length, 0
        self.counters.seen(ns)
        self.tree.lock(m.node, +1)  # the room made for the tail must not evict its head
        try:
            if need > self.pool.num_free:
                self.evict(need - self.pool.num_free)
            k = min(need, self.pool.num_free)
            self.counters.add(ns.tenant, insert_dropped_tokens=need - k)
            if k == 0:
                return m.length, 0
            start = m.length
            kv = source(start, start + k)
            slots = self.pool.alloc(k)
            self._write(slots, kv)
            self.attach(ns, m, ids[: start + k], slots)
            return start, k
        finally:
            self.tree.lock(m.node, -1)

    def _write(self, slots: np.ndarray, kv: list[torch.Tensor | None]) -> None:
        """Scatter `kv` into freshly allocated `slots`; on failure they go back to the pool."""
        try:
            index = self.pool.index(slots)
            for layer, data in enumerate(kv):
                if data is not None:
                    self.pool.scatter(layer, index, data[:, 0], data[:, 1])
        except BaseException:
            self.pool.release(slots)
            raise

    def attach(self, ns: Namespace, m: Match, ids: np.ndarray, slots: np.ndarray) -> None:
        """Under the lock: make `slots` (holding the KV of `ids[m.length:]`) the tree's, right after
        the match `m`, and report the store (events, counters)."""
        self.tree.extend(m, ids[m.length :], slots)
        if self.events is not None:
            self.events.stored(ids, m.length)
        self.counters.add(ns.tenant, inserted_tokens=len(slots))

    def reserve(self, n: int) -> np.ndarray | None:
        """Under the lock: `n` free slots, evicting to make room; None (nothing taken) if they cannot be had."""
        if n > self.pool.num_free:
            self.evict(n - self.pool.num_free)
        return self.pool.alloc(n) if n <= self.pool.num_free else None

    def evict(self, num_tokens: int) -> int:
        """Under the lock: free at least `num_tokens` slots; returns how many were freed (tokens, and
        the slots of recurrent-state snapshots that went)."""
        snapshot_slots = self.tree.snapshot_slots
        freed = self.tree.evict(num_tokens, self._before_trim, self.on_snapshot_drop)
        self.pool.release(freed)
        self.counters.total.evicted_tokens += len(freed) - (snapshot_slots - self.tree.snapshot_slots)
        return len(freed)

    def _before_trim(self, node: Node, count: int) -> None:
        """Remember what is evicted (for `explain`) and, in write-back mode, spill it first."""
        ns_key = self.tree.namespace_of(node)
        ids, slots = self.tree.path(node)
        self.ledger.record(ns_key, ids, len(ids) - count)
        tenant = self.counters.tenant_of(ns_key)
        if tenant is not None:  # the total counts freed slots once, in `evict`
            self.counters.tenants[tenant].evicted_tokens += count
        if self.spill is not None and self.spill.write_mode == "back":
            self.spill.on_evict(ns_key, ids, len(ids) - count, lambda a, b: self.gather(slots[a:b]))
        if self.events is not None:  # complete Redis chunks stay restorable (the shared tier)
            spill = self.spill
            chunk = spill.chunk_tokens if spill is not None and spill.shared else len(ids) + 1
            self.events.evicted(ids, len(ids) - count, len(ids) // chunk * chunk)

    def pin(self, namespace_key: str, ids: np.ndarray, cap: int) -> int:
        """Under the lock: pin the resident prefix of `ids` (split where it ends) unless the pinned
        tokens would then exceed `cap`; returns its length."""
        m = self.tree.match(namespace_key, ids, create=False)
        if m.length == 0:
            return 0
        added = self.tree.unpinned_tokens_on_path(m.node) - (len(m.node.tokens) - m.node_offset) * (
            m.node.pin_ref == 0
        )
        if self.tree.pinned_tokens + added > cap:
            raise PinLimitError(
                f"pinning {m.length} tokens would pin {self.tree.pinned_tokens + added}, over the cap of {cap}"
            )
        node = self.tree.split(m.node, m.node_offset)
        self.tree.pin(node, +1)
        return m.length

    def unpin(self, namespace_key: str, ids: np.ndarray) -> int:
        """Under the lock: undo one pin of exactly `ids`; returns its length (0 if it was not pinned)."""
        m = self.tree.match(namespace_key, ids, touch=False, create=False)
        node = m.node
        # Pin counts propagate to the root, so the pins that end exactly here are this node's
        # count minus its children's (splits preserve that difference).
        ends_here = node.pin_ref - sum(c.pin_ref for c in node.children.values())
        if m.length == 0 or m.node_offset != len(node.tokens) or ends_here <= 0:
            return 0
        self.tree.pin(node, -1)
        return m.length

    def clear(self) -> int:
        """Under the lock: evict every unlocked, unpinned token; returns how many went."""
        if self.events is not None:
            self.events.cleared()
        return self.evict(self.pool.capacity)

    def close(self) -> None:
        """Flush and close the spill tier (queued writes finish first) and the events publisher."""
        if self.spill is not None:
            self.spill.close()
        if self.events is not None:
            self.events.close()

    def gather(self, slots: np.ndarray) -> list[torch.Tensor | None]:
        """Each layer's KV `[n, 2, H, D]` at `slots` (None where a layer caches nothing)."""
        return self.pool.gather_all(self.pool.index(slots))
