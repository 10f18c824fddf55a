"""Recurrent-state snapshots: the one owner of where a request copies its state and of the copies.

A recurrent layer's state sums up every token before it and cannot be sliced per token, so on a
recurrent or hybrid model a hit ends where a snapshot was taken. `Snapshots` decides where those are
(`points` along a prefill, `wants` while decoding) and keeps them at trie nodes in pool slots. A
request gets a `SnapshotPlan` once and tells it after every forward where it stands: one call, and
the plan takes the state when the policy wants it. The state's bytes are opaque here; the cache's
bridge (`kvblocks.cache.bridge`) copies them out of a framework cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvblocks.cache.layout import StateLayout
from kvblocks.cache.namespace import Namespace
from kvblocks.cache.radix import Node
from kvblocks.cache.resident import Resident

# a snapshot every this many tokens (besides the ends of prompts and replies, the position before a
# prompt's last token and branch points)
DEFAULT_SNAPSHOT_EVERY = 256


@dataclass(slots=True)
class SnapshotPlan:
    """One request's snapshots: where its prefill stops, the states taken but not stored yet and
    every position snapshotted. The plan of a model without recurrent state takes nothing."""

    points: list[int] = field(default_factory=list)
    taken: dict[int, torch.Tensor] = field(default_factory=dict)
    positions: list[int] = field(default_factory=list)
    wants: Callable[[int], bool] | None = None
    capture: Callable[[Any], torch.Tensor] | None = None

    def stops(self, start: int, end: int) -> list[int]:
        """Where a forward of positions [start, end) must end: the points inside, then `end`."""
        return [p for p in self.points if start < p < end] + [end]

    def skip_before(self, first: int) -> None:
        """Take no snapshot before `first` (a stepwise model's state is exact only from there)."""
        self.points = [p for p in self.points if p >= first]

    def after_forward(self, position: int, past: Any) -> None:
        """`past` has just consumed `position` tokens: take its state if the policy wants it here."""
        if self.capture is None or position in self.positions:
            return
        if position in self.points or (self.wants is not None and self.wants(position)):
            self._take(position, past)

    def at_end(self, position: int, past: Any) -> None:
        """The request stops at `position` (where `past` stands): its state is where the next turn
        resumes, so it is taken whatever the policy says."""
        if self.capture is not None and position and position not in self.positions:
            self._take(position, past)

    def hand_over(self, end: int) -> dict[int, torch.Tensor]:
        """The states taken so far, for an insert of the first `end` tokens; those past it stay."""
        taken = self.taken
        self.taken = {p: blob for p, blob in taken.items() if p > end}
        return taken

    def _take(self, position: int, past: Any) -> None:
        assert self.capture is not None
        self.taken[position] = self.capture(past)
        self.positions.append(position)


class Snapshots:
    """The snapshot policy of one cache and the snapshots it keeps (in pool slots, at trie nodes).

    `store`, `read` and `dropped` (the eviction hook) run under the resident's lock.
    """

    def __init__(
        self,
        layout: StateLayout | None,
        every: int,
        min_prefill: int,
        resident: Resident,
    ) -> None:
        if every < 0:
            raise ValueError(f"snapshot_every must be >= 0 (0: only at prompt and reply ends), got {every}")
        self.layout, self.every, self.min_prefill = layout, every, min_prefill
        self._resident = resident
        self._tree, self._pool, self._counters = resident.tree, resident.pool, resident.counters

    def points(self, start: int, prompt_length: int, matched: int) -> list[int]:
        """Where a request prefilling positions [start, prompt_length) stops to snapshot the
        recurrent state: every `every` tokens, the branch point `matched` (where the resident tokens
        end; the next request sharing this prefix then hits there), the position before the last
        prompt token (a repeated prompt recomputes one token; two where `min_prefill` is 2, as no
        forward gets fewer), the prompt's end and, with a spill tier, the last chunk end before it
        (what Redis can hold). Empty for a model without recurrent state."""
        if self.layout is None:
            return []
        every, least = self.every, self.min_prefill
        points = {prompt_length - least, prompt_length, matched}
        if every:
            points.update(range((start // every + 1) * every, prompt_length, every))
        spill = self._resident.spill
        if spill is not None and spill.spills_state:
            # the spill tier keeps snapshots only at chunk ends: another process resumes this prompt
            # at most a chunk short of it
            chunk = spill.chunk_tokens
            points.add((prompt_length - least) // chunk * chunk)
        kept, previous = [], start
        for p in sorted(p for p in points if start < p <= prompt_length):
            if p - previous >= least and (p == prompt_length or prompt_length - p >= least):
                kept.append(p)
                previous = p
        return kept

    def wants(self, position: int) -> bool:
        """Whether a decoding request snapshots its state after `position` tokens."""
        return self.layout is not None and self.every > 0 and position % self.every == 0

    def plan(
        self, start: int, prompt_length: int, matched: int, capture: Callable[[Any], torch.Tensor]
    ) -> SnapshotPlan:
        """The plan of a request prefilling [start, prompt_length) after a hit that matched `matched`."""
        if self.layout is None:
            return SnapshotPlan()
        return SnapshotPlan(self.points(start, prompt_length, matched), wants=self.wants, capture=capture)

    def store(self, ns: Namespace, ids: np.ndarray, blob: torch.Tensor) -> bool:
        """Under the lock: keep `blob`, the recurrent state after `ids`, at the node ending there
        (if those tokens are resident and no snapshot is kept there yet). Returns whether it was."""
        if self.layout is None:
            raise ValueError("this cache's model keeps no recurrent state to snapshot")
        m = self._tree.match(ns.key, ids, touch=False, create=False)
        if m.length < len(ids) or len(ids) == 0:
            return False
        node = self._tree.boundary(m)
        assert node is not None, "a match of at least one token ends at a node"
        if node.snap is not None:
            return False
        self._tree.lock(node, +1)  # the room made for it must not evict the node itself
        try:
            slots = self._resident.reserve(self._pool.slots_for(self.layout.nbytes))
            if slots is None:
                self._counters.add(ns.tenant, snapshot_dropped=1)
                return False
            self._pool.write_blob(slots, blob)
            self._tree.set_snapshot(node, slots)
            self._counters.add(ns.tenant, snapshots_stored=1)
            return True
        finally:
            self._tree.lock(node, -1)

    def read(self, namespace_key: str, ids: np.ndarray) -> torch.Tensor | None:
        """Under the lock: the snapshot kept after exactly `ids` (a copy), or None."""
        m = self._tree.match(namespace_key, ids, touch=False, create=False)
        if self.layout is None or m.length < len(ids) or m.node.is_root:
            return None
        if m.node_offset != len(m.node.tokens) or m.node.snap is None:
            return None
        return self.blob(m.node)

    def blob(self, node: Node) -> torch.Tensor:
        """The snapshot kept at `node` (a copy)."""
        assert node.snap is not None and self.layout is not None
        return self._pool.read_blob(node.snap, self.layout.nbytes)

    def dropped(self, node: Node) -> None:
        """Eviction hook: a snapshot leaves the device; counted, and in write-back mode spilled first."""
        key = self._tree.namespace_of(node)
        self._counters.add(self._counters.tenant_of(key), snapshots_evicted=1)
        spill = self._resident.spill
        if spill is not None and spill.write_mode == "back":
            ids, _ = self._tree.path(node)
            spill.on_snapshot(key, ids, self.blob(node))
