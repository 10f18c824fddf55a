"""Products of few rows over bfloat16 or float32 weights packed once: the CPU kernel `csrc/linear.cpp`.

A batch decode step multiplies 16 rows or fewer by every weight of the model, so it runs at the
rate the weights stream in from memory if the arithmetic keeps up. On a CPU with AVX512-BF16 and no
AMX, oneDNN's bfloat16 product at 16 rows read the Qwen2.5-Coder-1.5B layers' weights at about 0.4
of the memory's bandwidth on one thread; this kernel puts the 16 rows in the 16 lanes of a vector and
reads each pair of weights once as a broadcast operand of one `vdpbf16ps` (BENCHMARKS.md, weights).
A row's result depends only on its own inputs and the weights (see the source's header), so batch-
invariant forwards can use it for every row count; `kvblocks.engine.head` probes that per shape
before it does. On a CPU with AVX2 and FMA but no AVX512-BF16 (AMD Zen 2/3) the same source builds
the same sums with 8-lane fused multiply-adds over weights widened to float32 (two instructions per
weight at 16 rows: a quarter of AVX512-BF16's weight bytes per instruction), where torch's own bfloat16 product has no
fast kernel at all (0.55 GB/s at 16 rows on a loaded Zen 3 core, against 1.8-2.9 GB/s here).

On such a CPU float32 is the default dtype, and the same source has a float32 product (`float32`):
4 rows by 24 columns of 8-lane fused multiply-adds per load of 24 weights, each row's sums in its own
registers, so a row's result again depends only on its inputs and the weights. It replaces oneDNN's
float32 product over a reordered weight, whose small-row kernels read the 1.5B model's layers at
0.29 of the memory's bandwidth at 16 rows (BENCHMARKS.md, weights). Where the CPU has AVX-512,
oneDNN's 16-lane float32 product stays.

It is built at first use as the attention kernel is (`kernel.build`: the machine's compiler,
`-march=native`, the kvblocks cache folder), and only where this CPU has AVX512-BF16 or AVX2 and FMA;
`KVBLOCKS_KERNEL=0` turns it off with the attention kernel. The bound: a packed weight is the
weight's size once more (its columns padded to a multiple of 24).
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import time
from pathlib import Path

import torch

from kvblocks.engine import kernel
from kvblocks.models import cpu_flags

SOURCE = Path(__file__).with_name("csrc") / "linear.cpp"
_CHAINS = {32: 24, 8: 12}  # independent instructions per round of `kvb_linear_peak`, by build (its macs)
_ARGS = {
    "kvb_linear_packed_size": ([ctypes.c_int64] * 2, ctypes.c_int64),
    "kvb_linear_pack_bf16": ([ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p], ctypes.c_int),
    "kvb_linear_bf16": (
        [ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p, ctypes.c_int64]
        + [ctypes.c_void_p] * 2
        + [ctypes.c_int64],
        ctypes.c_int,
    ),
    "kvb_linear_pack_f32": ([ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p], None),
    "kvb_linear_f32": (
        [ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p, ctypes.c_int64]
        + [ctypes.c_void_p] * 2
        + [ctypes.c_int64],
        ctypes.c_int,
    ),
    "kvb_linear_peak": ([ctypes.c_int64, ctypes.c_int], ctypes.c_int),
    "kvb_linear_macs": ([ctypes.c_int], ctypes.c_int),
}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, built if needed; None where this CPU has neither AVX512-BF16 nor AVX2 and
    FMA, there is no compiler, or `KVBLOCKS_KERNEL=0`."""
    if os.environ.get(kernel.ENV, "1") == "0" or not _supported():
        return None
    try:
        lib = ctypes.CDLL(str(kernel.build(SOURCE)))
        for name, (args, result) in _ARGS.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, result
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError):
        return None
    return lib if lib.kvb_linear_peak(1, 0) == 0 else None  # built with neither: 2


def _supported() -> bool:
    """Whether this CPU has AVX512-BF16 (the kernel's instruction) or else AVX2 and FMA."""
    flags = cpu_flags() or frozenset()
    return "avx512_bf16" in flags or {"avx2", "fma"} <= flags


@functools.cache
def float32() -> bool:
    """Whether float32 layers take the kernel here: where it is built and this CPU has no AVX-512
    (there float32 is the default dtype, and oneDNN's float32 product has the same 8-lane vectors;
    with AVX-512, oneDNN's 16-lane product keeps float32)."""
    flags = cpu_flags() or frozenset()
    return library() is not None and {"avx2", "fma"} <= flags and "avx512f" not in flags


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [n, k] (bfloat16 with k even, or float32; rows contiguous) in the kernel's layout."""
    lib = library()
    assert lib is not None and weight.dtype in (torch.bfloat16, torch.float32) and weight.stride(-1) == 1
    n, k = weight.shape
    out = torch.empty(lib.kvb_linear_packed_size(n, k), dtype=weight.dtype)
    if weight.dtype == torch.float32:
        lib.kvb_linear_pack_f32(weight.data_ptr(), n, k, weight.stride(0), out.data_ptr())
    elif lib.kvb_linear_pack_bf16(weight.data_ptr(), n, k, weight.stride(0), out.data_ptr()):
        raise ValueError(f"the linear kernel takes an even number of input features, not {k}")
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight.T + bias` over the `pack`ed weight of `n` output features, in the packed weight's
    dtype (bfloat16 or float32)."""
    lib = library()
    assert lib is not None
    dtype, shape = packed.dtype, x.shape
    rows = x.reshape(-1, shape[-1])
    if rows.stride(-1) != 1 or rows.dtype != dtype:
        rows = rows.contiguous().to(dtype)
    out = torch.empty(rows.shape[0], n, dtype=dtype)
    b = None if bias is None else bias.detach().contiguous().to(dtype)
    product = lib.kvb_linear_f32 if dtype == torch.float32 else lib.kvb_linear_bf16
    code = product(
        rows.data_ptr(),
        rows.shape[0],
        rows.shape[1],
        rows.stride(0),
        packed.data_ptr(),
        n,
        None if b is None else b.data_ptr(),
        out.data_ptr(),
        n,
    )
    if code:
        raise RuntimeError(f"the linear kernel refused its arguments (code {code}): {tuple(shape)} x {n}")
    return out.reshape(*shape[:-1], n)


def ceiling(dtype: torch.dtype, rows: int) -> float | None:
    """Weight bytes per second the core's multiply-adds can serve to `rows` rows, at most: `peak`
    times the weight-row multiply-adds of one instruction (`kvb_linear_macs`: 32 for `vdpbf16ps`, 16
    for a 16-lane `vfmadd231ps`, 8 for an 8-lane one) / `rows` x the weight's bytes. None where the
    kernel is not built here."""
    lib = library()
    rate = peak(dtype)
    if lib is None or rate is None:
        return None
    macs = int(lib.kvb_linear_macs(0 if dtype == torch.bfloat16 else 1))
    return rate * macs / rows * torch.empty(0, dtype=dtype).element_size()


def peak(dtype: torch.dtype, seconds: float = 0.2) -> float | None:
    """Instructions per second this core runs of the product's multiply-add for `dtype` (bfloat16:
    `vdpbf16ps`, float32: `vfmadd231ps`, each on 16 lanes with a broadcast memory operand; in the
    AVX2 build `vfmadd231ps` on 8 lanes for both), median of three runs of CPU time; None where the
    kernel is not built here."""
    lib = library()
    if lib is None or dtype not in (torch.bfloat16, torch.float32):
        return None
    kind = 0 if dtype == torch.bfloat16 else 1
    rounds = 1_000_000
    start = time.process_time()
    lib.kvb_linear_peak(rounds, kind)
    rounds = max(rounds, int(rounds * seconds / max(time.process_time() - start, 1e-6)))
    rates = []
    for _ in range(3):
        start = time.process_time()
        lib.kvb_linear_peak(rounds, kind)
        rates.append(_CHAINS[lib.kvb_linear_macs(0)] * rounds / max(time.process_time() - start, 1e-9))
    return sorted(rates)[1]
