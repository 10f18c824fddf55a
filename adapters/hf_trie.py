"""`kvblocks.KVCacheTrie`: the prefix cache (`kvblocks.cache.trie.PrefixCache`) speaking transformers.

The core takes layer specs and tensors and never imports transformers; this class gives it the
transformers bridge (`hf.HFBridge`) at construction, so `insert` reads a `DynamicCache` and
`Hit.to_hf_cache()` builds one, and `for_model` probes a model for its layout. It lives in
`adapters/` because only this package may know transformers' caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvblocks.adapters import hf
from kvblocks.cache.eviction import EvictionPolicy
from kvblocks.cache.layout import KVLayout, LayerSpec, StateLayout
from kvblocks.cache.namespace import Namespace, namespace_for
from kvblocks.cache.snapshots import DEFAULT_SNAPSHOT_EVERY
from kvblocks.cache.trie import STATE_ARENA_BYTES, PrefixCache

if TYPE_CHECKING:
    from kvblocks.spill.stack import TierStack

DEFAULT_CAPACITY_BYTES = 1 << 30


class KVCacheTrie(PrefixCache):
    """Token-prefix cache of a transformers model's KV, shared by all its requests (see `PrefixCache`)."""

    def __init__(
        self,
        config,
        specs: Sequence[LayerSpec],
        namespace: Namespace,
        *,
        state: StateLayout | None = None,
        **options,
    ) -> None:
        """`options` are `PrefixCache`'s (capacity_tokens, dtype, device, max_pinned_tokens, spill,
        eviction, snapshot_every); the bridge to transformers' caches is built from `config`."""
        self.config = config
        bridge = hf.HFBridge(config, tuple(specs), state)
        super().__init__(specs, namespace, bridge=bridge, state=state, **options)

    @classmethod
    def for_model(
        cls,
        model,
        capacity_tokens: int | None = None,
        *,
        capacity_bytes: int | None = None,
        max_pinned_tokens: int | None = None,
        spill: TierStack | None = None,
        eviction: str | EvictionPolicy | None = None,
        snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
    ) -> KVCacheTrie:
        """Probe the model's cache layout and preallocate a pool on its device and dtype.

        Capacity is `capacity_tokens`, or `capacity_bytes` of KV (default 1 GiB) divided by the
        bytes one token takes across all layers. `spill` adds a shared tier below the device
        pool (a `TierStack`, e.g. `RedisTier`). `eviction` orders what leaves a full pool: a `kvblocks.cache.eviction`
        policy or its name (`lru`, `gdsf`; default `gdsf`). On a recurrent or hybrid model the
        recurrent state is snapshotted every `snapshot_every` tokens (0: only where a request
        ends, branches or stops one token short), and the snapshots share the pool's capacity.
        """
        if capacity_tokens is not None and capacity_bytes is not None:
            raise ValueError("give capacity_tokens or capacity_bytes, not both")
        if getattr(model.config, "is_encoder_decoder", False):
            raise hf.UnsupportedModelError(
                f"model type '{model.config.model_type}' is an encoder-decoder model: its decoder's cache "
                "depends on the source too; use kvblocks.seq2seq.Seq2SeqCache.for_model"
            )
        specs, state = hf.describe(model)
        param = next(model.parameters())
        if capacity_tokens is None:
            per_token = KVLayout(param.dtype, tuple(specs)).token_bytes() or STATE_ARENA_BYTES
            capacity_tokens = (capacity_bytes or DEFAULT_CAPACITY_BYTES) // per_token
        return cls(
            model.config,
            specs,
            namespace_for(model),
            capacity_tokens=capacity_tokens,
            dtype=param.dtype,
            device=param.device,
            max_pinned_tokens=max_pinned_tokens,
            spill=spill,
            eviction=eviction,
            state=state,
            snapshot_every=snapshot_every,
        )
