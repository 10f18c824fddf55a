"""What each write job does in one tier (the writer thread runs them; `spill.writer` describes them).

A write never overwrites a record a tier holds already (`sizes` says so first), and for a foreign
format (LMCache's keys, read by other programs) it never overwrites any value at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvblocks.spill.bound import BoundCodec
from kvblocks.spill.records import ChunkCodec
from kvblocks.spill.tier_counters import TierSlot
from kvblocks.spill.writer import Confirmed, Job

# Reads the stack needs from its trie: (namespace key, ids, start, end) -> per-layer [n, 2, H, D]
# tensors, or None when those tokens are no longer resident.
ReadKV = Callable[[str, np.ndarray, int, int], "list[torch.Tensor | None] | None"]


class Puts(BoundCodec):
    """Runs write jobs against one tier at a time; bound to the trie's layout and reads by `bind`."""

    def __init__(self, codec: ChunkCodec, chunk_tokens: int, confirmed: Confirmed) -> None:
        super().__init__(codec)
        self.chunk_tokens, self.confirmed = chunk_tokens, confirmed
        self.read_kv: ReadKV | None = None

    def run(self, job: Job, slot: TierSlot) -> None:
        if job.kind == "through":
            self.through(slot, *job.args)
        elif job.kind == "state":
            self.state_record(slot, *job.args)
        elif job.kind == "record":
            self.records(slot, [job.args])
        elif job.kind == "raw":
            (items,) = job.args
            written = slot.tier.put(items)
            slot.count(**{job.counter: len(items)}, written_bytes=written)
        elif job.kind == "delete":  # records refused by verification: a tier may count them (`discard`)
            remove = getattr(slot.tier, "discard", slot.tier.delete)
            slot.count(deleted_invalid=remove(list(job.args)))
        else:
            raise ValueError(f"unknown write job {job.kind!r}")

    def through(self, slot: TierSlot, namespace_key: str, ids: np.ndarray, start: int) -> None:
        """Write the complete chunks of `ids` from `start` on that the tier lacks, read back out of
        the device (one that left it meanwhile is skipped)."""
        c = self.chunk_tokens
        hashes = self.codec.chunk_hashes(namespace_key, ids, c)
        wanted = list(range(start // c, len(hashes)))
        keys = [self.codec.key(namespace_key, hashes[k]) for k in wanted]
        lengths = slot.tier.sizes(keys)
        records = []
        for k, key, n in zip(wanted, keys, lengths):
            if self.holds_record(n, self.codec.size_bounds(key, namespace_key, c, self.bound_layout)):
                slot.count(write_skipped_present=1)
                self.confirmed.add([key])
                continue
            assert self.read_kv is not None, "the stack binds its reads before any write"
            kv = self.read_kv(namespace_key, ids[: (k + 1) * c], k * c, (k + 1) * c)
            if kv is None:
                slot.count(write_skipped_evicted=1)
                continue
            records.append((key, namespace_key, ids[k * c : (k + 1) * c], kv))
        self.records(slot, records)

    def records(self, slot: TierSlot, records: list[tuple[Any, ...]]) -> None:
        """Encode and write (key, namespace key, tokens, kv) records."""
        if not records:
            return
        items = [
            (key, self.codec.encode(key, ns, tokens, self.bound_layout, kv))
            for key, ns, tokens, kv in records
        ]
        written = slot.tier.put(items)
        slot.count(written_chunks=len(items), written_bytes=written)
        self.confirmed.add([key for key, _ in items])

    def state_record(self, slot: TierSlot, namespace_key: str, ids: np.ndarray, blob: torch.Tensor) -> None:
        c = self.chunk_tokens
        codec, state = self.state_codec()
        key = codec.state_key(namespace_key, codec.chunk_hashes(namespace_key, ids, c)[-1])
        bounds = codec.state_size_bounds(key, namespace_key, c, state)
        if self.holds_record(slot.tier.sizes([key])[0], bounds):
            slot.count(write_skipped_present=1)
            return
        value = codec.encode_state(key, namespace_key, ids[-c:], state, blob)
        slot.tier.put([(key, value)])
        slot.count(written_states=1, written_bytes=len(value))

    def holds_record(self, n: int, bounds: tuple[int, int]) -> bool:
        """Whether a write finds a record where `sizes` answered `n`: one of a record's size, or
        for a foreign format any value (other programs read those keys: never overwrite them)."""
        if not self.codec.delete_invalid:
            return n != 0
        return bounds[0] <= n <= bounds[1]
