"""Where a forward's time goes, and how close it runs to the machine's matrix-product peak.

`profile_step` times a step (CPU clock, median of a few runs) with `dispatch.attention_clock` open,
which adds up the CPU time of every packed attention call, Python included:
- attention: that share of the step ("gather + attend": gathers, fused calls, merges, and the
  Python that plans and drives them), measured without a profiler.
The rest of the step is split by the fastest of three more runs under the PyTorch profiler, in the
proportions it finds outside the attention calls (wall clock, as the profiler times operators; a
single profiled run once put a pause of the shared machine into "python/other": 37% of a cascade
step against 9% of the invariant step on the same shapes, in one benchmark run):
- matmul: matrix products (the linear layers and the output head, oneDNN's and kvblocks' bfloat16
  kernel's included: `head.KERNEL_RANGE` names each of its calls),
- copies: copy, index, gather and concatenation kernels,
- other kernels: every other operator's own time (norms, activations, rotary),
- python/other: what no operator accounts for (the interpreter, module calls; in the profiled run
  this also holds the profiler's own bookkeeping, so it is an upper bound).
`attention_kernels` is the part of the attention calls the profiler finds inside operators.

`matmul_peak` measures the FLOP/s of matrix products of the model's own shapes at 64 rows on the
current thread count: the roofline a step's achieved FLOP/s is compared with.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvblocks.engine.attention.dispatch import ATTENTION_RANGE, attention_clock
from kvblocks.engine.head import KERNEL_RANGE

MATMUL_OPS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::matmul",
        "aten::linear",
        "mkldnn::_linear_pointwise",  # the output head on its reordered weight (engine/head.py)
        KERNEL_RANGE,  # kvblocks' linear kernel (engine/head.py)
    }
)
OPERATOR_PREFIXES = ("aten::", "mkldnn::", "kvblocks::")
COPY_OPS = frozenset(
    {
        "aten::copy_",
        "aten::index",
        "aten::index_select",
        "aten::index_copy_",
        "aten::index_put_",
        "aten::_index_put_impl_",
        "aten::cat",
        "aten::clone",
        "aten::contiguous",
        "aten::_to_copy",
        "aten::embedding",
    }
)
PROFILED_RUNS = 3
CATEGORIES = ("attention", "matmul", "copies", "other kernels", "python/other")


@dataclass(frozen=True)
class StepProfile:
    seconds: float  # median CPU time of one unprofiled step
    shares: dict[str, float]  # category -> share of the step (sums to 1)
    attention_kernels: float = 0.0  # the part of the attention calls' time spent in operators

    def seconds_of(self, category: str) -> float:
        return self.seconds * self.shares[category]


def _in_attention(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == ATTENTION_RANGE:
            return True
        parent = parent.cpu_parent
    return False


def split_events(events) -> dict[str, float]:
    """Operator self time (µs) per category, from a profiler's `events()`; the range itself is no
    operator, and operators nested in other operators count once (their own time)."""
    spent = dict.fromkeys(CATEGORIES[:-1], 0.0)
    for e in events:
        if not e.name.startswith(OPERATOR_PREFIXES):
            continue
        if _in_attention(e):
            spent["attention"] += e.self_cpu_time_total
        elif e.name in MATMUL_OPS:
            spent["matmul"] += e.self_cpu_time_total
        elif e.name in COPY_OPS:
            spent["copies"] += e.self_cpu_time_total
        else:
            spent["other kernels"] += e.self_cpu_time_total
    return spent


def profile_step(step: Callable[[], None], repeats: int = 5) -> StepProfile:
    """Time `step` (CPU clock, median of `repeats` after one warm-up) and its attention calls, then
    profile `PROFILED_RUNS` more for the split of the rest, keeping the fastest."""
    step()
    times = []
    for _ in range(repeats):
        with attention_clock() as spent:
            start = time.process_time()
            step()
            times.append((time.process_time() - start, spent[0]))
    seconds, attention = sorted(times)[len(times) // 2]
    runs = []
    for _ in range(PROFILED_RUNS):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()  # the profiler times operators by the wall clock too
            step()
            runs.append(((time.perf_counter() - start) * 1e6, prof))
    profiled, prof = min(runs, key=lambda run: run[0])  # the least disturbed by the machine
    events = prof.events()
    spent = split_events(events)
    ranges = sum(e.cpu_time_total for e in events if e.name == ATTENTION_RANGE)
    outside = {name: value for name, value in spent.items() if name != "attention"}
    outside["python/other"] = max(0.0, profiled - ranges - sum(outside.values()))
    share = min(1.0, attention / seconds) if seconds else 0.0
    total = sum(outside.values()) or 1.0
    shares = {"attention": share, **{name: (1 - share) * value / total for name, value in outside.items()}}
    kernels = min(1.0, spent["attention"] / ranges) if ranges else 0.0
    return StepProfile(seconds, shares, kernels)


def linear_shapes(model) -> list[tuple[int, int]]:
    """(in, out) of every linear layer of the model, the output head included."""
    return [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def step_flops(model, tokens: int, keys_read: int) -> float:
    """FLOPs of a forward of `tokens` rows whose attention reads `keys_read` (query, key) pairs per
    layer in total: 2 per weight per row in the linear layers, 4 per head dimension per pair."""
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    linear = sum(2 * i * o for i, o in linear_shapes(model)) * tokens
    attention = 4 * heads * head_dim * keys_read * config.num_hidden_layers
    return float(linear + attention)


def matmul_peak(model, rows: int = 64, seconds: float = 1.0) -> float:
    """FLOP/s of `rows`-row products with each distinct linear shape of the model (weights laid out
    as `nn.Linear` keeps them), run one after another for about `seconds`."""
    dtype = next(model.parameters()).dtype
    shapes = sorted(set(linear_shapes(model)))
    weights = [torch.randn(o, i, dtype=dtype) for i, o in shapes]
    inputs = [torch.randn(rows, i, dtype=dtype) for i, _ in shapes]
    flops_per_round = sum(2 * rows * i * o for i, o in shapes)
    with torch.inference_mode():
        for x, w in zip(inputs, weights):
            torch.nn.functional.linear(x, w)
        rounds, start = 0, time.process_time()
        while time.process_time() - start < seconds:
            for x, w in zip(inputs, weights):
                torch.nn.functional.linear(x, w)
            rounds += 1
        elapsed = time.process_time() - start
    return flops_per_round * rounds / elapsed
