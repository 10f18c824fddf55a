"""When the stack writes, by its write policy (SGLang HiCache's names):

- `write-through` (`through`): every completed chunk is written into every tier as soon as the device
  caches it, so other processes hit at once; a device hit on chunks not seen in the tiers for
  `recheck_interval_s` queues their write-through again, which writes only what each tier lacks (a
  tier that lost records to a FLUSHALL, a restart or its own eviction is repaired);
- `write-back` (`back`): a chunk is written into the first tier only when the device pool evicts it,
  and a tier that evicts by its own size bound hands what it evicts one tier down.

Either way a record found in a lower tier is promoted into the tiers above it, and a record refused
by verification is deleted from its tier: all of it through the writer's queue, off the request path.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvblocks.spill.records import ChunkCodec
from kvblocks.spill.tier import Value
from kvblocks.spill.tier_counters import TierSlot
from kvblocks.spill.transfer import offload
from kvblocks.spill.writer import Confirmed, Job, Writer

# (start, end) -> each layer's still-resident KV of those positions, None for a layer that keeps none
GatherKV = Callable[[int, int], list[torch.Tensor | None]]

# --write-policy's names (HiCache's) -> the short names `write_mode` has always used
WRITE_POLICIES = {"write-through": "through", "write-back": "back"}


def write_mode(policy: str) -> str:
    """`through` or `back` from either name; ValueError otherwise."""
    mode = WRITE_POLICIES.get(policy, policy)
    if mode not in ("through", "back"):
        raise ValueError(f"write_mode must be 'through' or 'back', got '{policy}'")
    return mode


class WritePolicy:
    """The stack's write hooks: what each event of the device (and of the tiers) queues."""

    def __init__(
        self, mode: str, slots: list[TierSlot], codec: ChunkCodec, chunk_tokens: int, confirmed: Confirmed
    ) -> None:
        self.mode, self.slots, self.codec, self.chunk_tokens = mode, slots, codec, chunk_tokens
        self.confirmed = confirmed
        self.writer: Writer | None = None  # set by the stack once it made its writer
        self.device: torch.device | None = None
        self.spills_state: Callable[[], bool] = lambda: False

    def targets(self) -> tuple[int, ...]:
        """Where a write goes: every tier (write-through) or the first (write-back)."""
        return tuple(range(len(self.slots))) if self.mode == "through" else (0,)

    def on_snapshot(self, namespace_key: str, ids: np.ndarray, blob: torch.Tensor) -> None:
        if not self.spills_state() or not len(ids) or len(ids) % self.chunk_tokens:
            return
        args = (namespace_key, ids.copy(), blob.to("cpu", copy=True))
        self._enqueue(Job("state", self.targets(), args))

    def on_insert(self, namespace_key: str, ids: np.ndarray, start: int) -> None:
        c = self.chunk_tokens
        if self.mode != "through" or len(ids) // c <= start // c:
            return
        self._enqueue(Job("through", self.targets(), (namespace_key, ids.copy(), start)))

    def on_hit(self, namespace_key: str, ids: np.ndarray, length: int) -> None:
        c = self.chunk_tokens
        targets = tuple(slot.index for slot in self.slots if slot.up())
        if self.mode != "through" or length < c or not targets:
            return
        end = length // c * c
        hashes = self.codec.chunk_hashes(namespace_key, ids[:end], c)
        keys = [self.codec.key(namespace_key, h) for h in hashes]
        first = self.confirmed.first_unseen(keys)
        if first is None:
            return
        self.confirmed.add(keys[first:])  # checked by the job: one job per chunk and interval
        for t in targets:
            self.slots[t].count(repair_jobs=1)
        self._enqueue(Job("through", targets, (namespace_key, ids[:end].copy(), first * c)))

    def on_evict(self, namespace_key: str, ids: np.ndarray, evicted_from: int, read: GatherKV) -> None:
        if self.mode != "back":
            return
        c = self.chunk_tokens
        first, last = evicted_from // c, len(ids) // c
        if first >= last:
            return
        hashes = self.codec.chunk_hashes(namespace_key, ids[: last * c], c)
        for k in range(first, last):
            kv, ready = offload(read(k * c, (k + 1) * c), self.device)  # pinned, async on a GPU
            tokens = ids[k * c : (k + 1) * c].copy()
            record = (self.codec.key(namespace_key, hashes[k]), namespace_key, tokens, kv)
            nbytes = sum(t.nbytes for t in kv if t is not None)
            self._enqueue(Job("record", (0,), record, ready=ready, nbytes=nbytes))

    def _enqueue(self, job: Job) -> None:
        assert self.writer is not None, "the stack sets its writer before anything is written"
        self.writer.enqueue(job)

    def reject(self, slot: TierSlot, key: str, counter: str) -> None:
        """Count a refused value and delete it: its key fixes format version, namespace and tokens,
        so it is useless to every reader, and write-through (which skips present keys) would never
        replace it. A foreign format's keys (LMCache) are shared with programs that may read them
        otherwise, so they stay."""
        slot.count(**{counter: 1})
        if self.codec.delete_invalid:
            self._enqueue(Job("delete", (slot.index,), (key,)))

    def promote(self, items: list[tuple[str, Value]], index: int, counter: str) -> None:
        """Records verified in tier `index` are written into the faster tiers above it."""
        nbytes = sum(len(v) for _, v in items)
        self._enqueue(Job("raw", tuple(range(index)), (items,), counter, nbytes=nbytes))

    def demoted(self, index: int, items: list[tuple[str, Value]]) -> None:
        """Tier `index` evicted `items` by its own bound: under write-back they go one tier down
        (under write-through every tier below has them already). Runs on the writer's thread."""
        if self.mode == "back" and index + 1 < len(self.slots):
            nbytes = sum(len(v) for _, v in items)
            assert self.writer is not None
            self.writer.run_now(Job("raw", (index + 1,), (items,), "demoted_chunks", nbytes=nbytes))
