"""Preallocated device KV pool: one slot tensor per layer, slots handed out from a free list.

Layer `l` is a tensor `[capacity, 2, H_l, D_l]` (K at index 0, V at 1) on the model's device and
dtype, so storing is a single `index_copy_` per layer. Where every layer that keeps KV has the same
shape, the layers are views of one `[layers, capacity, 2, H, D]` tensor and re-attaching a prefix
of every layer is one `index_select` over its flat `[layers * capacity, ...]` view (`gather_all`):
on a GPU one launch instead of one per layer, which for small rows (2 KB per token and layer on a
Llama-1B shape) is what bounds the bandwidth. Slot bookkeeping is two int32 arrays; there is no
Python object per token.

A slot can also hold bytes of a recurrent-state snapshot (`write_blob` / `read_blob`): a snapshot
of B bytes takes `slots_for(B)` slots, laid across the same memory as their KV would be, so
snapshots and tokens share one capacity and one eviction. A model with no attention layer has no
KV to lay them across; its pool gets an `arena` of `arena_bytes` per slot instead.
"""

from __future__ import annotations

import numpy as np
import torch

from kvblocks.cache.layout import KVLayout
from kvblocks.cache.radix import SLOT_DTYPE


class KVPool:
    def __init__(
        self, layout: KVLayout, capacity_tokens: int, device: torch.device | str, arena_bytes: int = 0
    ) -> None:
        if capacity_tokens <= 0:
            raise ValueError(f"capacity must hold at least one token, got {capacity_tokens}")
        self.layout = layout
        self.capacity = capacity_tokens
        self.dtype = layout.dtype
        self.device = torch.device(device)
        self._stack, self.layers = _allocate(layout, capacity_tokens, self.device)
        # where each stacked layer starts in the flat view (index offsets of `gather_all`)
        self._offsets = (
            None
            if self._stack is None
            else torch.arange(self._stack.shape[0], device=self.device)[:, None] * capacity_tokens
        )
        self.arena = (
            torch.empty(capacity_tokens, arena_bytes, dtype=torch.uint8, device=self.device)
            if arena_bytes
            else None
        )
        # every slot's memory as bytes: one [capacity, bytes] view per layer (and the arena)
        self._bytes = [t.view(capacity_tokens, -1).view(torch.uint8) for t in self.layers if t is not None]
        if self.arena is not None:
            self._bytes.append(self.arena)
        self.slot_bytes = sum(v.shape[1] for v in self._bytes)
        self._free = np.arange(capacity_tokens - 1, -1, -1, dtype=SLOT_DTYPE)
        self._num_free = capacity_tokens

    @property
    def stacked(self) -> bool:
        """Whether the layers are views of one tensor (`gather_all` is then one call)."""
        return self._stack is not None

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def token_bytes(self) -> int:
        return self.layout.token_bytes()

    def alloc(self, n: int) -> np.ndarray:
        assert 0 <= n <= self._num_free, (n, self._num_free)
        start = self._num_free - n
        slots: np.ndarray = self._free[start : self._num_free][::-1].copy()
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
        return self._layer(layer).index_select(0, index)

    def gather_all(self, index: torch.Tensor, fused: bool | None = None) -> list[torch.Tensor | None]:
        """KV of `index` slots for every layer (None where a layer keeps none), each `[n, 2, H, D]`.
        `fused` (the default off the CPU, where a launch per layer bounds small rows): one
        `index_select` over the stacked layers where they share a shape; else one per layer (on a CPU
        the fused call's larger index costs more than the calls it saves)."""
        if fused is None:
            fused = self.device.type != "cpu"
        if self._stack is None or self._offsets is None or not fused:
            return [None if t is None else t.index_select(0, index) for t in self.layers]
        layers, n = self._stack.shape[0], index.shape[0]
        flat = self._stack.view(layers * self.capacity, *self._stack.shape[2:])
        rows = iter(flat.index_select(0, (self._offsets + index).view(-1)).view(layers, n, *flat.shape[1:]))
        return [None if t is None else next(rows) for t in self.layers]

    def scatter(self, layer: int, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store `[n, H, D]` keys and values into `index` slots of one layer."""
        self._layer(layer).index_copy_(0, index, torch.stack((keys, values), dim=1).to(self.dtype))

    def _layer(self, layer: int) -> torch.Tensor:
        t = self.layers[layer]
        assert t is not None, f"layer {layer} keeps no KV"
        return t

    def slots_for(self, nbytes: int) -> int:
        """Slots a blob of `nbytes` takes."""
        if not self.slot_bytes:
            raise ValueError("this pool has no slot memory to hold a snapshot")
        return -(-nbytes // self.slot_bytes)

    def write_blob(self, slots: np.ndarray, blob: torch.Tensor) -> None:
        """Store a uint8 blob across `slots` (slot i holds bytes [i * slot_bytes, (i + 1) * slot_bytes))."""
        n = len(slots)
        rows = torch.zeros(n * self.slot_bytes, dtype=torch.uint8, device=self.device)
        rows[: blob.numel()] = blob.to(self.device)
        rows = rows.view(n, self.slot_bytes)
        index, offset = self.index(slots), 0
        for view in self._bytes:
            width = view.shape[1]
            view.index_copy_(0, index, rows[:, offset : offset + width])
            offset += width

    def read_blob(self, slots: np.ndarray, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of the blob `write_blob` stored across `slots` (a fresh tensor)."""
        index = self.index(slots)
        rows = torch.cat([view.index_select(0, index) for view in self._bytes], dim=1)
        return rows.reshape(-1)[:nbytes].clone()


def _allocate(
    layout: KVLayout, capacity: int, device: torch.device
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """The per-layer slot tensors: views of one `[layers, capacity, 2, H, D]` tensor when every layer
    that keeps KV has the same shape (so `gather_all` is one call), else separate tensors."""
    shapes = {shape for shape in layout.shapes if shape[0]}
    if len(shapes) != 1:
        return None, layout.empty(capacity, device)
    heads, dim = shapes.pop()
    kept = sum(1 for shape in layout.shapes if shape[0])
    stack = torch.empty(kept, capacity, 2, heads, dim, dtype=layout.dtype, device=device)
    views = iter(stack.unbind(0))
    return stack, [next(views) if shape[0] else None for shape in layout.shapes]
