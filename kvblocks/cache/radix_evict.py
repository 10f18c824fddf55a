"""One eviction pass over a `RadixTree`: the candidates in the policy's order, taken until enough
slots are free.

A leaf is trimmed from its tail, so eviction is token-granular and what stays is still a prefix of
something that was inserted; a leaf's snapshot goes with the first token trimmed. A snapshot inside
the tree is an entry of its own. `before_trim(node, n)` runs before the last `n` tokens of `node` go
(the spill tier's write-back copies them then), `before_drop` before a snapshot goes.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvblocks.cache.radix import Node, RadixTree

# (policy key, id of the node, node, whether the entry is a snapshot inside the tree)
_Entry = tuple[tuple[float, int], int, "Node", bool]


class TreeEviction:
    """A heap of evictable leaves and of snapshots inside the tree; a parent left a leaf joins."""

    def __init__(
        self,
        tree: RadixTree,
        before_trim: Callable[[Node, int], None] | None,
        before_drop: Callable[[Node], None] | None,
    ) -> None:
        self.tree, self.policy = tree, tree.policy
        self.before_trim, self.before_drop = before_trim, before_drop
        self.heap = [self._leaf(n) for n in tree.leaves if n.evictable()]
        self.heap.extend(
            (self._snapshot_key(n), id(n), n, True)
            for n in tree.snapshot_nodes
            if n.children and n.lock_ref == 0 and n.pin_ref == 0
        )
        heapq.heapify(self.heap)

    def run(self, num_tokens: int) -> list[np.ndarray]:
        """The slots freed, at least `num_tokens` of them unless too much is locked or pinned."""
        freed: list[np.ndarray] = []
        remaining = num_tokens
        while remaining > 0 and self.heap:
            key, _, node, is_snapshot = heapq.heappop(self.heap)
            if is_snapshot and (node.snap is None or not node.children):  # gone, or left with its leaf
                continue
            self.policy.evicted(key)
            if node.snap is not None:  # a snapshot inside the tree, or the one at a leaf's end
                freed.append(self._drop(node))
                remaining -= len(freed[-1])
                if is_snapshot or remaining <= 0:
                    continue
            take = min(remaining, len(node.tokens))
            whole = take == len(node.tokens)
            freed.append(self._trim(node, take))
            remaining -= take
            parent = self._remove_leaf(node) if whole else None
            if parent is not None and parent.evictable():
                heapq.heappush(self.heap, self._leaf(parent))
        return freed

    def _leaf(self, node: Node) -> _Entry:
        return (self.policy.key(node, self.tree.depth(node)), id(node), node, False)

    def _snapshot_key(self, node: Node) -> tuple[float, int]:
        """A snapshot's eviction key: what it saves is the tokens since the snapshot above it,
        which a hit would otherwise recompute; what it costs is its slots."""
        assert node.snap is not None
        depth = self.tree.depth(node)
        above, up = 0, node.parent
        while up is not None and not up.is_root:
            if up.snap is not None:
                above = self.tree.depth(up)
                break
            up = up.parent
        return self.policy.snapshot_key(node, depth, depth - above, len(node.snap))

    def _drop(self, node: Node) -> np.ndarray:
        if self.before_drop is not None:
            self.before_drop(node)
        return self.tree.drop_snapshot(node)

    def _trim(self, node: Node, take: int) -> np.ndarray:
        """Free the last `take` tokens of a leaf; the slots they held."""
        if self.before_trim is not None:
            self.before_trim(node, take)
        slots = node.slots[len(node.slots) - take :]
        self.tree.resident_tokens -= take
        if take < len(node.tokens):
            node.tokens = node.tokens[: len(node.tokens) - take].copy()
            node.slots = node.slots[: len(node.slots) - take].copy()
        return slots

    def _remove_leaf(self, node: Node) -> Node | None:
        """Unlink a leaf trimmed to nothing; returns its parent if that became a leaf."""
        parent = node.parent
        assert parent is not None
        del parent.children[int(node.tokens[0])]
        self.tree.leaves.discard(node)
        self.tree.num_nodes -= 1
        if parent.is_root or parent.children:
            return None
        self.tree.leaves.add(parent)
        return parent
