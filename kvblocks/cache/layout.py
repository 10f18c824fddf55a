"""What a model caches, layer by layer: the one shape type the pool, the trie, the transformers
adapter and the Redis records share. Nothing here imports more than torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True, frozen=True)
class LayerSpec:
    """What one decoder layer caches: `kind` is "full", "sliding" (the last `window` tokens) or "none"
    (a KV-sharing or MLP-only layer, which caches nothing); `heads` x `head_dim` per token for K and V."""

    kind: str
    heads: int = 0
    head_dim: int = 0
    window: int = 0

    @property
    def caches(self) -> bool:
        return self.kind != "none"

    def tokens_held(self, length: int) -> int:
        """How many of the last `length` tokens a fresh cache layer must hold."""
        if self.kind == "none":
            return 0
        if self.kind == "sliding":
            return min(length, self.window - 1)
        return length


@dataclass(slots=True, frozen=True)
class KVLayout:
    """A model's KV layout: dtype and one `LayerSpec` per layer. The pool allocates it; a Redis record
    must match it to be usable (layers that cache nothing are written as 0 x 0)."""

    dtype: torch.dtype
    layers: tuple[LayerSpec, ...]

    @classmethod
    def from_shapes(cls, dtype: torch.dtype, shapes: Sequence[tuple[int, int]]) -> KVLayout:
        """From (heads, head_dim) per layer, (0, 0) for a layer that caches nothing."""
        return cls(dtype, tuple(LayerSpec("full", h, d) if h else LayerSpec("none") for h, d in shapes))

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """(heads, head_dim) per layer, (0, 0) where it caches nothing."""
        return tuple((s.heads, s.head_dim) if s.caches else (0, 0) for s in self.layers)

    def token_bytes(self) -> int:
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return sum(2 * h * d * elem for h, d in self.shapes)

    def shape(self, n: int) -> list[Any]:
        """The `shape` field of a record of `n` tokens."""
        return [n, [list(x) for x in self.shapes]]

    def empty(
        self, n: int, device: torch.device | str = "cpu", pin_memory: bool = False
    ) -> list[torch.Tensor | None]:
        """Uninitialised tensors `[n, 2, H, D]` per layer (None where a layer caches nothing);
        `pin_memory` host tensors copy to a GPU asynchronously (`non_blocking=True`)."""
        return [
            torch.empty(n, 2, h, d, dtype=self.dtype, device=device, pin_memory=pin_memory) if h else None
            for h, d in self.shapes
        ]


@dataclass(slots=True, frozen=True)
class StateSpec:
    """One recurrent state tensor of a layer (a conv window or an SSM / linear-attention state):
    `kind` is "conv" or "recurrent", `index` the layer's state number, `offset` where its bytes
    start in a snapshot (8-byte aligned, so every tensor can be viewed in place)."""

    layer: int
    kind: str
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size() * int(torch.Size(self.shape).numel())


@dataclass(slots=True, frozen=True)
class StateLayout:
    """What a snapshot of a recurrent model holds: every state tensor of every layer, packed into
    one byte string of `nbytes` (the same bytes on the device, in the pool and in a Redis record)."""

    states: tuple[StateSpec, ...]

    @classmethod
    def packed(cls, tensors: Sequence[tuple[int, str, int, tuple[int, ...], torch.dtype]]) -> StateLayout:
        """From (layer, kind, index, shape, dtype) in snapshot order."""
        out, offset = [], 0
        for layer, kind, index, shape, dtype in tensors:
            spec = StateSpec(layer, kind, index, tuple(shape), dtype, offset)
            out.append(spec)
            offset += -(-spec.nbytes // 8) * 8
        return cls(tuple(out))

    @property
    def nbytes(self) -> int:
        if not self.states:
            return 0
        last = self.states[-1]
        return last.offset + -(-last.nbytes // 8) * 8

    def describe(self) -> list[list[Any]]:
        """The layout as plain data, for a record's header: [layer, kind, index, shape, dtype] each."""
        return [
            [s.layer, s.kind, s.index, list(s.shape), str(s.dtype).removeprefix("torch.")]
            for s in self.states
        ]

    def views(self, blob: torch.Tensor) -> list[torch.Tensor]:
        """Each state tensor as a view into a `[nbytes]` uint8 snapshot."""
        return [blob[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in self.states]
