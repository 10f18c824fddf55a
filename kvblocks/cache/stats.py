"""Counters and reports: what the cache has done (for each tenant too) and what it holds now.

Counters are totals since creation (as vLLM's `prefix_cache_queries` / `prefix_cache_hits`); rates
are for the reader to compute. The reports read the tree under the cache's lock and hand out plain
records (`CachedPrefix`, `TreeNode`) and lengths, which `inspection` and `explain` put into words.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

from kvblocks.cache.namespace import Namespace
from kvblocks.cache.radix import Node

if TYPE_CHECKING:
    from kvblocks.cache.layout import StateLayout
    from kvblocks.cache.resident import Resident


@dataclass(slots=True)
class Counters:
    queries: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    inserted_tokens: int = 0
    insert_dropped_tokens: int = 0
    evicted_tokens: int = 0
    spill_hit_tokens: int = 0
    spill_lost_tokens: int = 0
    snapshot_misses: int = 0  # lookups cut short because no snapshot ends where the match does
    snapshots_stored: int = 0
    snapshots_evicted: int = 0
    snapshot_dropped: int = 0  # snapshots that found no room (everything locked or pinned)
    lookup_errors: int = 0  # lookups that failed and were served as misses (match_or_miss)


# what `stats()` reports of the counters, in its order, and what it adds on a recurrent model
TOTALS = (
    "queries",
    "queried_tokens",
    "hit_tokens",
    "inserted_tokens",
    "insert_dropped_tokens",
    "evicted_tokens",
)
SPILL_TOTALS = ("spill_hit_tokens", "spill_lost_tokens", "lookup_errors")
SNAPSHOT_TOTALS = ("snapshots_stored", "snapshots_evicted", "snapshot_dropped", "snapshot_misses")
TENANT_TOTALS = ("queried_tokens", "hit_tokens", "spill_hit_tokens", "evicted_tokens")
assert {*TOTALS, *SPILL_TOTALS, *SNAPSHOT_TOTALS} == {f.name for f in fields(Counters)}


class TenantCounters:
    """The cache's counters and each tenant's, and the namespaces that have held KV here (a node's
    namespace key is all eviction knows; this map says which tenant to charge)."""

    def __init__(self) -> None:
        self.total = Counters()
        self.tenants: defaultdict[str, Counters] = defaultdict(Counters)
        self.namespaces: dict[str, Namespace] = {}

    def add(self, tenant: str | None, **deltas: int) -> None:
        """Count into the total and, when `tenant` is known, into that tenant's counters."""
        for c in (self.total,) if tenant is None else (self.total, self.tenants[tenant]):
            for name, delta in deltas.items():
                setattr(c, name, getattr(c, name) + delta)

    def seen(self, ns: Namespace) -> None:
        self.namespaces.setdefault(ns.key, ns)

    def tenant_of(self, namespace_key: str) -> str | None:
        ns = self.namespaces.get(namespace_key)
        return None if ns is None else ns.tenant

    def keys(self, tenant: str | None) -> list[str]:
        """Namespace keys that have held KV: all, or one tenant's."""
        return [k for k, ns in self.namespaces.items() if tenant is None or ns.tenant == tenant]

    def of(self, tenant: str | None) -> Counters:
        """The total, or one tenant's counters (zeros for a tenant never seen, which stays unseen)."""
        return self.total if tenant is None else self.tenants.get(tenant) or Counters()

    def by_tenant(self) -> dict[str, dict[str, int]]:
        return {t: {name: getattr(c, name) for name in TENANT_TOTALS} for t, c in self.tenants.items()}


@dataclass(slots=True, frozen=True)
class CachedPrefix:
    """A cached prefix for inspection: its namespace key, token ids from the start, hits, pinned."""

    namespace: str
    token_ids: np.ndarray
    hits: int
    pinned: bool


@dataclass(slots=True, frozen=True)
class TreeNode:
    """One node of the trie's shape for inspection; `run_ids` are the first 16 ids of its run."""

    id: int
    parent: int | None
    namespace: str
    first_token: int
    run: int
    prefix_length: int
    hits: int
    locked: bool
    pinned: bool
    run_ids: list[int]
    snapshot: bool = False  # a recurrent-state snapshot after its last token (hybrid models)


class Reports:
    """Read-only views of one cache: its stats, most-hit prefixes and shape, each under its lock."""

    def __init__(self, resident: Resident, state: StateLayout | None) -> None:
        r = resident
        self._lock, self._tree, self._pool, self._state = r.lock, r.tree, r.pool, state
        self._counters, self._ledger, self._resident = r.counters, r.ledger, r

    def stats(self, tenant: str | None = None) -> dict[str, int]:
        """Counters and occupancy: the whole trie's, or one tenant's (tokens of its namespaces);
        the whole trie's include the spill tier's and the events publisher's counters."""
        out = self._own_stats(tenant)
        if tenant is None and self._resident.spill is not None:
            out |= self._resident.spill.stats()
        if tenant is None and self._resident.events is not None:
            out |= self._resident.events.stats()
        return out

    def _own_stats(self, tenant: str | None) -> dict[str, int]:
        with self._lock:
            c = self._counters.of(tenant)
            nodes = self._tree.iter_nodes(None if tenant is None else self._counters.keys(tenant))
            resident = locked = pinned = count = 0
            for n in nodes:
                count += 1
                resident += len(n.tokens)
                locked += len(n.tokens) * (n.lock_ref > 0)
                pinned += len(n.tokens) * (n.pin_ref > 0)
            token_bytes, capacity = self._pool.slot_bytes, self._pool.capacity
            out = {name: getattr(c, name) for name in TOTALS}
            out |= {
                "resident_tokens": resident,
                "resident_bytes": resident * token_bytes,
                "capacity_tokens": capacity,
                "capacity_bytes": capacity * token_bytes,
                "free_tokens": self._pool.num_free,
                "pinned_tokens": pinned,
                "locked_tokens": locked,
                "nodes": count,
            }
            out |= {name: getattr(c, name) for name in SPILL_TOTALS}
            if self._state is not None:
                out |= self._snapshot_stats(c)
                if tenant is None:  # snapshots take pool slots too
                    out["resident_bytes"] += self._tree.snapshot_slots * token_bytes
            return out

    def _snapshot_stats(self, c: Counters) -> dict[str, int]:
        tree, state = self._tree, self._state
        assert state is not None
        out = {
            "snapshots": tree.snapshots,
            "snapshot_bytes": tree.snapshots * state.nbytes,
            "snapshot_slots": tree.snapshot_slots,
        }
        return out | {name: getattr(c, name) for name in SNAPSHOT_TOTALS}

    def tenant_counters(self) -> dict[str, dict[str, int]]:
        """Each tenant's lookup and eviction counters, without walking the tree (cheap at every scrape)."""
        with self._lock:
            return self._counters.by_tenant()

    def namespaces(self, tenant: str | None = None) -> list[Namespace]:
        """Namespaces that have held KV here: all, or one tenant's."""
        with self._lock:
            return [self._counters.namespaces[k] for k in self._counters.keys(tenant)]

    def evicted_length(self, namespace_key: str, ids: np.ndarray, after: int) -> int:
        """Longest prefix of `ids` beyond `after` tokens that was cached once and evicted."""
        with self._lock:
            return self._ledger.longest_evicted(namespace_key, ids, after)

    def other_namespace_lengths(
        self, ns: Namespace, ids: np.ndarray, all_tenants: bool = False
    ) -> dict[str, int]:
        """Resident prefix length of `ids` in every other namespace of `ns`'s tenant (of every tenant
        with `all_tenants`): other tenants' caches are not even an oracle."""
        with self._lock:
            keys = [k for k in self._counters.keys(None if all_tenants else ns.tenant) if k != ns.key]
            return {k: self._tree.match(k, ids, touch=False, create=False).length for k in keys}

    def top_prefixes(self, limit: int = 10, *, tenant: str | None = None) -> list[CachedPrefix]:
        """The most-hit cached prefixes (all, or one tenant's). One pass over the nodes keeps `limit`
        of them (no sort of the whole trie)."""
        with self._lock:
            nodes = heapq.nlargest(
                limit,
                self._tree.iter_nodes(self._counters.keys(tenant)),
                key=lambda n: (n.hits, n.last_access),
            )
            return [
                CachedPrefix(self._tree.namespace_of(n), self._tree.path(n)[0], n.hits, n.pin_ref > 0)
                for n in nodes
            ]

    def tree(self, max_nodes: int = 200, *, tenant: str | None = None) -> list[TreeNode]:
        """The trie's shape (all, or one tenant's), breadth-first: each node's parent, run length,
        prefix length, hits."""
        with self._lock:
            out: list[TreeNode] = []
            roots = self._tree.roots
            queue: list[tuple[str, int | None, Node, int]] = [
                (key, None, roots[key], 0) for key in self._counters.keys(tenant) if key in roots
            ]
            index: dict[int, int] = {}
            while queue and len(out) < max_nodes:
                key, parent, node, depth = queue.pop(0)
                if node.parent is not None:
                    index[id(node)] = len(out)
                    out.append(tree_node(len(out), parent, key, node, depth))
                child_depth = depth + len(node.tokens)
                for child in node.children.values():
                    queue.append((key, index.get(id(node)), child, child_depth))
            return out

    def event_nodes(self) -> list[tuple[int, np.ndarray]]:
        """Every node, parents first, as (its parent's index in the list, -1 under a namespace's root;
        a copy of its tokens). The events publisher reads it under the lock to republish the state."""
        out: list[tuple[int, np.ndarray]] = []
        for root in self._tree.roots.values():
            stack = [(-1, child) for child in root.children.values()]
            while stack:
                parent, node = stack.pop()
                out.append((parent, node.tokens.copy()))
                stack.extend((len(out) - 1, child) for child in node.children.values())
        return out


def tree_node(index: int, parent: int | None, namespace_key: str, node: Node, depth: int) -> TreeNode:
    return TreeNode(
        index,
        parent,
        namespace_key,
        int(node.tokens[0]),
        len(node.tokens),
        depth + len(node.tokens),
        node.hits,
        node.lock_ref > 0,
        node.pin_ref > 0,
        node.tokens[:16].tolist(),
        node.snap is not None,
    )
