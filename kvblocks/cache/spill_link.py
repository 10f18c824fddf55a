"""The cache's side of the spill tiers (`kvblocks.spill`): what a lookup fetches from them (host
memory, disk, Redis) and promotes into the pool, and what the tiers' writer reads back out of it.

Tier round trips run outside the lock, so the device may change while they are under way;
everything fetched is checked against the tree again, under the lock, before it is stored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvblocks.cache.namespace import Namespace
from kvblocks.cache.resident import KVSource, Resident
from kvblocks.telemetry import tracing

if TYPE_CHECKING:
    from kvblocks.spill.lookup import Fetched


class SpillLink:
    """Fetch, promote and read back between the resident KV and its `spill` tier."""

    def __init__(self, resident: Resident, *, recurrent: bool) -> None:
        self._resident, self._recurrent = resident, recurrent

    def fetch(self, ns: Namespace, ids: np.ndarray, limit: int) -> tuple[Fetched | None, Any]:
        """What the spill tier holds beyond the resident prefix of `ids[:limit]`: KV, and on a
        recurrent model a (position, snapshot) to serve it from. The tiers' round trips run unlocked:
        other threads go on meanwhile."""
        r, spill = self._resident, self._resident.spill
        assert spill is not None
        with r.lock:
            m = r.tree.match(ns.key, ids[:limit], touch=False, create=False)
            device = m.length
            servable = m.snapshot_prefix().length if self._recurrent else device
        spill.on_hit(ns.key, ids, device)  # rewrites chunks Redis lost, off this thread
        fetched = state = None
        if device < limit:
            with tracing.child("spill.fetch", device_tokens=device) as span:
                fetched = spill.fetch(ns.key, ids, device, limit)
                if span is not None:  # tokens past the device's: from every tier, and from each one
                    given = {} if fetched is None else fetched.tiers
                    per_tier = {f"{slot.name}_tokens": given.get(slot.name, 0) for slot in spill.slots}
                    tracing.annotate(span, spill_tokens=sum(given.values()), **per_tier)
        if servable < limit and self._recurrent:  # a recurrent model needs a state there too
            reach = device if fetched is None else max(device, fetched.start + fetched.length)
            state = spill.fetch_state(ns.key, ids, servable, reach)
        return fetched, state

    def promote(self, ns: Namespace, ids: np.ndarray, fetched: Fetched) -> None:
        """Under the lock: store KV fetched from the spill tier, if the device still holds the prefix
        it continues.

        Another thread may have evicted part of that prefix while Redis answered: the fetched
        run then no longer starts where the resident prefix ends, and storing it would put its KV
        at the wrong positions. It is dropped instead (counted as lost; the request prefills).
        """
        r = self._resident
        before = r.tree.match(ns.key, ids, touch=False, create=False).length
        if before < fetched.start:
            r.counters.add(ns.tenant, spill_lost_tokens=fetched.length)
            return
        _, stored = r.store(ns, ids[: fetched.start + fetched.length], _slicer(fetched.start, fetched.kv))
        r.counters.add(ns.tenant, spill_hit_tokens=stored)

    def stored(
        self, ns: Namespace, ids: np.ndarray, start: int, count: int, snapshots: dict[int, Any]
    ) -> None:
        """Tell the spill tier what an insert stored: `count` tokens of `ids` from `start` on, and
        the recurrent-state `snapshots` by position (written through only in write-through mode)."""
        spill = self._resident.spill
        assert spill is not None
        if count:
            spill.on_insert(ns.key, ids[: start + count], start)
        for p, blob in snapshots.items() if spill.write_mode == "through" else ():
            spill.on_snapshot(ns.key, ids[:p], blob)

    def read_kv(self, ns_key: str, ids: np.ndarray, start: int, end: int) -> list[torch.Tensor | None] | None:
        """KV of positions [start, end) of `ids` if still resident (for the spill tier's writer)."""
        r = self._resident
        with r.lock:
            m = r.tree.match(ns_key, ids[:end], touch=False, create=False)
            if m.length < end:
                return None
            r.tree.lock(m.node, +1)
        try:
            return r.gather(m.slots(end)[start:end])
        finally:
            with r.lock:
                r.tree.lock(m.node, -1)


def _slicer(base: int, kv: list[torch.Tensor | None]) -> KVSource:
    """A KV source over tensors that start at position `base`."""

    def source(start: int, end: int) -> list[torch.Tensor | None]:
        assert start >= base, f"KV from position {base} cannot fill position {start}"
        return [None if t is None else t[start - base : end - base] for t in kv]

    return source
