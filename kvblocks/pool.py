"""Preallocated device KV pool: one slot tensor per layer, slots handed out from a free list.

Layer `l` is a tensor `[capacity, 2, H_l, D_l]` (K at index 0, V at 1) on the model's device and
dtype, so re-attaching a prefix is a single `index_select` per layer and storing is a single
`index_copy_`. Slot bookkeeping is two int32 arrays; there is no Python object per token.
"""

from __future__ import annotations

import numpy as np
import torch

from kvblocks.layout import KVLayout
from kvblocks.radix import SLOT_DTYPE


class KVPool:
    def __init__(self, layout: KVLayout, capacity_tokens: int, device: torch.device | str) -> None:
        if capacity_tokens <= 0:
            raise ValueError(f"capacity must hold at least one token, got {capacity_tokens}")
        self.layout = layout
        self.capacity = capacity_tokens
        self.dtype = layout.dtype
        self.device = torch.device(device)
        self.layers: list[torch.Tensor | None] = layout.empty(capacity_tokens, self.device)
        self._free = np.arange(capacity_tokens - 1, -1, -1, dtype=SLOT_DTYPE)
        self._num_free = capacity_tokens

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def token_bytes(self) -> int:
        return self.layout.token_bytes()

    def alloc(self, n: int) -> np.ndarray:
        assert 0 <= n <= self._num_free, (n, self._num_free)
        start = self._num_free - n
        slots = self._free[start : self._num_free][::-1].copy()
        self._num_free = start
        return slots

    def release(self, slots: np.ndarray) -> None:
        n = len(slots)
        assert self._num_free + n <= self.capacity
        self._free[self._num_free : self._num_free + n] = slots[::-1]
        self._num_free += n

    def index(self, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(
            self.device, non_blocking=True
        )

    def gather(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        """KV of `index` slots for one layer as `[n, 2, H, D]`."""
        return self.layers[layer].index_select(0, index)

    def scatter(self, layer: int, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store `[n, H, D]` keys and values into `index` slots of one layer."""
        self.layers[layer].index_copy_(0, index, torch.stack((keys, values), dim=1).to(self.dtype))
