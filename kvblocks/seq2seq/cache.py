"""Seq2SeqCache: prefix reuse for encoder-decoder models, as two `PrefixCache`s under one source key.

A request is (source ids, decoder ids). Both caches look its tokens up in a namespace whose salt
carries a content hash of the source (`Seq2SeqCache.scope`), so requests over the same source
share and requests over different sources never do, even where one source begins another.

* `sources` keeps one record per source: the encoder output and the cross-attention K/V of each
  source position. Encoder outputs depend on the whole source, so only a whole record is used; it
  is stored padded to whole spill chunks, so a Redis tier holds all of it.
* `decoder` is a prefix trie of decoder self-attention K/V, exactly as for a decoder-only model.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import xxhash

from kvblocks.adapters import hf_seq2seq
from kvblocks.adapters.hf_seq2seq import SourceKV
from kvblocks.adapters.hf_trie import DEFAULT_CAPACITY_BYTES
from kvblocks.cache.eviction import EvictionPolicy
from kvblocks.cache.layout import KVLayout, LayerSpec
from kvblocks.cache.namespace import Namespace, Scope, namespace_for
from kvblocks.cache.radix import TOKEN_DTYPE
from kvblocks.cache.trie import PrefixCache, Salt, as_token_array

if TYPE_CHECKING:
    from kvblocks.spill.stack import TierStack

# The token a source record's lookup key ends with: `match` always leaves its last token out, and
# this one is never stored, so a whole record can be a hit. Any id works (the namespace is per source).
_END = 0


def source_hash(source_ids) -> str:
    return xxhash.xxh3_128(as_token_array(source_ids).astype(TOKEN_DTYPE).tobytes()).hexdigest()


@dataclass(slots=True, frozen=True)
class SourceScope(Scope):
    """A request's scope inside a seq2seq model: its tenant, and a salt that is the client's salt and
    the source's hash; `source` is the request's `SourceUse` (not part of its identity)."""

    source: SourceUse | None = field(default=None, compare=False, repr=False)


@dataclass(slots=True)
class SourceUse:
    """One request's source: its ids, encoder output and cross K/V, and whether they came from the cache."""

    ids: list[int]
    kv: SourceKV
    cached: bool
    stored: bool = False  # its record was kept by this request


@dataclass(slots=True)
class EncoderCounters:
    """Encoder work: sources encoded (and their tokens), sources served from the cache instead, records kept."""

    encoder_runs: int = 0
    encoder_tokens: int = 0
    encoder_reused: int = 0
    encoder_reused_tokens: int = 0
    sources_stored: int = 0


class Seq2SeqCache:
    """Source records and decoder prefixes of one seq2seq model (see the module doc)."""

    def __init__(self, decoder: PrefixCache, sources: PrefixCache) -> None:
        self.decoder = decoder
        self.sources = sources
        self.counters = EncoderCounters()
        self._lock = threading.Lock()
        self._stored: dict[SourceScope, list[int]] = {}  # records stored and maybe still resident

    @classmethod
    def for_model(
        cls,
        model,
        capacity_tokens: int | None = None,
        *,
        source_capacity_tokens: int | None = None,
        capacity_bytes: int | None = None,
        spill: TierStack | None = None,
        source_spill: TierStack | None = None,
        eviction: str | EvictionPolicy | None = None,
        max_pinned_tokens: int | None = None,
    ) -> Seq2SeqCache:
        """Probe the model and preallocate both pools on its device and dtype.

        Each pool holds `capacity_tokens` / `source_capacity_tokens` tokens, or `capacity_bytes`
        (default 1 GiB) each. A Redis tier belongs to one cache: `spill` backs the decoder
        prefixes, `source_spill` (another `RedisTier`, the same server will do) the source records.
        """
        decoder_specs, source_specs = hf_seq2seq.describe(model)
        param = next(model.parameters())
        namespace = namespace_for(model)

        def cache(specs: list[LayerSpec], bridge, ns: Namespace, tokens: int | None, tier) -> PrefixCache:
            if tokens is None:
                tokens = (capacity_bytes or DEFAULT_CAPACITY_BYTES) // KVLayout(
                    param.dtype, tuple(specs)
                ).token_bytes()
            return PrefixCache(
                specs,
                ns,
                bridge=bridge,
                capacity_tokens=tokens,
                dtype=param.dtype,
                device=param.device,
                max_pinned_tokens=max_pinned_tokens,
                spill=tier,
                eviction=eviction,
            )

        decoder = cache(
            decoder_specs, hf_seq2seq.DecoderBridge(tuple(decoder_specs)), namespace, capacity_tokens, spill
        )
        sources = cache(
            source_specs,
            hf_seq2seq.SourceBridge(tuple(source_specs)),
            replace(namespace, model=namespace.model + "#source"),
            source_capacity_tokens,
            source_spill,
        )
        return cls(decoder, sources)

    def scope(self, source_ids: list[int], salt: Salt) -> SourceScope:
        """The scope both caches look a request's tokens up in: its tenant, its salt and its source."""
        base = salt if isinstance(salt, Scope) else Scope("", salt or "")
        return SourceScope(base.tenant, json.dumps([base.salt, source_hash(source_ids)]))

    def lookup(self, source_ids: list[int], scope: SourceScope) -> SourceKV | None:
        """The whole cached record of this source (a copy), or None: a part of one is of no use."""
        key = self._key(source_ids)
        with self.sources.match([*key, _END], salt=scope) as hit:
            whole = hit.length == len(key)
            kv = hit.to_hf_cache() if whole else None
        with self._lock:
            if whole:
                self.counters.encoder_reused += 1
                self.counters.encoder_reused_tokens += len(source_ids)
        return None if kv is None else hf_seq2seq.trimmed(kv, len(source_ids))

    def holds(self, source_ids: list[int], scope: SourceScope) -> bool:
        """Whether the whole record of this source is resident (no lock, no counting)."""
        key = self._key(source_ids)
        return self.sources.cached_length(key, salt=scope) == len(key)

    def encoded(self, tokens: int) -> None:
        """Count one encoder run over `tokens` source tokens."""
        with self._lock:
            self.counters.encoder_runs += 1
            self.counters.encoder_tokens += tokens

    def store(self, source_ids: list[int], scope: SourceScope, kv: SourceKV) -> bool:
        """Keep a source's record (its cross K/V computed); False when the pool could not take all of it."""
        key = self._key(source_ids)
        stored = self.sources.insert(key, hf_seq2seq.padded(kv, len(key)), salt=scope)
        whole = self.holds(source_ids, scope)
        if stored and whole:
            with self._lock:
                self.counters.sources_stored += 1
                self._stored[replace(scope, source=None)] = list(source_ids)
        return whole

    def records(self) -> int:
        """Source records resident whole (a scrape's gauge); records evicted since are forgotten."""
        with self._lock:  # never taken while the source pool's own lock is held, so no deadlock
            self._stored = {scope: ids for scope, ids in self._stored.items() if self.holds(ids, scope)}
            return len(self._stored)

    def _key(self, source_ids: list[int]) -> list[int]:
        """The source's ids padded with `_END` to whole spill chunks."""
        chunk = self.sources.spill.chunk_tokens if self.sources.spill is not None else 1
        return [*source_ids, *[_END] * (-len(source_ids) % chunk)]

    def stats(self, *, tenant: str | None = None) -> dict[str, int]:
        """The decoder trie's counters, the source records' under `source_`, and (for the whole
        server, not one tenant: they are not kept per tenant) the encoder work and `source_records`."""
        out = self.decoder.stats(tenant=tenant)
        out |= {f"source_{k}": v for k, v in self.sources.stats(tenant=tenant).items()}
        if tenant is not None:
            return out
        out["source_records"] = self.records()
        with self._lock:
            out |= {k: getattr(self.counters, k) for k in self.counters.__dataclass_fields__}
        return out

    def clear(self) -> int:
        """Evict every unlocked, unpinned decoder token and source record (`/flush_cache`)."""
        return self.decoder.clear() + self.sources.clear()

    def close(self) -> None:
        self.decoder.close()
        self.sources.close()
