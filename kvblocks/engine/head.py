"""The linear layers of packed forwards on CPU: their weights packed once (for oneDNN, or kvblocks' kernel).

A decode step of a real model is mostly reading weights: every linear layer's weight once per step
(Qwen2.5-Coder-1.5B: 1.5 billion weights, 3.1 GB in bfloat16, 6.2 GB in float32). What `F.linear`
takes on CPU packs the weight again on every call: MKL's product in float32 read the 1.5B shape's
layers at 16 rows at 3.6 GB/s, oneDNN's bfloat16 product at 10 GB/s; oneDNN's linear over a weight
reordered once into its own blocked layout read them at 15 GB/s in both dtypes (one thread;
BENCHMARKS.md, `kvblocks bench weights`). The output head is the largest product of a small model's
step (SmolLM2-135M: 49,152 x 576 float32 weights), where the reordered weight took it from 38-48 ms
to 22-23 ms at 16 rows.

In bfloat16 (on a CPU with AVX512-BF16, or AVX2 and FMA), a layer goes to kvblocks' own kernel
instead (`KernelLinear`, `kvblocks.engine.gemm`: the 16 rows of a decode step in the lanes of one
`vdpbf16ps`, every weight read once), where oneDNN's bfloat16 product at 16 rows reached about 0.4
of the memory's bandwidth on one thread; in float32 too on a CPU without AVX-512, where float32 is
the default dtype. oneDNN keeps float32 with AVX-512 and any shape whose kernel probe fails.

`PackedHead.of(model)` packs a model's head once, `PackedLinears.of(model)` every linear layer
of it (the head included): on CPU, in float32 or bfloat16 (where oneDNN has bfloat16 kernels, or
this CPU AVX512-BF16), where `probe` holds for the shape (a row comes out the same for any row
count from 4 up, so batch invariance holds, and within float rounding of `F.linear`). The bound:
each packed copy costs its weight's size in memory once more (the model's linear weights, once). Packed forwards switch them on for
their own thread (`scope`); every other call of the model, on any thread, takes each layer's own
forward, so ordinary forwards are unchanged.
"""

from __future__ import annotations

import functools
import threading
import types
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Row counts whose shared rows must come out the same (the largest: the reference). From 4 up: batch-
# invariant forwards give every product at least `probes.MIN_ROWS` (4) rows, and below it oneDNN takes
# another kernel for some shapes (1 row, in float32 for every Qwen2.5 layer), as BLAS does.
PROBE_ROWS = (4, 5, 17, 64)
# the layers under the head see whole prefill chunks too (the full-batch budget is 256 rows)
LAYER_PROBE_ROWS = (*PROBE_ROWS, 300)
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # rounding against F.linear, relative
_heads: weakref.WeakKeyDictionary[torch.nn.Module, PackedHead | None] = weakref.WeakKeyDictionary()
_models: weakref.WeakKeyDictionary[torch.nn.Module, PackedLinears | None] = weakref.WeakKeyDictionary()
_scope = threading.local()
KERNEL_RANGE = "kvblocks::linear"  # the profiler's name for a `KernelLinear` product (`bench.stepprofile`)
_lock = threading.Lock()


@functools.cache
def available() -> bool:
    """Whether this torch has oneDNN and its linear over a reordered weight."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]  # unannotated in torch
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class PackedHead:
    """A linear head whose weight is reordered for oneDNN, reordered again if the weight changes."""

    def __init__(
        self, module: torch.nn.Linear, rows_hint: int = 16, rows: tuple[int, ...] = PROBE_ROWS
    ) -> None:
        self.module = module
        self.rows_hint = rows_hint
        self.rows = rows  # the row counts `probe` tries
        self._key: tuple[int, int] | None = None
        self._weight: torch.Tensor | None = None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, model: PreTrainedModel) -> PackedHead | None:
        """The model's packed head (made once per head), or None where it cannot be used."""
        module = model.get_output_embeddings()
        with _lock:
            if module in _heads:
                return _heads[module]
            head = _choose(module, PROBE_ROWS, {})
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
                    self._weight = self.pack(w.detach())
                    self._key = key
        assert self._weight is not None, "packed above when the key changed"
        return self._weight

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` in the layout `product` takes (oneDNN's blocked one)."""
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, self.rows_hint)
        return packed

    def product(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, self.module.bias, "none", [], "")
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of the reordered weight (what it costs beside the model's own)."""
        return self.module.weight.numel() * self.module.weight.element_size()

    def for_module(self, module: torch.nn.Module) -> PackedHead | None:
        """This packed layer if it is `module`'s (what `scope` asks of what it holds)."""
        return self if module is self.module else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.eligible(self.module):  # moved off the CPU or to another dtype since
            return torch.nn.Linear.forward(self.module, x)
        return self.product(x, self.weight())

    @staticmethod
    def eligible(module: torch.nn.Module) -> bool:
        return _eligible(module)

    def probe(self) -> bool:
        """Whether a row of the packed product is the same for every row count in `PROBE_ROWS`, and
        within float rounding of `F.linear` (what batch invariance and exactness rely on)."""
        w = self.module.weight.detach()
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(max(self.rows), w.shape[1], generator=g).to(w.dtype)
        with torch.inference_mode():
            full = self(x)
            if not all(torch.equal(self(x[:rows]), full[:rows]) for rows in self.rows):
                return False
            plain = F.linear(x[:4], w, self.module.bias)
            tol = _TOLERANCE[w.dtype]
            return torch.allclose(full[:4], plain, rtol=tol, atol=tol * float(plain.abs().max()))


class KernelLinear(PackedHead):
    """A linear layer on `kvblocks.engine.gemm`'s kernel: bfloat16 (16 rows in the lanes of a vector,
    weights read once as broadcast operands: 0.6-0.7 of the memory's bandwidth at 16 rows where
    oneDNN's bfloat16 product reached about 0.4), and float32 on a CPU without AVX-512 (`gemm.float32`:
    4 rows by 24 columns of fused multiply-adds per weight load; BENCHMARKS.md, weights). Preferred
    to oneDNN where its probe holds for the shape."""

    @staticmethod
    def eligible(module: torch.nn.Module) -> bool:
        from kvblocks.engine import gemm

        dtype = module.weight.dtype if isinstance(module, torch.nn.Linear) else None
        return (
            type(module) is torch.nn.Linear
            and module.weight.device.type == "cpu"
            and (module.bias is None or module.bias.dtype == dtype)
            and (
                (dtype == torch.bfloat16 and module.in_features % 2 == 0 and gemm.library() is not None)
                or (dtype == torch.float32 and gemm.float32())
            )
        )

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        from kvblocks.engine import gemm

        return gemm.pack(weight.contiguous())

    def product(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        from kvblocks.engine import gemm

        with torch.profiler.record_function(KERNEL_RANGE):  # a ctypes call is no torch operator
            return gemm.linear(x, packed, self.module.out_features, self.module.bias)


class PackedLinears:
    """Every linear layer of a model on a weight reordered for oneDNN (the output head included),
    where its shape's `probe` holds; `scope` takes it as it takes a `PackedHead`."""

    def __init__(self, layers: dict[torch.nn.Module, PackedHead]) -> None:
        self.layers = layers

    def for_module(self, module: torch.nn.Module) -> PackedHead | None:
        return self.layers.get(module)

    @property
    def nbytes(self) -> int:
        """Bytes of the reordered weights (what they cost beside the model's own)."""
        return sum(p.nbytes for p in self.layers.values())

    @classmethod
    def of(cls, model: PreTrainedModel) -> PackedLinears | None:
        """The model's packed layers (made once per model), or None where none can be used. The
        probe runs once per kind, shape and dtype (what oneDNN's choice of kernel depends on), on
        the first layer of that shape."""
        with _lock:
            if model in _models:
                return _models[model]
        head = PackedHead.of(model)
        layers: dict[torch.nn.Module, PackedHead] = {}
        holds: dict[tuple[object, ...], bool] = {}
        for module in model.modules():
            if module is model.get_output_embeddings() or type(module) is not torch.nn.Linear:
                continue
            with _lock:
                if module in _heads:
                    packed = _heads[module]
                else:
                    packed = _choose(module, LAYER_PROBE_ROWS, holds)
                    if packed is not None:
                        module.forward = types.MethodType(_forward, module)  # type: ignore[method-assign]  # the packed product in `scope`
                    _heads[module] = packed
            if packed is not None:
                layers[module] = packed
        if head is not None:
            layers[head.module] = head
        out = cls(layers) if layers else None
        with _lock:
            _models[model] = out
        return out


def _choose(
    module: torch.nn.Linear, rows: tuple[int, ...], holds: dict[tuple[object, ...], bool]
) -> PackedHead | None:
    """`module` packed by the first kind that takes it and whose probe holds for its shape (the
    kernel's, then oneDNN's), or None; `holds` keeps each probe's answer per kind and shape."""
    for kind in (KernelLinear, PackedHead):
        if not kind.eligible(module):
            continue
        packed = kind(module, rows=rows)
        shape = (kind, *module.weight.shape, module.weight.dtype, module.bias is not None)
        if shape not in holds:
            holds[shape] = packed.probe()
        if holds[shape]:
            return packed
    return None


def _eligible(module: torch.nn.Module) -> bool:
    return (
        type(module) is torch.nn.Linear
        and module.weight.device.type == "cpu"
        and module.weight.dtype in _dtypes()
        and (module.bias is None or module.bias.dtype == module.weight.dtype)
        and available()
    )


@functools.cache
def _dtypes() -> tuple[torch.dtype, ...]:
    """The head dtypes oneDNN runs here: float32, and bfloat16 where this CPU has its kernels."""
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


def _forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A layer's forward once packed: the packed product inside `scope` on this thread, the
    module's own forward everywhere else (a copy of the module, unregistered, takes its own)."""
    held: PackedHead | PackedLinears | None = getattr(_scope, "head", None)
    packed = None if held is None else held.for_module(module)
    if packed is not None:
        return packed(x)
    return torch.nn.Linear.forward(module, x)


@contextmanager
def scope(head: PackedHead | PackedLinears | None) -> Iterator[None]:
    """Forwards on this thread inside the block use `head`'s packed layers (None: nothing changes)."""
    previous = getattr(_scope, "head", None)
    _scope.head = head
    try:
        yield
    finally:
        _scope.head = previous
