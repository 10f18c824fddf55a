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

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvblocks.cache.layout import KVLayout, StateLayout
from kvblocks.spill.admin import clear_tiers, tier_sizes, tier_stats
from kvblocks.spill.lookup import Fetched, Lookup, locate
from kvblocks.spill.policy import WRITE_POLICIES, GatherKV, WritePolicy, write_mode
from kvblocks.spill.puts import Puts, ReadKV
from kvblocks.spill.records import ChunkCodec, NativeCodec, StateCodec
from kvblocks.spill.sealing import Sealer
from kvblocks.spill.tier import Tier
from kvblocks.spill.tier_counters import TierSlot
from kvblocks.spill.writer import DEFAULT_MAX_BYTES, Confirmed, Writer

log = logging.getLogger("kvblocks.spill")

__all__ = ["WRITE_POLICIES", "Fetched", "TierStack"]


class TierStack:
    """Spill tiers in order, fastest first, behind the one interface a trie uses.

    `tiers` are `Tier`s with distinct names. `secret` (at least 16 bytes, shared by every process
    of one deployment) makes keys keyed hashes and seals values with AES-256-GCM; `codec` picks another
    key and value format (the LMCache one) and excludes `secret`. `write_policy` is `write-through`
    (default) or `write-back` (`through` and `back` are accepted too). `queue_size` bounds the jobs
    waiting for the writer, `queue_bytes` the host memory they and the held ones take (chunks copied
    off the device, records moved between tiers), `retry_size` the jobs held for a down tier; `recheck_interval_s` is how often
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
        queue_bytes: int = DEFAULT_MAX_BYTES,
        retry_size: int = 256,
        retry_interval_s: float = 1.0,
        recheck_interval_s: float = 30.0,
    ) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        mode = write_mode(write_policy)
        if codec is not None and secret is not None:
            raise ValueError("a secret seals kvblocks' own records; it cannot apply to another codec")
        names = [t.name for t in tiers]
        if not tiers or len(set(names)) != len(names):
            raise ValueError(f"a tier stack needs one or more tiers with distinct names, got {names}")
        self.chunk_tokens, self.key_prefix, self.retry_interval_s = chunk_tokens, key_prefix, retry_interval_s
        self.codec: ChunkCodec = codec or NativeCodec(key_prefix, None if secret is None else Sealer(secret))
        if not isinstance(self.codec, NativeCodec) and any(
            getattr(t, "needs_verified_records", False) for t in tiers
        ):
            raise ValueError(
                "the disk tier relies on kvblocks' own records (checksummed or sealed) to catch damage "
                "inside a value; another format cannot be stored there"
            )
        for warning in (getattr(t, "trust_warning", "") for t in tiers):
            if warning and not self.codec.authenticated:
                log.warning(warning)
        self.slots = [TierSlot(t, i, retry_interval_s) for i, t in enumerate(tiers)]
        self.confirmed = Confirmed(recheck_interval_s)
        self.policy = WritePolicy(mode, self.slots, self.codec, chunk_tokens, self.confirmed)
        self.policy.spills_state = lambda: self.spills_state
        self.puts = Puts(self.codec, chunk_tokens, self.confirmed)
        self.lookup = Lookup(
            self.slots,
            self.codec,
            chunk_tokens,
            confirmed=self.confirmed,
            reject=self.policy.reject,
            promote=self.policy.promote,
        )
        self.writer = self.policy.writer = Writer(
            self.slots,
            self.puts.run,
            queue_size=queue_size,
            retry_size=retry_size,
            retry_interval_s=retry_interval_s,
            max_bytes=queue_bytes,
        )
        # only write-back demotes: under write-through every tier below has the records already, so
        # a tier's evictions are not read back (a disk tier would read each evicted file for nothing)
        for slot in self.slots if mode == "back" else ():
            if hasattr(slot.tier, "bind_demote") and slot.index + 1 < len(self.slots):
                slot.tier.bind_demote(lambda items, i=slot.index: self.policy.demoted(i, items))
        self._bound = False

    @property
    def tiers(self) -> list[Tier]:
        return [slot.tier for slot in self.slots]

    @property
    def shared(self) -> bool:
        """Whether other processes restore from these tiers (one of them is shared, as Redis is):
        KV events then report complete chunks evicted from the device as stored in the shared tier."""
        return any(getattr(t, "shared", False) for t in self.tiers)

    @property
    def write_mode(self) -> str:
        """`through` or `back` (the trie asks, to know which hooks to call)."""
        return self.policy.mode

    @property
    def write_policy(self) -> str:
        return f"write-{self.policy.mode}"

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
        if state is not None and not isinstance(self.codec, StateCodec):
            log.warning("kvblocks: this spill format has no state records; a recurrent model spills KV only")
        self._bound = True
        self.lookup.layout = self.puts.layout = layout
        self.lookup.state = self.puts.state = state
        self.lookup.device = self.policy.device = device
        self.puts.read_kv = read_kv

    @property
    def spills_state(self) -> bool:
        return self.lookup.state is not None and isinstance(self.codec, StateCodec)

    def key(self, namespace_key: str, chunk_hash: str) -> str:
        return self.codec.key(namespace_key, chunk_hash)

    # ---- read path (`spill.lookup`) --------------------------------------------------------

    def fetch(self, namespace_key: str, ids: np.ndarray, start: int, limit: int) -> Fetched | None:
        """Longest verified run of chunks continuing a device hit of `start` tokens, within `limit`,
        from the tiers in order; what a lower tier gave is promoted into the tiers above."""
        return self.lookup.fetch(namespace_key, ids, start, limit)

    def fetch_state(
        self, namespace_key: str, ids: np.ndarray, low: int, high: int
    ) -> tuple[int, torch.Tensor] | None:
        """The verified recurrent-state snapshot at the furthest chunk end in (low, high], as
        (position, snapshot on the device), or None."""
        return self.lookup.fetch_state(namespace_key, ids, low, high) if self.spills_state else None

    def locate(self, namespace_key: str, ids: np.ndarray, start: int, limit: int) -> list[tuple[str, int]]:
        """Which tiers hold the chunks continuing a device hit of `start` tokens: (tier, tokens) in
        order, from their sizes alone (nothing is read, verified or counted), for `explain`."""
        return locate(self.lookup, namespace_key, ids, start, limit)

    # ---- write path (`spill.policy`) -------------------------------------------------------

    def on_snapshot(self, namespace_key: str, ids: np.ndarray, blob: torch.Tensor) -> None:
        """The device keeps (write-through) or is about to drop (write-back) the recurrent-state
        snapshot after `ids`; one that ends a chunk is written, under that chunk's state key."""
        self.policy.on_snapshot(namespace_key, ids, blob)

    def on_insert(self, namespace_key: str, ids: np.ndarray, start: int) -> None:
        """Tokens `[start, len(ids))` of `ids` were just cached on the device (write-through)."""
        self.policy.on_insert(namespace_key, ids, start)

    def on_hit(self, namespace_key: str, ids: np.ndarray, length: int) -> None:
        """The device holds the first `length` tokens of `ids`: unless every chunk was seen in the
        tiers within `recheck_interval_s`, queue their write-through (a repair; write-through only)."""
        self.policy.on_hit(namespace_key, ids, length)

    def on_evict(self, namespace_key: str, ids: np.ndarray, evicted_from: int, read: GatherKV) -> None:
        """Tokens `[evicted_from, len(ids))` are about to leave the device pool (write-back):
        `read(start, end)` gathers still-resident KV; complete chunks that lose tokens are copied to
        the host now (asynchronously into pinned memory on a GPU) and written into the first tier."""
        self.policy.on_evict(namespace_key, ids, evicted_from, read)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until queued writes are done (or dropped); True if the queue drained in time."""
        return self.writer.flush(timeout_s)

    # ---- admin, reports (`spill.admin`) ----------------------------------------------------

    def clear(self, tier: str | None = None, batch: int = 500) -> int:
        """Delete every record under the key prefix, every model's and tenant's, from every tier or
        from the one named `tier` (an admin's `/flush_cache?spill=true` or `?tier=`); returns how
        many. Queued writes land first. RuntimeError when a tier fails, ValueError for an unknown
        tier or a foreign format, whose keys other programs read."""
        if not self.codec.delete_invalid:
            raise ValueError(
                "the spill tier holds another program's records (LMCache format); delete them there"
            )
        slots = [s for s in self.slots if tier in (None, s.name)]
        if not slots:
            raise ValueError(f"no spill tier named {tier!r}; this stack has {[s.name for s in self.slots]}")
        self.flush()
        return clear_tiers(slots, f"{self.key_prefix}:", batch)

    def server_warnings(self) -> list[str]:
        """Deployment problems worth a line at start (a Redis without maxmemory, ...)."""
        return [w for t in self.tiers if hasattr(t, "server_warnings") for w in t.server_warnings()]

    def stats(self) -> dict[str, int]:
        """Every tier's counters as `<tier>_<counter>` (`redis_hit_chunks`, `host_evictions`, ...)."""
        return tier_stats(self.slots, self.writer)

    def tier_sizes(self) -> list[dict[str, Any]]:
        """Each tier in order: name, health, used and capacity bytes, records."""
        return tier_sizes(self.slots)

    def close(self) -> None:
        """Finish queued writes, stop the writer thread and close every tier."""
        self.writer.close()
        for tier in self.tiers:
            tier.close()
