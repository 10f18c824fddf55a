"""Radix tree over token ids: which token prefixes are resident and in which pool slots.

The tree knows nothing of tensors. Each node owns a run of tokens (int32) and the pool slots
(int32) that hold their KV. Lock and pin counts walk to the root, so a node is evictable exactly
when no live match and no pin passes through it. Not thread-safe: `KVCacheTrie` serialises access.

For a recurrent or hybrid model a node may also own a snapshot of the recurrent state after its
last token (`snap`: the slots that hold the snapshot's bytes). Only a prefix that ends at a
snapshot can be served (`Match.snapshot_prefix`). A snapshot is an entry of its own for eviction: it goes
with its node's tail, or alone, in the policy's order of value per slot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from kvblocks.cache.eviction import LRU, EvictionPolicy
from kvblocks.cache.radix_evict import TreeEviction

TOKEN_DTYPE = np.int32
SLOT_DTYPE = np.int32
_EMPTY = np.zeros(0, dtype=TOKEN_DTYPE)


@dataclass(slots=True, eq=False)
class Node:
    tokens: np.ndarray
    slots: np.ndarray
    parent: Node | None
    children: dict[int, Node] = field(default_factory=dict)
    lock_ref: int = 0
    pin_ref: int = 0
    last_access: int = 0
    hits: int = 0
    stamp: float = 0.0  # the eviction policy's value at the last touch (`kvblocks.cache.eviction`)
    snap: np.ndarray | None = None  # slots of the recurrent-state snapshot after the last token

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def evictable(self) -> bool:
        return not self.children and not self.is_root and self.lock_ref == 0 and self.pin_ref == 0


@dataclass(slots=True, frozen=True)
class Match:
    """Longest resident prefix: `node` holds the last matched token at `node_offset - 1`."""

    node: Node
    node_offset: int
    length: int
    slot_runs: tuple[np.ndarray, ...]

    def slots(self, length: int | None = None) -> np.ndarray:
        length = self.length if length is None else length
        if not self.slot_runs:
            return np.zeros(0, dtype=SLOT_DTYPE)
        return np.concatenate(self.slot_runs)[:length]

    def snapshot_prefix(self) -> Match:
        """The longest part of this match that ends where a node owning a snapshot ends."""
        node, length = self.node, self.length
        if node.is_root or (self.node_offset == len(node.tokens) and node.snap is not None):
            return self
        length -= self.node_offset
        node = _parent(node)
        while not node.is_root and node.snap is None:
            length -= len(node.tokens)
            node = _parent(node)
        return Match(node, 0 if node.is_root else len(node.tokens), length, self.slot_runs)


def _parent(node: Node) -> Node:
    assert node.parent is not None, "the root has no parent"
    return node.parent


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    neq = a[:n] != b[:n]
    return int(neq.argmax()) if neq.any() else n


class RadixTree:
    """Token-granular prefix tree with one root per namespace."""

    def __init__(self, policy: EvictionPolicy | None = None) -> None:
        self.policy: EvictionPolicy = LRU() if policy is None else policy
        self.roots: dict[str, Node] = {}
        self.resident_tokens = 0
        self.snapshot_slots = 0
        self.snapshot_nodes: set[Node] = set()  # nodes owning a snapshot (eviction's candidates)
        self.pinned_tokens = 0
        self.num_nodes = 0
        self._clock = 0
        self.leaves: set[Node] = set()
        self._root_keys: dict[int, str] = {}

    # ---- queries ---------------------------------------------------------------------------

    def root(self, namespace: str) -> Node:
        root = self.roots.get(namespace)
        if root is None:
            root = Node(_EMPTY, np.zeros(0, dtype=SLOT_DTYPE), None)
            self.roots[namespace] = root
            self._root_keys[id(root)] = namespace
        return root

    def namespace_of(self, node: Node) -> str:
        while node.parent is not None:
            node = node.parent
        return self._root_keys[id(node)]

    def match(self, namespace: str, ids: np.ndarray, touch: bool = True, create: bool = True) -> Match:
        """Walk the longest resident prefix of `ids`; with `touch`, refresh LRU times on the path.

        Without `create`, a namespace that holds nothing gets no root: lookups with ever new
        namespaces (clients choose their cache salts) must not grow the tree.
        """
        node = self.roots.get(namespace) if not create else self.root(namespace)
        if node is None:
            return Match(Node(_EMPTY, np.zeros(0, dtype=SLOT_DTYPE), None), 0, 0, ())
        pos, offset, runs = 0, 0, []
        now = self._tick() if touch else 0
        stamp = self.policy.stamp()
        while pos < len(ids):
            child = node.children.get(int(ids[pos]))
            if child is None:
                break
            run = child.tokens
            seg = ids[pos : pos + len(run)]
            k = len(run) if len(seg) == len(run) and np.array_equal(seg, run) else common_prefix_len(seg, run)
            if touch:
                child.last_access = now
                child.hits += 1
                child.stamp = stamp
            runs.append(child.slots[:k])
            node, offset, pos = child, k, pos + k
            if k < len(run):
                break
        if node.is_root:
            offset = 0
        return Match(node, offset, pos, tuple(runs))

    def boundary(self, match: Match) -> Node | None:
        """The node ending exactly at `match`'s end (split there if needed); None at the root."""
        if match.length == 0 or match.node.is_root:
            return None
        return self.split(match.node, match.node_offset)

    @property
    def snapshots(self) -> int:
        return len(self.snapshot_nodes)

    def set_snapshot(self, node: Node, slots: np.ndarray) -> None:
        assert node.snap is None and not node.is_root
        node.snap = slots
        self.snapshot_slots += len(slots)
        self.snapshot_nodes.add(node)

    def drop_snapshot(self, node: Node) -> np.ndarray:
        slots, node.snap = node.snap, None
        assert slots is not None
        self.snapshot_slots -= len(slots)
        self.snapshot_nodes.discard(node)
        return slots

    def path(self, node: Node) -> tuple[np.ndarray, np.ndarray]:
        """All token ids and slots from the root down to the end of `node`."""
        tokens: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        while node.parent is not None:
            tokens.append(node.tokens)
            slots.append(node.slots)
            node = node.parent
        if not tokens:
            return _EMPTY, np.zeros(0, dtype=SLOT_DTYPE)
        return np.concatenate(tokens[::-1]), np.concatenate(slots[::-1])

    def continuation(self, match: Match, max_tokens: int) -> np.ndarray:
        """Up to `max_tokens` resident tokens that follow `match`, taking the most recently used
        branch at each fork (what the last request with this prefix went on to say)."""
        node, offset, out = match.node, match.node_offset, []
        remaining = max_tokens
        while remaining > 0:
            if offset < len(node.tokens):
                run = node.tokens[offset : offset + remaining]
                out.append(run)
                remaining -= len(run)
                offset += len(run)
                continue
            if not node.children:
                break
            node = max(node.children.values(), key=lambda child: child.last_access)
            offset = 0
        return np.concatenate(out) if out else _EMPTY

    def continuations(self, match: Match, budget: int, depth: int, width: int) -> tuple[list[int], list[int]]:
        """At most `budget` resident tokens after `match` as a tree `(tokens, parents)` in
        depth-first order (parent -1: follows `match`), `depth` levels deep, at most `width`
        branches at each fork, the most often matched first (`hits`, then the most recent): the
        continuations earlier requests with this prefix took."""
        tokens: list[int] = []
        parents: list[int] = []

        def walk(node: Node, offset: int, parent: int, level: int) -> None:
            while level < depth and len(tokens) < budget:
                if offset < len(node.tokens):
                    tokens.append(int(node.tokens[offset]))
                    parents.append(parent)
                    parent, offset, level = len(tokens) - 1, offset + 1, level + 1
                    continue
                ranked = sorted(node.children.values(), key=lambda c: (c.hits, c.last_access), reverse=True)
                for child in ranked[:width]:
                    walk(child, 0, parent, level)
                return

        walk(match.node, match.node_offset, -1, 0)
        return tokens, parents

    def iter_nodes(self, namespaces: Iterable[str] | None = None) -> Iterator[Node]:
        """Every non-root node, or those under the given namespaces' roots."""
        keys = self.roots if namespaces is None else namespaces
        stack = [self.roots[k] for k in keys if k in self.roots]
        while stack:
            node = stack.pop()
            if not node.is_root:
                yield node
            stack.extend(node.children.values())

    # ---- mutations -------------------------------------------------------------------------

    def split(self, node: Node, offset: int) -> Node:
        """Cut `node` after `offset` tokens and return the upper part (which keeps the counts)."""
        assert 0 < offset <= len(node.tokens) and not node.is_root
        if offset == len(node.tokens):
            return node
        parent = _parent(node)
        upper = Node(
            node.tokens[:offset].copy(),
            node.slots[:offset].copy(),
            parent,
            lock_ref=node.lock_ref,
            pin_ref=node.pin_ref,
            last_access=node.last_access,
            hits=node.hits,
            stamp=node.stamp,
        )
        parent.children[int(upper.tokens[0])] = upper
        node.tokens = node.tokens[offset:].copy()
        node.slots = node.slots[offset:].copy()
        node.parent = upper
        upper.children[int(node.tokens[0])] = node
        self.num_nodes += 1
        return upper

    def extend(self, match: Match, tokens: np.ndarray, slots: np.ndarray) -> Node:
        """Attach `tokens` (with their slots) right after `match`; returns the node ending with them."""
        assert len(tokens) == len(slots) and len(tokens) > 0
        node = match.node
        if not node.is_root and match.node_offset < len(node.tokens):
            node = self.split(node, match.node_offset)
        now = self._tick()
        if not node.is_root and not node.children and node.pin_ref == 0 and node.snap is None:
            node.tokens = np.concatenate([node.tokens, tokens.astype(TOKEN_DTYPE)])
            node.slots = np.concatenate([node.slots, slots.astype(SLOT_DTYPE)])
            node.last_access = now
            node.stamp = self.policy.stamp()
            self.resident_tokens += len(tokens)
            return node
        child = Node(tokens.astype(TOKEN_DTYPE, copy=True), slots.astype(SLOT_DTYPE, copy=True), node)
        child.last_access = now
        child.stamp = self.policy.stamp()
        assert int(tokens[0]) not in node.children
        node.children[int(tokens[0])] = child
        self.leaves.discard(node)
        self.leaves.add(child)
        self.num_nodes += 1
        self.resident_tokens += len(tokens)
        return child

    def lock(self, node: Node, delta: int) -> None:
        up: Node | None = node
        while up is not None and not up.is_root:
            up.lock_ref += delta
            assert up.lock_ref >= 0
            up = up.parent

    def pin(self, node: Node, delta: int) -> None:
        up: Node | None = node
        while up is not None and not up.is_root:
            if delta > 0 and up.pin_ref == 0:
                self.pinned_tokens += len(up.tokens)
            up.pin_ref += delta
            assert up.pin_ref >= 0
            if up.pin_ref == 0 and delta < 0:
                self.pinned_tokens -= len(up.tokens)
            up = up.parent

    def unpinned_tokens_on_path(self, node: Node) -> int:
        total = 0
        up: Node | None = node
        while up is not None and not up.is_root:
            if up.pin_ref == 0:
                total += len(up.tokens)
            up = up.parent
        return total

    def evict(
        self,
        num_tokens: int,
        before_trim: Callable[[Node, int], None] | None = None,
        before_drop: Callable[[Node], None] | None = None,
    ) -> np.ndarray:
        """Free at least `num_tokens` slots (fewer if too much is locked or pinned), in the order of
        the tree's eviction policy (`kvblocks.cache.radix_evict`)."""
        freed = TreeEviction(self, before_trim, before_drop).run(num_tokens)
        return np.concatenate(freed) if freed else np.zeros(0, dtype=SLOT_DTYPE)

    @staticmethod
    def depth(node: Node) -> int:
        """Tokens from the root to the end of `node`."""
        total = 0
        up: Node | None = node
        while up is not None:
            total += len(up.tokens)
            up = up.parent
        return total

    def _tick(self) -> int:
        self._clock += 1
        return self._clock
