"""TierStack: the spill tiers below the device pool, in order (host memory, disk, Redis), as one.

The trie talks to this facade only (`kvblocks.cache.spill_link`): a device miss walks the tiers in
order for the chunks that continue the hit (`spill.lookup`), and what a lower tier had is promoted
into the device pool and, in the background, into the faster tiers above it. Writes go through one
bounded queue to one writer thread (`spill.writer`), by a write policy, as SGLang's HiCache names
them: `write-through` writes every completed chunk into every tier as soon as it is cached on the
device; `write-back` writes a chunk into the first tier only when the device pool evicts it, and a
tier that evicts by its own size bound (`bind_demote`) hands what it evicts to the next one.

The record codec (`spill.records`) and sealing (`spill.sealing`) are shared above the tiers, so every
tier holds the same sealed records under the same keys and a record moves between tiers unchanged.
A record that fails verification in any tier is a counted miss and deleted from that tier; an outage
(TierUnavailable) skips that tier for `retry_interval_s` (counted), never failing a request. Writes
that meet a down tier are held for it and retried, and a device hit on chunks not seen in the tiers
for `recheck_interval_s` queues their write-through, which writes only what each tier lacks (a
FLUSHALL, a restart, an eviction), so other replicas find them again.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import numpy as np
import torch

from kvblocks.cache.layout import KVLayout, StateLayout
from kvblocks.spill.lookup import Fetched, Lookup
from kvblocks.spill.puts import Puts, ReadKV
from kvblocks.spill.records import ChunkCodec, NativeCodec
from kvblocks.spill.sealing import Sealer
from kvblocks.spill.tier import Tier, TierUnavailable
from kvblocks.spill.tier_counters import TierSlot
from kvblocks.spill.writer import Confirmed, Job, Writer, copy_event, to_host

log = logging.getLogger("kvblocks.spill")

__all__ = ["WRITE_POLICIES", "Fetched", "TierStack"]

# --write-policy's names (HiCache's) -> the short names `write_mode` has always used
WRITE_POLICIES = {"write-through": "through", "write-back": "back"}


class TierStack:
    """Spill tiers in order, fastest first, behind the one interface a trie uses.

    `tiers` are `Tier`s with distinct names. `secret` (at least 16 bytes, shared by every process
    of one deployment) makes keys keyed hashes and seals values with AES-256-GCM; `codec` picks another
    key and value format (the LMCache one) and excludes `secret`. `write_policy` is `write-through`
    (default) or `write-back` (`through` and `back` are accepted too). `queue_size` bounds the jobs
    waiting for the writer, `retry_size` those held for a down tier; `recheck_interval_s` is how often
    a device hit checks that the tiers still have its chunks.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        chunk_tokens: int = 64,
        key_prefix: str = "kvblocks",
        secret: bytes | str | None = None,
        codec: ChunkCodec | None = None,
        write_policy: str = "write-through",
        queue_size: int = 64,
        retry_size: int = 256,
        retry_interval_s: float = 1.0,
        recheck_interval_s: float = 30.0,
    ) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        mode = WRITE_POLICIES.get(write_policy, write_policy)
        if mode not in ("through", "back"):
            raise ValueError(f"write_mode must be 'through' or 'back', got '{write_policy}'")
        if codec is not None and secret is not None:
            raise ValueError("a secret seals kvblocks' own records; it cannot apply to another codec")
        names = [t.name for t in tiers]
        if not tiers or len(set(names)) != len(names):
            raise ValueError(f"a tier stack needs one or more tiers with distinct names, got {names}")
        self.chunk_tokens, self.key_prefix, self.write_mode = chunk_tokens, key_prefix, mode
        self.retry_interval_s, self.retry_size = retry_interval_s, retry_size
        self.codec = (
            codec
            if codec is not None
            else NativeCodec(key_prefix, None if secret is None else Sealer(secret))
        )
        for tier in tiers:
            warning = getattr(tier, "trust_warning", None)
            if warning and not self.codec.authenticated:
                log.warning(warning)
        self.slots = [TierSlot(t, i, retry_interval_s) for i, t in enumerate(tiers)]
        self.confirmed = Confirmed(recheck_interval_s)
        self.puts = Puts(self.codec, chunk_tokens, self.confirmed)
        self.lookup = Lookup(
            self.slots,
            self.codec,
            chunk_tokens,
            confirmed=self.confirmed,
            reject=self._reject,
            promote=self._promote,
        )
        self.writer = Writer(
            self.slots,
            self.puts.run,
            queue_size=queue_size,
            retry_size=retry_size,
            retry_interval_s=retry_interval_s,
        )
        for slot in self.slots:
            if hasattr(slot.tier, "bind_demote"):
                slot.tier.bind_demote(lambda items, i=slot.index: self._demoted(i, items))
        self._device: torch.device | None = None
        self._bound = False

    @property
    def tiers(self) -> list[Tier]:
        return [slot.tier for slot in self.slots]

    @property
    def write_policy(self) -> str:
        return f"write-{self.write_mode}"

    @property
    def recheck_interval_s(self) -> float:
        return self.confirmed.recheck_interval_s

    # ---- wiring ----------------------------------------------------------------------------

    def bind(
        self,
        layout: KVLayout,
        device: torch.device,
        read_kv: ReadKV,
        namespace_key: str = "",
        state: StateLayout | None = None,
    ) -> None:
        """Called once by the owning KVCacheTrie; `namespace_key` is its unsalted namespace, `state`
        the layout of its model's recurrent-state snapshots (None for an attention-only model)."""
        if self._bound:
            raise ValueError("a spill tier belongs to one KVCacheTrie; create one per cache")
        self.codec.bind(layout, namespace_key)
        if state is not None and not hasattr(self.codec, "encode_state"):
            log.warning("kvblocks: this spill format has no state records; a recurrent model spills KV only")
        self._bound, self._device = True, device
        self.lookup.layout = self.puts.layout = layout
        self.lookup.state = self.puts.state = state
        self.lookup.device = device
        self.puts.read_kv = read_kv

    @property
    def spills_state(self) -> bool:
        return self.lookup.state is not None and hasattr(self.codec, "encode_state")

    def key(self, namespace_key: str, chunk_hash: str) -> str:
        return self.codec.key(namespace_key, chunk_hash)

    # ---- read path -------------------------------------------------------------------------

    def fetch(self, namespace_key: str, ids: np.ndarray, start: int, limit: int) -> Fetched | None:
        """Longest verified run of chunks continuing a device hit of `start` tokens, within `limit`,
        from the tiers in order (`spill.lookup`)."""
        return self.lookup.fetch(namespace_key, ids, start, limit)

    def fetch_state(
        self, namespace_key: str, ids: np.ndarray, low: int, high: int
    ) -> tuple[int, torch.Tensor] | None:
        """The verified recurrent-state snapshot at the furthest chunk end in (low, high], as
        (position, snapshot on the device), or None."""
        if not self.spills_state:
            return None
        return self.lookup.fetch_state(namespace_key, ids, low, high)

    # ---- write path ------------------------------------------------------------------------

    def on_snapshot(self, namespace_key: str, ids: np.ndarray, blob: torch.Tensor) -> None:
        """The device keeps (write-through) or is about to drop (write-back) the recurrent-state
        snapshot after `ids`; one that ends a chunk is written, under that chunk's state key."""
        if not self.spills_state or not len(ids) or len(ids) % self.chunk_tokens:
            return
        self.writer.enqueue(
            Job("state", self._targets(), (namespace_key, ids.copy(), blob.to("cpu", copy=True)))
        )

    def on_insert(self, namespace_key: str, ids: np.ndarray, start: int) -> None:
        """Tokens `[start, len(ids))` of `ids` were just cached on the device (write-through)."""
        c = self.chunk_tokens
        if self.write_mode != "through" or len(ids) // c <= start // c:
            return
        self.writer.enqueue(Job("through", self._targets(), (namespace_key, ids.copy(), start)))

    def on_hit(self, namespace_key: str, ids: np.ndarray, length: int) -> None:
        """The device holds the first `length` tokens of `ids`. A tier may have lost their chunks
        (FLUSHALL, a restart, eviction, a write dropped on an outage) while the device kept them:
        unless every chunk was seen within `recheck_interval_s`, queue a write-through of them from
        the first unseen one into the tiers that answer; each writes only what it lacks."""
        c = self.chunk_tokens
        targets = tuple(slot.index for slot in self.slots if slot.up())
        if self.write_mode != "through" or length < c or not targets:
            return
        end = length // c * c
        keys = [self.key(namespace_key, h) for h in self.codec.chunk_hashes(namespace_key, ids[:end], c)]
        first = self.confirmed.first_unseen(keys)
        if first is None:
            return
        self.confirmed.add(keys[first:])  # checked by the job: one job per chunk and interval
        for t in targets:
            self.slots[t].count(repair_jobs=1)
        self.writer.enqueue(Job("through", targets, (namespace_key, ids[:end].copy(), first * c)))

    def on_evict(self, namespace_key: str, ids: np.ndarray, evicted_from: int, read) -> None:
        """Tokens `[evicted_from, len(ids))` are about to leave the device pool (write-back).

        `read(start, end)` gathers still-resident KV; complete chunks that lose tokens are copied
        to the host now (asynchronously into pinned memory on a GPU), before their slots are reused,
        and written into the first tier in the background.
        """
        if self.write_mode != "back":
            return
        c = self.chunk_tokens
        first, last = evicted_from // c, len(ids) // c
        if first >= last:
            return
        hashes = self.codec.chunk_hashes(namespace_key, ids[: last * c], c)
        for k in range(first, last):
            kv = [to_host(t) for t in read(k * c, (k + 1) * c)]
            record = (self.key(namespace_key, hashes[k]), namespace_key, ids[k * c : (k + 1) * c].copy(), kv)
            self.writer.enqueue(Job("record", (0,), record, ready=copy_event(self._device)))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until queued writes are done (or dropped); True if the queue drained in time."""
        return self.writer.flush(timeout_s)

    # ---- admin, reports --------------------------------------------------------------------

    def clear(self, tier: str | None = None, batch: int = 500) -> int:
        """Delete every record under the key prefix, every model's and tenant's, from every tier or
        from the one named `tier` (an admin's `/flush_cache?spill=true`); returns how many. Queued
        writes land first. Raises RuntimeError when a tier fails, ValueError for an unknown tier or a
        foreign format, whose keys other programs read."""
        if not self.codec.delete_invalid:
            raise ValueError(
                "the spill tier holds another program's records (LMCache format); delete them there"
            )
        slots = self.slots if tier is None else [self._slot(tier)]
        self.flush()
        deleted = 0
        for slot in slots:
            try:
                keys = slot.tier.scan(f"{self.key_prefix}:")
                while chunk := list(itertools.islice(keys, batch)):
                    deleted += slot.tier.delete(chunk)
            except TierUnavailable as exc:
                slot.mark_down(exc)
                raise RuntimeError(f"the {slot.name} tier failed while deleting records: {exc}") from exc
        return deleted

    def server_warnings(self) -> list[str]:
        """Deployment problems worth a line at start (a Redis without maxmemory, ...)."""
        return [w for t in self.tiers if hasattr(t, "server_warnings") for w in t.server_warnings()]

    def stats(self) -> dict[str, int]:
        """Every tier's counters as `<tier>_<counter>`, with the writer's queue depth (one queue,
        shared) and the writes held for that tier."""
        out: dict[str, int] = {}
        for slot in self.slots:
            out |= slot.stats() | {
                f"{slot.name}_queue_depth": self.writer.depth(),
                f"{slot.name}_held_writes": self.writer.held(slot.index),
            }
        return out

    def tier_sizes(self) -> list[dict]:
        """Each tier in order: name, health, used and capacity bytes, records (None where the tier
        cannot say; a tier within its quiet window after an outage is not asked)."""
        out = []
        for slot in self.slots:
            row: dict = {"name": slot.name, "used_bytes": None, "capacity_bytes": None, "records": None}
            if not slot.up():
                out.append(row | {"health": "down"})
                continue
            try:
                health = slot.tier.health()
                records = getattr(slot.tier, "records", None)
                row |= {
                    "health": health.state,
                    "used_bytes": slot.tier.used_bytes(),
                    "capacity_bytes": slot.tier.capacity_bytes(),
                    "records": None if records is None else records(),
                }
            except TierUnavailable as exc:
                slot.mark_down(exc)
                row["health"] = "down"
            out.append(row)
        return out

    def close(self) -> None:
        """Finish queued writes, stop the writer thread and close every tier."""
        self.writer.close()
        for tier in self.tiers:
            tier.close()

    # ---- internals -------------------------------------------------------------------------

    def _targets(self) -> tuple[int, ...]:
        """Where a write goes by the policy: every tier (write-through) or the first (write-back)."""
        return tuple(range(len(self.slots))) if self.write_mode == "through" else (0,)

    def _slot(self, name: str) -> TierSlot:
        for slot in self.slots:
            if slot.name == name:
                return slot
        raise ValueError(f"no spill tier named {name!r}; this server has {[s.name for s in self.slots]}")

    def _reject(self, slot: TierSlot, key: str, counter: str) -> None:
        """Count a refused value and delete it: its key fixes format version, namespace and tokens,
        so it is useless to every reader, and write-through (which skips present keys) would never
        replace it. A foreign format's keys (LMCache) are shared with programs that may read them
        otherwise, so they stay."""
        slot.count(**{counter: 1})
        if self.codec.delete_invalid:
            self.writer.enqueue(Job("delete", (slot.index,), (key,)))

    def _promote(self, items: list[tuple[str, bytes]], index: int, counter: str) -> None:
        """Records verified in tier `index` are written into the faster tiers above it."""
        self.writer.enqueue(Job("raw", tuple(range(index)), (items,), counter))

    def _demoted(self, index: int, items: list[tuple[str, bytes]]) -> None:
        """Tier `index` evicted `items` by its own bound: under write-back they go one tier down
        (under write-through every tier below has them already). Runs on the writer's thread."""
        if self.write_mode == "back" and index + 1 < len(self.slots):
            self.writer.run_now(Job("raw", (index + 1,), (items,), "demoted_chunks"))
