"""Attention over pool slots read in place: the CPU kernel of packed decodes (`csrc/attend.cpp`).

Decoding requests' keys lie in slots scattered over the pool: a shared system prompt in one run,
each request's own prompt and generated tokens wherever the trie put them. Before this kernel the
packed path gathered a request's keys into a new tensor with `index_select` for every layer of every
step and attended them in small fused calls; that gather and those calls were most of a decode
step's attention (BENCHMARKS.md, issue 23). The kernel attends segments of at most `MAX_WIDTH` new
tokens straight from the pool through their slot lists, 64 keys at a time, prefetching the next 64
while it computes these: one call per layer for all of them, a shared run read once for every row
of the segments that start with it, scores by register tiles of 4 rows by 64 keys. A row gets one
exact softmax over all its keys, no log-sum-exp merge.

It is built at first use with the machine's C++ compiler (`$CXX`, else `c++`, `g++` or `clang++`)
for this CPU (`-march=native`), without torch headers (about ten seconds), into the kvblocks cache
folder (`$KVBLOCKS_HOME/kernels`, default `~/.cache/kvblocks/kernels`), named by a hash of the
source, the flags, the compiler and the CPU; later processes load it from there. Where it cannot be
built or loaded (no compiler, a read-only home), or `KVBLOCKS_KERNEL=0`, or its probe fails,
packed forwards keep the gather path and `reason()` says why. Float32, float64 and bfloat16 pools
on CPU; other dtypes and devices keep the gather path. A bfloat16 pool is read as bfloat16 and
computed in float32 (each element widened exactly as it is read, then the float32 code), its outputs
rounded to bfloat16 and its log-sum-exps written in float32: a bfloat16 decode step's attention
no longer gathers keys and calls the fused kernel per segment (BENCHMARKS.md, dtype).

A row's result depends only on its query, the keys it sees and their number (see the source's
header): whatever else is in the call or the batch, and wherever the keys lie in the pool, it is
computed the same way, so batch-invariant forwards can use it. `probe` checks that on this machine,
and the result against a float64 reference, before it is used. The kernel runs on one thread (the
server's default, `torch.set_num_threads(1)`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

SOURCE = Path(__file__).with_name("csrc") / "attend.cpp"
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",  # no implicit fused multiply-add: every path rounds alike (fmadd is explicit)
    "-fno-math-errno",
    "-fPIC",
    "-shared",
    "-std=c++17",
)
BUILD_SECONDS = 300  # the compiler's limit
ENV = "KVBLOCKS_KERNEL"  # "0": never build or use the kernel
# Segments of at most this many new tokens are attended by the kernel; wider ones (prefill chunks)
# have enough query rows for PyTorch's fused kernel to run at its matrix-product rate.
MAX_WIDTH = 16
_FUNCTIONS = {
    torch.float32: "kvb_attend_f32",
    torch.float64: "kvb_attend_f64",
    torch.bfloat16: "kvb_attend_bf16",
}
_lock = threading.Lock()
_state: dict[str, object] = {}


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_identity() -> str:
    """What a `-march=native` binary depends on: the machine and its CPU's model and flags."""
    parts = [platform.machine(), platform.system()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    parts.append(line.strip())
                if line.strip() == "":
                    break  # the first processor's lines are enough
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def _folder() -> Path:
    from kvblocks.models import cache_home

    return cache_home() / "kernels"


def build(source: Path) -> Path:
    """The path of `source` (a file of `csrc/`) built as a library for this CPU, as this kernel is
    built; raises RuntimeError where there is no compiler or the build fails."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++ or clang++)")
    return _build(compiler, source)


def _build(compiler: str, source: Path = SOURCE) -> Path:
    """The library's path, compiled first if this source, flags, compiler and CPU have none yet."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(
        "\0".join([source.read_text(), *FLAGS, compiler, version, _cpu_identity()]).encode()
    ).hexdigest()[:20]
    folder = _folder()
    target = folder / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, "-o", partial, str(source)],
            capture_output=True,
            text=True,
            timeout=BUILD_SECONDS,
        )
        if done.returncode:
            raise RuntimeError(f"{Path(compiler).name} failed: {(done.stderr or done.stdout).strip()[-500:]}")
        os.replace(partial, target)  # atomic: processes building at once each leave a whole file
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def library() -> ctypes.CDLL | None:
    """The loaded kernel, built if needed; None where it cannot be had (`reason()` says why)."""
    with _lock:
        if "library" in _state:
            return _state["library"]  # type: ignore[return-value]
        lib, why = None, None
        if os.environ.get(ENV, "1") == "0":
            why = f"{ENV}=0"
        elif (compiler := _compiler()) is None:
            why = "no C++ compiler (set CXX, or install g++ or clang++)"
        else:
            try:
                lib = ctypes.CDLL(str(_build(compiler)))
                for name in _FUNCTIONS.values():
                    fn = getattr(lib, name)
                    fn.restype = ctypes.c_int
                    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_double]
                    fn.argtypes += [ctypes.c_void_p] * 2
            except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
                lib, why = None, f"could not build or load the kernel: {e}"
        _state["library"], _state["reason"] = lib, why
        return lib


def reason() -> str | None:
    """Why the kernel is not in use (None: built and loaded, or not tried yet)."""
    return _state.get("reason")  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class Plan:
    """What one kernel call attends, made once per forward and read by every layer: groups of
    segments, each group's shared keys (pool slots in position order, read once for all of its
    segments), and each segment's packed query rows (its outputs go to the same rows) and own keys
    after the shared ones, of which its `i`-th row sees the first `visible + i`. A row is computed
    the same way however its keys are split between shared and own (see `csrc/attend.cpp`)."""

    arrays: tuple[np.ndarray, ...]  # member_offsets, shared_offsets, shared, row_offsets, rows, key_offsets,
    # slots, visible: the kernel's `Plan` (a group's segments are consecutive)
    index: ctypes.Array[ctypes.c_void_p]  # their addresses, as the kernel takes them
    groups: int

    @classmethod
    def of(cls, groups: list[tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]]) -> Plan:
        """From (shared slots, [(packed rows, own slots), ...]) per group; each segment's new tokens
        are its last own keys, and each row sees the keys up to its own."""
        segments = [member for _, members in groups for member in members]
        counts = [len(members) for _, members in groups]
        widths = [len(rows) for rows, _ in segments]
        lengths = [len(slots) for _, slots in segments]

        def offsets(sizes: list[int]) -> np.ndarray:
            return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

        arrays = (
            offsets(counts),
            offsets([len(shared) for shared, _ in groups]),
            np.concatenate([shared for shared, _ in groups]).astype(np.int64),
            offsets(widths),
            np.concatenate([rows for rows, _ in segments]).astype(np.int64),
            offsets(lengths),
            np.concatenate([slots for _, slots in segments]).astype(np.int64),
            np.array([n - w + 1 for n, w in zip(lengths, widths)], dtype=np.int64),
        )
        index = (ctypes.c_void_p * len(arrays))(*(a.ctypes.data for a in arrays))
        return cls(arrays, index, len(groups))


def attend(
    query: torch.Tensor,
    pool_layer: torch.Tensor,
    plan: Plan,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
) -> None:
    """Attention of the plan's rows of `query [1, Hq, T, D]` over their slots of `pool_layer
    [slots, 2, Hkv, D]`, written into `out [T, Hq, D]` and, if given, their log-sum-exps into `lse
    [T, Hq]` (both contiguous: `out` of the query's dtype, `lse` of `lse_dtype(dtype)`) at the rows'
    own places; other rows are left as they are."""
    q = query[0]
    if q.stride(-1) != 1:
        q = q.contiguous()
    heads, _, dim = q.shape
    outputs = ((out, q.dtype),) if lse is None else ((out, q.dtype), (lse, lse_dtype(q.dtype)))
    if q.dtype != pool_layer.dtype or not all(t.is_contiguous() and t.dtype == d for t, d in outputs):
        raise ValueError(
            "the kernel takes queries in the pool's dtype and writes contiguous outputs in it "
            "(log-sum-exps in at least float32)"
        )
    layout = (ctypes.c_int64 * 8)(
        q.stride(0), q.stride(1), *pool_layer.stride()[:3], heads, pool_layer.shape[2], dim
    )
    fn = getattr(library(), _FUNCTIONS[q.dtype])
    code = fn(
        q.data_ptr(),
        pool_layer.data_ptr(),
        plan.index,
        plan.groups,
        layout,
        scale,
        out.data_ptr(),
        None if lse is None else lse.data_ptr(),
    )
    if code:
        raise RuntimeError(
            f"the attention kernel refused its arguments (code {code}): head dim {dim}, {heads} heads"
        )


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernel writes log-sum-exps in: the pool's, at least float32."""
    return torch.promote_types(dtype, torch.float32)


@functools.cache
def probe(dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> bool:
    """Whether the kernel, on this machine, attends like a float64 reference (within the dtype's
    rounding) and gives a row the same bits alone and among other rows and segments, wherever its keys
    lie in the pool: what packed and batch-invariant forwards rely on."""
    if dtype not in _FUNCTIONS or library() is None:
        return False
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(200, 2, kv_heads, dim, generator=g, dtype=dtype)
    query = torch.randn(1, 9, heads, dim, generator=g, dtype=dtype).transpose(1, 2)  # [1, Hq, 9, D], strided
    scale = dim**-0.5

    def run(
        pool_: torch.Tensor, entries: list[tuple[Any, list[tuple[Any, Any]]]]
    ) -> tuple[torch.Tensor, ...]:
        plan = Plan.of(
            [
                (np.asarray(shared), [(np.asarray(r), np.asarray(s)) for r, s in members])
                for shared, members in entries
            ]
        )
        out = torch.full((9, heads, dim), float("nan"), dtype=dtype)
        lse = torch.full((9, heads), float("nan"), dtype=lse_dtype(dtype))
        attend(query, pool_, plan, scale, out, lse)
        return out[[0, 1, 2]], lse[[0, 1, 2]]

    moved = pool.clone()
    moved[150:190] = pool[5:45]  # the same keys elsewhere in the pool
    try:
        alone = run(pool, [([], [([0, 1, 2], np.arange(5, 45))])])
        among = run(  # 17 of its keys shared with another segment, the rest its own
            pool,
            [
                ([], [([4], np.arange(100, 190))]),
                (np.arange(5, 22), [([8], np.arange(22, 25)), ([0, 1, 2], np.arange(22, 45))]),
            ],
        )
        elsewhere = run(
            moved, [(np.arange(150, 170), [([7], np.arange(60, 70)), ([0, 1, 2], np.arange(170, 190))])]
        )
    except RuntimeError:
        return False
    same = all(torch.equal(alone[0], x[0]) and torch.equal(alone[1], x[1]) for x in (among, elsewhere))
    # a float64 reference: row i sees the first 38 + i of the 40 keys
    kv = pool[5:45].double()
    k = kv[:, 0].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    v = kv[:, 1].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    scores = query[0, :, [0, 1, 2]].double() @ k.transpose(1, 2) * scale  # [Hq, 3, 40]
    scores.masked_fill_(torch.arange(40)[None, :] >= torch.arange(38, 41)[:, None], float("-inf"))
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-5}.get(
        dtype, 1e-2
    )  # bfloat16: its output's rounding
    reference = (scores.softmax(-1) @ v).transpose(0, 1)
    close = torch.allclose(alone[0].double(), reference, atol=tolerance, rtol=tolerance)
    sums = torch.logsumexp(scores, -1).T  # in float32 for bfloat16 too
    close = close and torch.allclose(alone[1].double(), sums, atol=1e-12 if dtype == torch.float64 else 1e-5)
    return bool(same and close)
