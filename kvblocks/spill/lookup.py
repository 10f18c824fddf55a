"""The stack's read path: what a device miss finds in the tiers, verified, before the model runs.

Each tier in order is asked for the longest run of chunks continuing what the levels above found:
one `sizes` call finds the consecutive chunks present with the size a record must have, one `get`
(bounded by that size) fetches them, and each is verified into rows of a host buffer (pinned when
the device is a GPU, so the copy up is asynchronous, on a side stream: `spill.transfer`). A value
of the wrong size or type is refused unread, one that fails verification ends the run; either is
counted and deleted from its tier.
A tier that is down is skipped (counted), one that fails is marked down: a miss, never an error.
A recurrent model's state snapshot at a chunk end is found the same way, the furthest wins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvblocks.spill.bound import BoundCodec
from kvblocks.spill.records import ChunkCodec, VerificationError
from kvblocks.spill.tier import TierUnavailable, Value
from kvblocks.spill.tier_counters import TierSlot
from kvblocks.spill.transfer import is_cuda, upload
from kvblocks.spill.writer import Confirmed

# (tier slot, key, counter) -> count a refused record and delete it from that tier
Reject = Callable[[TierSlot, str, str], None]
# (records verified in a lower tier, that tier's index) -> copy them into the tiers above
Promote = Callable[[list[tuple[str, Value]], int, str], None]


@dataclass(slots=True)
class Fetched:
    """Verified KV for positions `[start, start + length)`: per-layer `[length, 2, H, D]`; `tiers`
    says how many of those tokens each tier gave, in order."""

    start: int
    length: int
    kv: list[torch.Tensor | None]
    tiers: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Target:
    """What one lookup asks for: the chunk keys from `first` on, and the size bounds of each."""

    namespace_key: str
    ids: np.ndarray
    first: int
    keys: list[str]
    bounds: list[tuple[int, int]]


class Lookup(BoundCodec):
    """Reads for a `TierStack`; bound to its layout and device once the trie is known."""

    def __init__(
        self,
        slots: list[TierSlot],
        codec: ChunkCodec,
        chunk_tokens: int,
        *,
        confirmed: Confirmed,
        reject: Reject,
        promote: Promote,
    ) -> None:
        super().__init__(codec)
        self.slots, self.chunk_tokens, self.confirmed = slots, chunk_tokens, confirmed
        self._reject, self._promote = reject, promote
        self.device: torch.device | None = None

    def fetch(self, namespace_key: str, ids: np.ndarray, start: int, limit: int) -> Fetched | None:
        """Longest verified run of chunks continuing a device hit of `start` tokens, within `limit`."""
        c = self.chunk_tokens
        first = start // c
        hashes = self.codec.chunk_hashes(namespace_key, ids[:limit], c)
        if first >= len(hashes):
            return None
        keys = [self.codec.key(namespace_key, h) for h in hashes[first:]]
        bounds = [self.codec.size_bounds(k, namespace_key, c, self.bound_layout) for k in keys]
        parts: list[list[torch.Tensor | None]] = []
        tiers: dict[str, int] = {}
        done = 0
        for slot in self.slots:
            if done == len(keys):
                break
            if not slot.up():
                slot.count(skipped_while_down=1)
                continue
            target = Target(namespace_key, ids, first + done, keys[done:], bounds[done:])
            kv, found = self._run(slot, target)
            if not found:
                continue
            parts.append(kv)
            gained = len(found) * c - (start - first * c if done == 0 else 0)
            slot.count(hit_chunks=len(found), hit_tokens=gained)
            tiers[slot.name] = gained
            if slot.index > 0:
                self._promote(found, slot.index, "promoted_chunks")
            done += len(found)
        self.confirmed.add(keys[:done])
        if done == 0:
            return None
        kv = [_join([p[layer] for p in parts]) for layer in range(len(parts[0]))]
        return Fetched(first * c, done * c, upload(kv, self.device), tiers)

    def _run(self, slot: TierSlot, t: Target) -> tuple[list[torch.Tensor | None], list[tuple[str, Value]]]:
        """The verified run `slot`'s tier holds of `t`: its KV rows and its (key, record)s."""
        c = self.chunk_tokens
        slot.count(lookups=1, lookup_chunks=len(t.keys))
        try:
            lengths = slot.tier.sizes(t.keys)
            run = next(
                (
                    i
                    for i, (k, n, b) in enumerate(zip(t.keys, lengths, t.bounds))
                    if not self.sized(slot, k, n, b)
                ),
                len(t.keys),
            )
            if run == 0:
                return [], []
            values = slot.tier.get(t.keys[:run], [b[1] for b in t.bounds[:run]])
        except TierUnavailable as exc:
            slot.mark_down(exc)
            return [], []
        # Chunks decode straight into their rows of one tensor per layer; the run ends before the
        # first chunk that fails verification.
        restored = self.bound_layout.empty(run * c, pin_memory=is_cuda(self.device))
        found: list[tuple[str, Value]] = []
        for i, raw in enumerate(values):
            if raw is None or len(raw) != lengths[i]:  # replaced since `sizes` answered: next lookup sees it
                break
            pos = (t.first + i) * c
            rows = [None if x is None else x[i * c : (i + 1) * c] for x in restored]
            try:
                self.codec.decode_into(
                    raw, t.keys[i], t.namespace_key, t.ids[pos : pos + c], self.bound_layout, rows
                )
            except VerificationError:
                self._reject(slot, t.keys[i], "verify_failures")
                break
            found.append((t.keys[i], raw))
            slot.count(read_bytes=len(raw))
        # A run cut short is copied out of its buffer, whose rest holds what the failed chunk wrote
        # before its check failed (unauthenticated or non-finite), or was never written at all.
        n = len(found) * c
        cut = len(found) < run
        return [None if x is None else (x[:n].clone() if cut else x) for x in restored], found

    def fetch_state(
        self, namespace_key: str, ids: np.ndarray, low: int, high: int
    ) -> tuple[int, torch.Tensor] | None:
        """The verified recurrent-state snapshot at the furthest chunk end in (low, high], as
        (position, snapshot on the device), or None. A snapshot that fails verification is a miss
        (and deleted); the next one down is tried, then the next tier for one further on."""
        c = self.chunk_tokens
        hashes = self.codec.chunk_hashes(namespace_key, ids[:high], c)
        ends = [(k + 1) * c for k in range(len(hashes) - 1, low // c - 1, -1)]  # furthest first
        best: tuple[int, torch.Tensor] | None = None
        codec, _ = self.state_codec()
        for slot in self.slots:
            if not ends:
                break
            if not slot.up():
                slot.count(skipped_while_down=1)
                continue
            keys = [codec.state_key(namespace_key, hashes[end // c - 1]) for end in ends]
            slot.count(state_lookups=1)
            found = self._state_in(slot, namespace_key, ids, ends, keys)
            if found is None:
                continue
            end, blob, record = found
            best = end, blob
            ends = ends[: ends.index(end)]  # a lower tier is asked only for a snapshot further on
            if slot.index > 0:
                self._promote([record], slot.index, "promoted_chunks")
        return None if best is None else (best[0], best[1].to(self.device))

    def _state_in(
        self, slot: TierSlot, namespace_key: str, ids: np.ndarray, ends: list[int], keys: list[str]
    ) -> tuple[int, torch.Tensor, tuple[str, Value]] | None:
        c = self.chunk_tokens
        codec, state = self.state_codec()
        try:
            lengths = slot.tier.sizes(keys)
            for end, key, n in zip(ends, keys, lengths):
                bounds = codec.state_size_bounds(key, namespace_key, c, state)
                if not self.sized(slot, key, n, bounds):
                    continue
                raw = slot.tier.get([key], [bounds[1]])[0]
                if raw is None or len(raw) != n:
                    continue
                try:
                    blob = codec.decode_state(raw, key, namespace_key, ids[end - c : end], state)
                except VerificationError:
                    self._reject(slot, key, "verify_failures")
                    continue
                slot.count(state_hits=1, read_bytes=len(raw))
                return end, blob, (key, raw)
        except TierUnavailable as exc:
            slot.mark_down(exc)
        return None

    def sized(self, slot: TierSlot, key: str, n: int, bounds: tuple[int, int]) -> bool:
        """Whether `sizes` answered that `key` holds a value of a record's size. A key of another
        type (-1) or size is refused unread and deleted (an absent key, length 0, is just absent)."""
        if n < 0:
            self._reject(slot, key, "rejected_type")
            return False
        if n == 0:
            return False
        if not bounds[0] <= n <= bounds[1]:
            self._reject(slot, key, "rejected_size")
            return False
        return True


def locate(
    lookup: Lookup, namespace_key: str, ids: np.ndarray, start: int, limit: int
) -> list[tuple[str, int]]:
    """(tier, tokens) of each tier of `lookup` that holds chunks continuing a device hit of `start`
    tokens, in order, by their sizes alone: what `fetch` would try, for `explain`. Reads, verifies,
    deletes and counts nothing; a tier that is down or fails is left out."""
    c = lookup.chunk_tokens
    first = start // c
    hashes = lookup.codec.chunk_hashes(namespace_key, ids[:limit], c)
    keys = [lookup.codec.key(namespace_key, h) for h in hashes[first:]]
    out, done = [], 0
    for slot in lookup.slots:
        if done == len(keys) or not slot.up():
            continue
        try:
            lengths = slot.tier.sizes(keys[done:])
        except TierUnavailable:
            continue
        bounds = (lookup.codec.size_bounds(k, namespace_key, c, lookup.bound_layout) for k in keys[done:])
        run = next(
            (i for i, (n, b) in enumerate(zip(lengths, bounds)) if not b[0] <= n <= b[1]), len(lengths)
        )
        if run:
            out.append((slot.name, run * c - (start - first * c if done == 0 else 0)))
            done += run
    return out


def _join(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    present = [p for p in parts if p is not None]  # a layer keeps KV in every part or in none
    if not present:
        return None
    return present[0] if len(present) == 1 else torch.cat(present)
