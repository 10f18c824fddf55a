"""A locked match: what `match` and `hold` hand out, and the only way to read a hit's KV."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvblocks.cache.namespace import Namespace
from kvblocks.cache.radix import Match

if TYPE_CHECKING:
    from kvblocks.cache.trie import PrefixCache


class Hit:
    """A locked match: the first `length` tokens are resident and stay so until `release()`."""

    def __init__(
        self, trie: PrefixCache, namespace: Namespace, match: Match, length: int, matched: int | None = None
    ) -> None:
        self.trie = trie
        self.namespace = namespace
        self.length = length
        # tokens resident on the device (on a recurrent model the hit stops at the last snapshot
        # before them; a request prefilling from `length` snapshots at `matched`, the branch point)
        self.matched = length if matched is None else matched
        self._match = match
        self._slots = match.slots(length)
        # tokens the spill tiers gave this lookup past the device's, by tier in lookup order (`match`)
        self.tiers: dict[str, int] = {}
        self._locked = length > 0
        if self._locked:
            trie._tree.lock(match.node, +1)

    @property
    def slots(self) -> np.ndarray:
        """The pool slots of the `length` hit tokens, in order (read-only; valid until `release()`)."""
        view: np.ndarray = self._slots.view()
        view.flags.writeable = False
        return view

    def to_hf_cache(self) -> Any:
        """A fresh framework cache (a transformers `DynamicCache` for `kvblocks.KVCacheTrie`) holding
        the KV of the `length` hit tokens, built by the cache's bridge."""
        if self.length and not self._locked:
            raise RuntimeError("this hit was released; its slots may already hold other tokens")
        return self.trie.bridge.build(self._kv(), self.length, self._state())

    def _kv(self) -> list[torch.Tensor | None]:
        """Each layer's KV of the last hit tokens it holds (a sliding window holds fewer)."""
        pool, length = self.trie.pool, self.length
        held = {spec.tokens_held(length) for spec in self.trie.specs if spec.kind != "none"}
        if len(held) == 1 and 0 not in held:  # every layer reads the same slots: one gather for all
            (n,) = held
            return pool.gather_all(pool.index(self._slots[length - n : length]))
        kv: list[torch.Tensor | None] = []
        indices: dict[int, torch.Tensor] = {}
        for layer, spec in enumerate(self.trie.specs):
            tokens = spec.tokens_held(length)
            if spec.kind == "none" or tokens == 0:
                kv.append(None)
                continue
            index = indices.get(tokens)
            if index is None:
                index = indices[tokens] = pool.index(self._slots[length - tokens : length])
            kv.append(pool.gather(layer, index))
        return kv

    def _state(self) -> torch.Tensor | None:
        """The recurrent-state snapshot the hit ends at (None for a model without one)."""
        return (
            self.trie.snapshots.blob(self._match.node)
            if self.trie.state is not None and self.length
            else None
        )

    def release(self) -> None:
        if self._locked:
            with self.trie._lock:
                self.trie._tree.lock(self._match.node, -1)
            self._locked = False

    def __enter__(self) -> Hit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Hit(length={self.length}, locked={self._locked})"
