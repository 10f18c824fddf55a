"""The output head of packed forwards on CPU: its weight reordered once for oneDNN.

The output head is the largest matrix product of a small model's decode step (SmolLM2-135M: 49,152 x
576 float32 weights, 113 MB read for every step). MKL's product, what `F.linear` takes on CPU, packs
the weight again on every call and ran the head at 16 rows in 38-48 ms; oneDNN's linear over a
weight reordered once into its own blocked layout ran it in 22-23 ms (BENCHMARKS.md). The other
linear layers gain nothing measurable from a weight packed once.

`PackedHead.of(model)` reorders a model's head once: on CPU, in float32 (or bfloat16 where oneDNN
has bfloat16 kernels: 16 rows in 39 ms against `F.linear`'s 55 ms on SmolLM2, measured under load),
where oneDNN is built in and `probe` holds (a row comes out the same for any row count from 1 up, so batch invariance holds, and
within float rounding of `F.linear`). The reordered copy costs the head's size in memory once more.
Packed forwards switch it on for their own thread (`scope`); every other call of the model, on any
thread, takes the head's own forward, so ordinary forwards are unchanged.
"""

from __future__ import annotations

import functools
import threading
import types
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

PROBE_ROWS = (1, 3, 4, 17, 64)  # row counts whose shared rows must come out the same (64: the reference)
_heads: weakref.WeakKeyDictionary[torch.nn.Module, PackedHead | None] = weakref.WeakKeyDictionary()
_scope = threading.local()
_lock = threading.Lock()


@functools.cache
def available() -> bool:
    """Whether this torch has oneDNN and its linear over a reordered weight."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class PackedHead:
    """A linear head whose weight is reordered for oneDNN, reordered again if the weight changes."""

    def __init__(self, module: torch.nn.Linear, rows_hint: int = 16) -> None:
        self.module = module
        self.rows_hint = rows_hint
        self._key: tuple[int, int] | None = None
        self._weight: torch.Tensor | None = None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, model) -> PackedHead | None:
        """The model's packed head (made once per head), or None where it cannot be used."""
        module = model.get_output_embeddings()
        with _lock:
            if module in _heads:
                return _heads[module]
            head = cls(module) if _eligible(module) else None
            if head is not None and not head.probe():
                head = None
            if head is not None:
                module.forward = types.MethodType(_forward, module)
            _heads[module] = head
            return head

    def weight(self) -> torch.Tensor:
        """The reordered weight, redone when the module's weight was replaced or written in place
        (in place: not seen for a weight made in inference mode, which keeps no version counter)."""
        w = self.module.weight
        key = (w.data_ptr(), 0 if w.is_inference() else w._version)  # inference tensors keep no version
        if key != self._key:
            with self._lock:
                if key != self._key:
                    self._weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), self.rows_hint)
                    self._key = key
        return self._weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not _eligible(self.module):  # moved off the CPU or to another dtype since
            return torch.nn.Linear.forward(self.module, x)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight(), self.module.bias, "none", [], "")

    def probe(self) -> bool:
        """Whether a row of the packed product is the same for every row count in `PROBE_ROWS`, and
        within float rounding of `F.linear` (what batch invariance and exactness rely on)."""
        w = self.module.weight.detach()
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(max(PROBE_ROWS), w.shape[1], generator=g, dtype=w.dtype)
        with torch.inference_mode():
            full = self(x)
            if not all(torch.equal(self(x[:rows]), full[:rows]) for rows in PROBE_ROWS):
                return False
            plain = F.linear(x[:4], w, self.module.bias)
            tolerance = 1e-4 if w.dtype == torch.float32 else 2**-7  # bfloat16: its output's rounding
            return torch.allclose(full[:4], plain, rtol=tolerance, atol=tolerance * float(plain.abs().max()))


def _eligible(module) -> bool:
    return (
        type(module) is torch.nn.Linear
        and module.weight.device.type == "cpu"
        and module.weight.dtype in _dtypes()
        and available()
    )


@functools.cache
def _dtypes() -> tuple[torch.dtype, ...]:
    """The head dtypes oneDNN runs here: float32, and bfloat16 where this CPU has its kernels."""
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


def _forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The head's forward once packed: the packed product inside `scope` on this thread, the
    module's own forward everywhere else (a copy of the module, unregistered, takes its own)."""
    head = getattr(_scope, "head", None)
    if head is not None and head.module is module:
        return head(x)
    return torch.nn.Linear.forward(module, x)


@contextmanager
def scope(head: PackedHead | None) -> Iterator[None]:
    """Forwards on this thread inside the block use `head` (None: nothing changes)."""
    previous = getattr(_scope, "head", None)
    _scope.head = head
    try:
        yield
    finally:
        _scope.head = previous
