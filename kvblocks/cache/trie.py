"""KVCacheTrie: the prefix cache a model's requests share (radix tree + device KV pool)."""

from __future__ import annotations

import heapq
import threading
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvblocks.adapters import hf
from kvblocks.cache.eviction import EvictionPolicy, make_policy
from kvblocks.cache.explain import EvictionLedger
from kvblocks.cache.layout import KVLayout, LayerSpec, StateLayout
from kvblocks.cache.namespace import Namespace, Scope, namespace_for
from kvblocks.cache.pool import KVPool
from kvblocks.cache.radix import SLOT_DTYPE, TOKEN_DTYPE, Match, Node, RadixTree
from kvblocks.telemetry import tracing

if TYPE_CHECKING:
    from kvblocks.spill.redis_tier import Fetched, RedisTier
    from kvblocks.telemetry.kv_events import KVEventPublisher

DEFAULT_CAPACITY_BYTES = 1 << 30
# Recurrent and hybrid models: a snapshot of the recurrent state every this many tokens (besides
# the ends of prompts and replies, the position before a prompt's last token and branch points).
DEFAULT_SNAPSHOT_EVERY = 256
# A model with no attention layer has no KV memory to hold snapshots; its slots get this much.
STATE_ARENA_BYTES = 256

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
# A request's place inside the model's namespace: a plain cache salt, or a tenant and its salt.
Salt = str | Scope | None
# (start, end) -> per-layer [end - start, 2, H, D] KV, None for layers that cache nothing
KVSource = Callable[[int, int], list[torch.Tensor | None]]


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


class PinLimitError(ValueError):
    """Pinning this prefix would exceed the trie's cap on pinned tokens."""


class PoolFullError(MemoryError):
    """The pool cannot hand out the slots asked for: everything resident is locked or pinned."""


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


class Hit:
    """A locked match: the first `length` tokens are resident and stay so until `release()`."""

    def __init__(
        self, trie: KVCacheTrie, namespace: Namespace, match: Match, length: int, matched: int | None = None
    ) -> None:
        self.trie = trie
        self.namespace = namespace
        self.length = length
        # tokens resident on the device (on a recurrent model the hit stops at the last snapshot
        # before them; a request prefilling from `length` snapshots at `matched`, the branch point)
        self.matched = length if matched is None else matched
        self._match = match
        self._slots = match.slots(length)
        self._locked = length > 0
        if self._locked:
            trie._tree.lock(match.node, +1)

    @property
    def slots(self) -> np.ndarray:
        """The pool slots of the `length` hit tokens, in order (read-only; valid until `release()`)."""
        view = self._slots.view()
        view.flags.writeable = False
        return view

    def to_hf_cache(self):
        """A fresh transformers cache holding the KV of the `length` hit tokens."""
        if self.length and not self._locked:
            raise RuntimeError("this hit was released; its slots may already hold other tokens")
        return self.trie._build_cache(self._slots, self.length, self._match.node)

    def release(self) -> None:
        if self._locked:
            with self.trie._lock:
                self.trie._tree.lock(self._match.node, -1)
            self._locked = False

    def __enter__(self) -> Hit:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Hit(length={self.length}, locked={self._locked})"


class KVCacheTrie:
    """Token-prefix cache of KV tensors, shared by all requests to one model.

    Thread-safe: tree and pool bookkeeping run under one lock; gathers for a hit run outside it
    because the hit's lock keeps its slots from being reused. Redis reads also run outside it;
    what they return is promoted only if the device still holds the prefix it continues.

    Every lookup and mutation takes a `salt`: a cache salt, or a `Scope` (tenant + salt). Counters
    are kept per tenant too, and the inspection methods take `tenant=` to show one tenant only.
    """

    def __init__(
        self,
        config,
        specs: Sequence[LayerSpec],
        namespace: Namespace,
        *,
        capacity_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_pinned_tokens: int | None = None,
        spill: RedisTier | None = None,
        eviction: str | EvictionPolicy | None = None,
        state: StateLayout | None = None,
        snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
    ) -> None:
        if snapshot_every < 0:
            raise ValueError(
                f"snapshot_every must be >= 0 (0: only at prompt and reply ends), got {snapshot_every}"
            )
        self.config = config
        self.specs = list(specs)
        self.namespace = namespace
        self.state = state
        self.snapshot_every = snapshot_every
        # tokens every prefill forward takes (and a hit leaves uncached): 1, or 2 for a model whose
        # one-token step differs from its prefill (hf.MIN_PREFILL_TOKENS)
        self.min_prefill = hf.min_prefill_tokens(config) if state is not None else 1
        layout = KVLayout(dtype, tuple(specs))
        arena = STATE_ARENA_BYTES if state is not None and not layout.token_bytes() else 0
        self._pool = KVPool(layout, capacity_tokens, device, arena_bytes=arena)
        self._tree = RadixTree(make_policy(eviction))
        self._lock = threading.RLock()
        self._counters = Counters()
        self._tenant_counters: defaultdict[str, Counters] = defaultdict(Counters)
        self._namespaces: dict[str, Namespace] = {}
        self._ledger = EvictionLedger()
        self.max_pinned_tokens = capacity_tokens // 2 if max_pinned_tokens is None else max_pinned_tokens
        self.spill = spill
        if spill is not None:
            spill.bind(layout, self._pool.device, self._read_kv, namespace.key, state)
        self.events: KVEventPublisher | None = None

    @classmethod
    def for_model(
        cls,
        model,
        capacity_tokens: int | None = None,
        *,
        capacity_bytes: int | None = None,
        max_pinned_tokens: int | None = None,
        spill: RedisTier | None = None,
        eviction: str | EvictionPolicy | None = None,
        snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
    ) -> KVCacheTrie:
        """Probe the model's cache layout and preallocate a pool on its device and dtype.

        Capacity is `capacity_tokens`, or `capacity_bytes` of KV (default 1 GiB) divided by the
        bytes one token takes across all layers. `spill` adds a shared tier below the device
        pool (`RedisTier`). `eviction` orders what leaves a full pool: a `kvblocks.cache.eviction`
        policy or its name (`lru`, `gdsf`; default `gdsf`). On a recurrent or hybrid model the
        recurrent state is snapshotted every `snapshot_every` tokens (0: only where a request
        ends, branches or stops one token short), and the snapshots share the pool's capacity.
        """
        if capacity_tokens is not None and capacity_bytes is not None:
            raise ValueError("give capacity_tokens or capacity_bytes, not both")
        specs, state = hf.describe(model)
        param = next(model.parameters())
        if capacity_tokens is None:
            per_token = KVLayout(param.dtype, tuple(specs)).token_bytes() or STATE_ARENA_BYTES
            capacity_tokens = (capacity_bytes or DEFAULT_CAPACITY_BYTES) // per_token
        return cls(
            model.config,
            specs,
            namespace_for(model),
            capacity_tokens=capacity_tokens,
            dtype=param.dtype,
            device=param.device,
            max_pinned_tokens=max_pinned_tokens,
            spill=spill,
            eviction=eviction,
            state=state,
            snapshot_every=snapshot_every,
        )

    # ---- lookups ---------------------------------------------------------------------------

    def match(self, token_ids: TokenIds, *, salt: Salt = None) -> Hit:
        """Lock the longest cached prefix of `token_ids`, leaving at least the last token uncached.

        At least one token is always recomputed so the model produces logits for the next one. On
        a device miss the spill tier is asked for the chunks that follow, which are verified and
        promoted into the pool first.
        """
        ids = as_token_array(token_ids)
        ns = self.namespace.with_salt(salt)
        limit = max(len(ids) - self.min_prefill, 0)
        fetched = state = None
        if self.spill is not None:
            with self._lock:
                m = self._tree.match(ns.key, ids[:limit], touch=False, create=False)
                device = m.length
                servable = device if self.state is None else self._tree.snapshot_prefix(m).length
            self.spill.on_hit(ns.key, ids, device)  # rewrites chunks Redis lost, off this thread
            if device < limit:  # the Redis round trip runs unlocked: other threads go on meanwhile
                with tracing.child("redis.fetch", device_tokens=device) as span:
                    fetched = self.spill.fetch(ns.key, ids, device, limit)
                    tracing.annotate(span, redis_tokens=0 if fetched is None else fetched.length)
            if servable < limit and self.state is not None:  # a recurrent model needs a state there too
                reach = device if fetched is None else max(device, fetched.start + fetched.length)
                state = self.spill.fetch_state(ns.key, ids, servable, reach)
        with self._lock:
            if fetched is not None:
                self._promote(ns, ids[:limit], fetched)
            if state is not None:
                self._store_snapshot(ns, ids[: state[0]], state[1])
            m = self._tree.match(ns.key, ids[:limit], create=False)
            matched = m.length
            if self.state is not None:
                m = self._tree.snapshot_prefix(m)
            for c in self._counters, self._tenant_counters[ns.tenant]:
                c.queries += 1
                c.queried_tokens += len(ids)
                c.hit_tokens += m.length
                c.snapshot_misses += m.length < matched
            return Hit(self, ns, m, m.length, matched)

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
                    self._counters.lookup_errors += 1
                hit = self.hold([], salt=salt)
                tracing.annotate(span, lookup_error=True)
            tracing.annotate(span, cached_tokens=hit.length, namespace=hit.namespace.key)
            return hit

    def _promote(self, ns: Namespace, ids: np.ndarray, fetched: Fetched) -> None:
        """Store KV fetched from the spill tier, if the device still holds the prefix it continues.

        Another thread may have evicted part of that prefix while Redis answered: the fetched
        run then no longer starts where the resident prefix ends, and storing it would put its KV
        at the wrong positions. It is dropped instead (counted as lost; the request prefills).
        """
        before = self._tree.match(ns.key, ids, touch=False, create=False).length
        end = fetched.start + fetched.length
        if before < fetched.start:
            for c in self._counters, self._tenant_counters[ns.tenant]:
                c.spill_lost_tokens += fetched.length
            return
        _, stored = self._store(ns, ids[:end], self._slicer(fetched.start, fetched.kv))
        for c in self._counters, self._tenant_counters[ns.tenant]:
            c.spill_hit_tokens += stored

    def cached_length(self, token_ids: TokenIds, *, salt: Salt = None, servable: bool = False) -> int:
        """Resident prefix length of `token_ids`, without locking, counting or refreshing LRU; with
        `servable`, only up to the last recurrent-state snapshot (what a hit can use)."""
        ids = as_token_array(token_ids)
        with self._lock:
            m = self._tree.match(self.namespace.with_salt(salt).key, ids, touch=False, create=False)
            if servable and self.state is not None:
                m = self._tree.snapshot_prefix(m)
            return m.length

    def snapshot_points(self, start: int, prompt_length: int, matched: int) -> list[int]:
        """Where a request prefilling positions [start, prompt_length) stops to snapshot the
        recurrent state: every `snapshot_every` tokens, the branch point `matched` (where the
        resident tokens end; the next request sharing this prefix then hits there), the position
        before the last prompt token (a repeated prompt recomputes one token; two where
        `min_prefill` is 2, as no forward gets fewer), the prompt's end and, with a spill tier,
        the last chunk end before it (what Redis can hold). Empty for a model without recurrent
        state."""
        if self.state is None:
            return []
        every, least = self.snapshot_every, self.min_prefill
        points = {prompt_length - least, prompt_length, matched}
        if every:
            points.update(range((start // every + 1) * every, prompt_length, every))
        if self.spill is not None and self.spill.spills_state:
            # the last chunk end before the prompt's end: the spill tier keeps snapshots only
            # there, so another process resumes this prompt at most a chunk short of it
            chunk = self.spill.chunk_tokens
            points.add((prompt_length - least) // chunk * chunk)
        kept, previous = [], start
        for p in sorted(p for p in points if start < p <= prompt_length):
            if p - previous >= least and (p == prompt_length or prompt_length - p >= least):
                kept.append(p)
                previous = p
        return kept

    def wants_snapshot(self, position: int) -> bool:
        """Whether a decoding request snapshots its state after `position` tokens."""
        return self.state is not None and self.snapshot_every > 0 and position % self.snapshot_every == 0

    def continuation(self, token_ids: TokenIds, max_tokens: int, *, salt: Salt = None) -> list[int]:
        """Tokens the trie holds right after all of `token_ids` (empty unless all are resident)."""
        ids = as_token_array(token_ids)
        with self._lock:
            m = self._tree.match(self.namespace.with_salt(salt).key, ids, touch=False, create=False)
            if m.length < len(ids) or max_tokens <= 0:
                return []
            return self._tree.continuation(m, max_tokens).tolist()

    def evicted_length(self, token_ids: TokenIds, after: int, *, salt: Salt = None) -> int:
        """Longest prefix of `token_ids` beyond `after` tokens that was cached once and evicted."""
        ids = as_token_array(token_ids)
        with self._lock:
            return self._ledger.longest_evicted(self.namespace.with_salt(salt).key, ids, after)

    def other_namespace_lengths(
        self, token_ids: TokenIds, *, salt: Salt = None, all_tenants: bool = False
    ) -> dict[str, int]:
        """Resident prefix length of `token_ids` in every other namespace of the request's tenant
        (of every tenant with `all_tenants`): other tenants' caches are not even an oracle."""
        ids = as_token_array(token_ids)
        ns = self.namespace.with_salt(salt)
        with self._lock:
            keys = [k for k in self._namespace_keys(None if all_tenants else ns.tenant) if k != ns.key]
            return {k: self._tree.match(k, ids, touch=False, create=False).length for k in keys}

    def namespaces(self, tenant: str | None = None) -> list[Namespace]:
        """Namespaces that have held KV here: all, or one tenant's."""
        with self._lock:
            return [self._namespaces[k] for k in self._namespace_keys(tenant)]

    def _namespace_keys(self, tenant: str | None) -> list[str]:
        return [k for k, ns in self._namespaces.items() if tenant is None or ns.tenant == tenant]

    def top_prefixes(self, limit: int = 10, *, tenant: str | None = None) -> list[CachedPrefix]:
        """The most-hit cached prefixes (all, or one tenant's). One pass over the nodes keeps `limit`
        of them (no sort of the whole trie)."""
        with self._lock:
            nodes = heapq.nlargest(
                limit,
                self._tree.iter_nodes(self._namespace_keys(tenant)),
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
            queue = [(key, None, roots[key], 0) for key in self._namespace_keys(tenant) if key in roots]
            index = {}
            while queue and len(out) < max_nodes:
                key, parent, node, depth = queue.pop(0)
                if node.parent is not None:
                    index[id(node)] = len(out)
                    out.append(
                        TreeNode(
                            len(out),
                            parent,
                            key,
                            int(node.tokens[0]),
                            len(node.tokens),
                            depth + len(node.tokens),
                            node.hits,
                            node.lock_ref > 0,
                            node.pin_ref > 0,
                            node.tokens[:16].tolist(),
                            node.snap is not None,
                        )
                    )
                child_depth = depth + len(node.tokens)
                for child in node.children.values():
                    queue.append((key, index.get(id(node)), child, child_depth))
            return out

    # ---- mutations -------------------------------------------------------------------------

    def insert(
        self,
        token_ids: TokenIds,
        past,
        *,
        salt: Salt = None,
        snapshots: dict[int, torch.Tensor] | None = None,
    ) -> int:
        """Store the KV of the tokens of `token_ids` not cached yet; returns how many were stored.

        `past` is a transformers cache whose first positions are `token_ids`; tokens beyond its
        length (e.g. the last sampled one) are skipped. When eviction cannot make room (too much
        locked or pinned) only the leading part that fits is stored. `snapshots` maps positions
        to recurrent-state snapshots (`hf.capture_state`) taken there; those at resident
        positions without one are stored too. Without `snapshots`, a hybrid model's `past` is
        snapshotted where it stands when all of it is stored; a model without attention layers
        has no length to check that against and needs `snapshots` given.
        """
        ids = as_token_array(token_ids)
        held = hf.seq_length(past)
        n = len(ids) if held is None else min(len(ids), held)
        ns = self.namespace.with_salt(salt)
        if snapshots is None and self.state is not None and held is not None and n == held:
            snapshots = {n: hf.capture_state(past, self.state)}  # the state `past` stands at

        def source(start: int, end: int) -> list[torch.Tensor | None]:
            return [
                None if kv is None else torch.stack(kv, dim=1)
                for kv in hf.extract(past, self.specs, start, end)
            ]

        with self._lock:
            start, stored = self._store(ns, ids[:n], source)
            kept = {p: blob for p, blob in (snapshots or {}).items() if 0 < p <= n}
            saved = [p for p in sorted(kept) if self._store_snapshot(ns, ids[:p], kept[p])]
        if self.spill is not None:
            if stored:
                self.spill.on_insert(ns.key, ids[: start + stored], start)
            for p in saved if self.spill.write_mode == "through" else ():
                self.spill.on_snapshot(ns.key, ids[:p], kept[p])
        return stored

    def _store_snapshot(self, ns: Namespace, ids: np.ndarray, blob: torch.Tensor) -> bool:
        """Under the lock: keep `blob`, the recurrent state after `ids`, at the node ending there
        (if those tokens are resident and no snapshot is kept there yet). Returns whether it was."""
        if self.state is None:
            raise ValueError("this cache's model keeps no recurrent state to snapshot")
        m = self._tree.match(ns.key, ids, touch=False, create=False)
        if m.length < len(ids) or len(ids) == 0:
            return False
        node = self._tree.boundary(m)
        if node.snap is not None:
            return False
        need = self._pool.slots_for(self.state.nbytes)
        self._tree.lock(node, +1)
        try:
            if need > self._pool.num_free:
                self._evict(need - self._pool.num_free)
            if need > self._pool.num_free:
                for c in self._counters, self._tenant_counters[ns.tenant]:
                    c.snapshot_dropped += 1
                return False
            slots = self._pool.alloc(need)
            self._pool.write_blob(slots, blob)
            self._tree.set_snapshot(node, slots)
            for c in self._counters, self._tenant_counters[ns.tenant]:
                c.snapshots_stored += 1
            return True
        finally:
            self._tree.lock(node, -1)

    def snapshot(self, token_ids: TokenIds, *, salt: Salt = None) -> torch.Tensor | None:
        """The recurrent-state snapshot kept after exactly `token_ids` (a copy), or None."""
        ids = as_token_array(token_ids)
        with self._lock:
            m = self._tree.match(self.namespace.with_salt(salt).key, ids, touch=False, create=False)
            if self.state is None or m.length < len(ids) or m.node.is_root:
                return None
            if m.node_offset != len(m.node.tokens) or m.node.snap is None:
                return None
            return self._pool.read_blob(m.node.snap, self.state.nbytes)

    def _store(self, ns: Namespace, ids: np.ndarray, source: KVSource) -> tuple[int, int]:
        """Store the KV of the not-yet-resident tail of `ids`; returns (first new position, count)."""
        m = self._tree.match(ns.key, ids)
        need = len(ids) - m.length
        if need <= 0:
            return m.length, 0
        self._namespaces.setdefault(ns.key, ns)
        tenant = self._tenant_counters[ns.tenant]
        self._tree.lock(m.node, +1)
        try:
            if need > self._pool.num_free:
                self._evict(need - self._pool.num_free)
            k = min(need, self._pool.num_free)
            for c in self._counters, tenant:
                c.insert_dropped_tokens += need - k
            if k == 0:
                return m.length, 0
            start = m.length
            kv = source(start, start + k)
            slots = self._pool.alloc(k)
            try:
                index = self._pool.index(slots)
                for layer, data in enumerate(kv):
                    if data is not None:
                        self._pool.scatter(layer, index, data[:, 0], data[:, 1])
            except BaseException:
                self._pool.release(slots)
                raise
            self._attach(ns, m, ids[: start + k], slots)
            return start, k
        finally:
            self._tree.lock(m.node, -1)

    def _attach(self, ns: Namespace, m: Match, ids: np.ndarray, slots: np.ndarray) -> None:
        """Under the lock: make `slots` (holding the KV of `ids[m.length:]`) the tree's, right after
        the match `m`, and report the store (events, counters)."""
        self._tree.extend(m, ids[m.length :], slots)
        if self.events is not None:
            self.events.stored(ids, m.length)
        for c in self._counters, self._tenant_counters[ns.tenant]:
            c.inserted_tokens += len(slots)

    @staticmethod
    def _slicer(base: int, kv: list[torch.Tensor | None]) -> KVSource:
        def source(start: int, end: int) -> list[torch.Tensor | None]:
            assert start >= base, f"KV from position {base} cannot fill position {start}"
            return [None if t is None else t[start - base : end - base] for t in kv]

        return source

    def evict(self, num_tokens: int) -> int:
        """Free up to `num_tokens` least-recently-used unlocked, unpinned tokens."""
        with self._lock:
            return self._evict(num_tokens)

    def _evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots; returns how many were freed (tokens, and the slots of
        recurrent-state snapshots that went)."""
        snapshot_slots = self._tree.snapshot_slots
        freed = self._tree.evict(num_tokens, self._before_trim, self._before_drop)
        self._pool.release(freed)
        self._counters.evicted_tokens += len(freed) - (snapshot_slots - self._tree.snapshot_slots)
        return len(freed)

    def _before_trim(self, node: Node, count: int) -> None:
        """Remember what is evicted (for `explain`) and, in write-back mode, spill it first."""
        ns_key = self._tree.namespace_of(node)
        ids, slots = self._tree.path(node)
        self._ledger.record(ns_key, ids, len(ids) - count)
        ns = self._namespaces.get(ns_key)
        if ns is not None:
            self._tenant_counters[ns.tenant].evicted_tokens += count
        if self.spill is not None and self.spill.write_mode == "back":
            self.spill.on_evict(ns_key, ids, len(ids) - count, lambda a, b: self._gather(slots[a:b]))
        if self.events is not None:  # complete Redis chunks stay restorable (the shared tier)
            chunk = self.spill.chunk_tokens if self.spill is not None else len(ids) + 1
            self.events.evicted(ids, len(ids) - count, len(ids) // chunk * chunk)

    def _before_drop(self, node: Node) -> None:
        """A snapshot leaves the device: counted, and in write-back mode spilled first."""
        ns_key = self._tree.namespace_of(node)
        ns = self._namespaces.get(ns_key)
        for c in (self._counters,) if ns is None else (self._counters, self._tenant_counters[ns.tenant]):
            c.snapshots_evicted += 1
        if self.spill is not None and self.spill.write_mode == "back":
            ids, _ = self._tree.path(node)
            self.spill.on_snapshot(ns_key, ids, self._pool.read_blob(node.snap, self.state.nbytes))

    def pin(self, token_ids: TokenIds, *, salt: Salt = None) -> int:
        """Exempt the resident prefix of `token_ids` from eviction; returns the pinned length L.

        Release it with `unpin` of exactly those L tokens (`token_ids[:L]`).
        """
        ids = as_token_array(token_ids)
        key = self.namespace.with_salt(salt).key
        with self._lock:
            m = self._tree.match(key, ids, create=False)
            if m.length == 0:
                return 0
            added = self._tree.unpinned_tokens_on_path(m.node) - (len(m.node.tokens) - m.node_offset) * (
                m.node.pin_ref == 0
            )
            if self._tree.pinned_tokens + added > self.max_pinned_tokens:
                raise PinLimitError(
                    f"pinning {m.length} tokens would pin {self._tree.pinned_tokens + added}, "
                    f"over the cap of {self.max_pinned_tokens}"
                )
            node = self._tree.split(m.node, m.node_offset)
            self._tree.pin(node, +1)
            return m.length

    def unpin(self, token_ids: TokenIds, *, salt: Salt = None) -> int:
        """Undo one `pin` of exactly this prefix; returns the unpinned length (0 if it was not pinned)."""
        ids = as_token_array(token_ids)
        key = self.namespace.with_salt(salt).key
        with self._lock:
            m = self._tree.match(key, ids, touch=False, create=False)
            node = m.node
            # Pin counts propagate to the root, so the pins that end exactly here are this node's
            # count minus its children's (splits preserve that difference).
            ends_here = node.pin_ref - sum(c.pin_ref for c in node.children.values())
            if m.length == 0 or m.node_offset != len(node.tokens) or ends_here <= 0:
                return 0
            self._tree.pin(node, -1)
            return m.length

    # ---- reporting -------------------------------------------------------------------------

    def stats(self, *, tenant: str | None = None) -> dict[str, int]:
        """Counters since creation plus current occupancy; rates are for the reader to compute.

        With `tenant`, that tenant's own counters and tokens only (capacity is the server's);
        without, the whole trie plus the spill tier's counters.
        """
        with self._lock:
            if tenant is None:
                c, nodes = self._counters, self._tree.iter_nodes()
            else:
                c = self._tenant_counters.get(tenant) or Counters()
                nodes = self._tree.iter_nodes(self._namespace_keys(tenant))
            resident = locked = pinned = count = 0
            for n in nodes:
                count += 1
                resident += len(n.tokens)
                locked += len(n.tokens) * (n.lock_ref > 0)
                pinned += len(n.tokens) * (n.pin_ref > 0)
            token_bytes = self._pool.slot_bytes
            out = {
                "queries": c.queries,
                "queried_tokens": c.queried_tokens,
                "hit_tokens": c.hit_tokens,
                "inserted_tokens": c.inserted_tokens,
                "insert_dropped_tokens": c.insert_dropped_tokens,
                "evicted_tokens": c.evicted_tokens,
                "resident_tokens": resident,
                "resident_bytes": resident * token_bytes,
                "capacity_tokens": self._pool.capacity,
                "capacity_bytes": self._pool.capacity * token_bytes,
                "free_tokens": self._pool.num_free,
                "pinned_tokens": pinned,
                "locked_tokens": locked,
                "nodes": count,
                "spill_hit_tokens": c.spill_hit_tokens,
                "spill_lost_tokens": c.spill_lost_tokens,
                "lookup_errors": c.lookup_errors,
            }
            if self.state is not None:
                out |= {
                    "snapshots": self._tree.snapshots,
                    "snapshot_bytes": self._tree.snapshots * self.state.nbytes,
                    "snapshot_slots": self._tree.snapshot_slots,
                    "snapshots_stored": c.snapshots_stored,
                    "snapshots_evicted": c.snapshots_evicted,
                    "snapshot_dropped": c.snapshot_dropped,
                    "snapshot_misses": c.snapshot_misses,
                }
                if tenant is None:
                    out["resident_bytes"] += self._tree.snapshot_slots * token_bytes
        if tenant is None and self.spill is not None:
            out |= self.spill.stats()
        if tenant is None and self.events is not None:
            out |= self.events.stats()
        return out

    def tenant_counters(self) -> dict[str, dict[str, int]]:
        """Each tenant's lookup and eviction counters, without walking the tree (cheap at every scrape)."""
        with self._lock:
            return {
                tenant: {
                    "queried_tokens": c.queried_tokens,
                    "hit_tokens": c.hit_tokens,
                    "spill_hit_tokens": c.spill_hit_tokens,
                    "evicted_tokens": c.evicted_tokens,
                }
                for tenant, c in self._tenant_counters.items()
            }

    def attach_events(self, events: KVEventPublisher) -> None:
        """Publish KV events (`kvblocks.telemetry.kv_events`) for what this cache stores and evicts from now on;
        the publisher starts by announcing what is resident already."""
        with self._lock:
            events.bind(self.namespace.key, (self._lock, self._event_nodes))
            self.events = events

    def _event_nodes(self) -> list[tuple[int, np.ndarray]]:
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

    def close(self) -> None:
        """Flush and close the spill tier (queued writes finish first) and the events publisher."""
        if self.spill is not None:
            self.spill.close()
        if self.events is not None:
            self.events.close()

    @property
    def token_bytes(self) -> int:
        return self._pool.token_bytes

    # ---- slots of running requests (packed forwards, kvblocks.engine.paged) -------------------------

    @property
    def eviction_policy(self) -> str:
        """What leaves a full pool first: `gdsf` or `lru` (`kvblocks.cache.eviction`)."""
        return self._tree.policy.name

    @property
    def pinned_tokens(self) -> int:
        return self._tree.pinned_tokens

    @property
    def pool(self) -> KVPool:
        """The device pool; a packed forward writes a running request's KV into slots from `reserve`."""
        return self._pool

    def reserve(self, n: int) -> np.ndarray:
        """`n` free pool slots for a running request's own tokens, evicting unlocked, unpinned tokens
        to make room; the caller owns them until it passes them to `adopt` or `release_slots`.
        Raises PoolFullError (nothing taken) when too much is locked or pinned."""
        with self._lock:
            if n > self._pool.num_free:
                self._evict(n - self._pool.num_free)
            if n > self._pool.num_free:
                raise PoolFullError(f"{n} slots asked for, {self._pool.num_free} free after eviction")
            return self._pool.alloc(n)

    def evictable_tokens(self) -> int:
        """Resident tokens neither locked nor pinned: what `reserve` may evict beyond the free slots
        (a walk of the whole tree)."""
        with self._lock:
            return sum(
                len(n.tokens) + (0 if n.snap is None else len(n.snap))
                for n in self._tree.iter_nodes()
                if n.lock_ref == 0 and n.pin_ref == 0
            )

    def hold(self, token_ids: TokenIds, *, salt: Salt = None) -> Hit:
        """Lock the whole resident prefix of `token_ids` (no token left out, nothing counted as a
        lookup): a running request keeps what it just adopted from being evicted under it."""
        ids = as_token_array(token_ids)
        ns = self.namespace.with_salt(salt)
        with self._lock:
            m = self._tree.match(ns.key, ids, create=False)
            return Hit(self, ns, m, m.length)

    def release_slots(self, slots: np.ndarray) -> None:
        """Give back slots from `reserve` that hold nothing worth keeping (a rejected draft's, a
        cancelled request's)."""
        with self._lock:
            self._pool.release(np.asarray(slots, dtype=SLOT_DTYPE))

    def adopt(self, token_ids: TokenIds, slots: np.ndarray, start: int, *, salt: Salt = None) -> int:
        """Store a request's KV without copying it: `slots[i]` holds position `i` of `token_ids` in
        this pool. Positions before `start` are the tree's own (the request's locked hit, which the
        caller still holds); the slots from `start` on are the caller's (from `reserve`) and all pass
        to the cache: those of positions another request stored meanwhile are freed, the rest become
        the tree's. Returns how many tokens were attached."""
        ids = as_token_array(token_ids)
        slots = np.asarray(slots, dtype=SLOT_DTYPE)
        if len(slots) != len(ids) or not 0 <= start <= len(ids):
            raise ValueError(f"{len(ids)} tokens need as many slots and 0 <= start <= {len(ids)}")
        ns = self.namespace.with_salt(salt)
        with self._lock:
            m = self._tree.match(ns.key, ids)
            if m.length < start:
                raise ValueError(f"only {m.length} of the {start} tokens before `start` are resident")
            self._pool.release(slots[start : m.length])
            if m.length == len(ids):
                return 0
            self._namespaces.setdefault(ns.key, ns)
            self._attach(ns, m, ids, slots[m.length :])
            count = len(ids) - m.length
        if self.spill is not None:
            self.spill.on_insert(ns.key, ids, m.length)
        return count

    # ---- internals -------------------------------------------------------------------------

    def _gather(self, slots: np.ndarray) -> list[torch.Tensor | None]:
        index = self._pool.index(slots)
        return [None if s.kind == "none" else self._pool.gather(i, index) for i, s in enumerate(self.specs)]

    def _read_kv(
        self, ns_key: str, ids: np.ndarray, start: int, end: int
    ) -> list[torch.Tensor | None] | None:
        """KV of positions [start, end) of `ids` if still resident (for the spill tier's writer)."""
        with self._lock:
            m = self._tree.match(ns_key, ids[:end], touch=False, create=False)
            if m.length < end:
                return None
            self._tree.lock(m.node, +1)
        try:
            return self._gather(m.slots(end)[start:end])
        finally:
            with self._lock:
                self._tree.lock(m.node, -1)

    def _build_cache(self, slots: np.ndarray, length: int, node: Node | None = None):
        state = None
        if self.state is not None and length:
            state = (self.state, self._pool.read_blob(node.snap, self.state.nbytes))
        kv: list[torch.Tensor | None] = []
        indices: dict[int, torch.Tensor] = {}
        for layer, spec in enumerate(self.specs):
            held = spec.tokens_held(length)
            if spec.kind == "none" or held == 0:
                kv.append(None)
                continue
            index = indices.get(held)
            if index is None:
                index = indices[held] = self._pool.index(slots[length - held : length])
            kv.append(self._pool.gather(layer, index))
        return hf.build_cache(self.config, self.specs, kv, length, state)

    def clear(self) -> int:
        """Evict every unlocked, unpinned token (what `/flush_cache` asks for); returns how many went.
        Running requests keep their locked prefixes and pins stay: unpin a prefix to let it go."""
        with self._lock:
            if self.events is not None:
                self.events.cleared()
            return self._evict(self._pool.capacity)
