"""`kvblocks bench weights`: a batch decode step of a real-size model against the memory bandwidth.

At the sizes people deploy, a decode step is mostly reading weights: every linear layer's weight
once per step, whatever the batch. This suite measures
- the machine's memory bandwidth on the current thread count: a STREAM-like read (`sum` of a float32
  tensor far larger than the caches) and copy, median of several runs;
- a batch decode step of the packed engine (`PackedForward`, batch-invariant as the server runs it) in
  each asked dtype, on the weights as the engine packs them (reordered once for oneDNN,
  `kvblocks.engine.head`) and as `nn.Linear` keeps them: achieved weight bandwidth = bytes of the
  linear layers' weights read per step / step time, against the measured read bandwidth;
- the linear layers alone at the batch's rows (the ceiling the step's products can reach), and
  where a step's time goes (`kvblocks.bench.stepprofile`).

The model defaults to a random-weight one of Qwen2.5-Coder-1.5B-Instruct's shape (no download: the
bandwidth does not depend on the weights' values); `--model` takes a pulled or local model instead.
The requests' K/V is random, written straight into the pool (no prefill to wait for).
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable

import numpy as np

from kvblocks.bench import fixtures
from kvblocks.bench.harness import (
    BenchOptions,
    Check,
    Option,
    Report,
    Variant,
    add_suite,
    ints,
    measure,
)

GB = 1e9
DTYPES = ("bfloat16", "float32")
# Qwen2.5-Coder-1.5B-Instruct's config.json, the fields the shape needs
QWEN_1_5B = {
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
PACKED, PLAIN = "weights reordered once (the engine's default)", "weights as nn.Linear keeps them"

OPTIONS = (
    Option("--dtype", None, [], f"dtype of the model (repeatable; default {' and '.join(DTYPES)})",
           choices=DTYPES, repeat=True),
    Option("--profile", bool, False, "also split a step by the PyTorch profiler (attention, matmul, "
           "copies, other kernels, python)"),
    *ints("", [
        ("requests", 16, "requests decoding in one step (the batch)"),
        ("context", 512, "tokens of K/V each request attends"),
        ("steps", 5, "timed steps per variant"),
        ("stream-mb", 512, "size of the tensor the memory bandwidth is read from, MB"),
        ("layers", QWEN_1_5B["num_hidden_layers"], "decoder layers of the random-weight model (fewer "
         "fit a smaller machine; the bandwidth per byte is the same)"),
    ]),
)  # fmt: skip


def add_parser(suites: argparse._SubParsersAction) -> None:
    add_suite(
        suites,
        "weights",
        run,
        help="a batch decode step of a real-size model: achieved weight bandwidth vs the memory's",
        description="A batch-16 decode step of the packed engine on Qwen2.5-Coder-1.5B's shape (random "
        "weights unless --model), in bfloat16 and float32: weight bytes read per second against the "
        "machine's measured memory bandwidth, and where the step's time goes.",
        model=True,
        options=OPTIONS,
    )


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    stream = memory_bandwidth(args.stream_mb * 1_000_000, max(5, args.steps))
    reports = [stream_report(stream, args.stream_mb)]
    for dtype in args.dtype or DTYPES:
        reports.append(step_report(args, opts, dtype, stream["read"]))
        gc.collect()
    return reports


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median CPU time of `fn` after one warm-up run (CPU time: a shared machine's other processes
    taking the core away are left out; with one thread it is the wall time of a quiet machine)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return float(np.median(times))


def memory_bandwidth(nbytes: int, repeats: int = 7) -> dict[str, float]:
    """GB/s of a read (`sum` of `nbytes` of float32) and of a copy (bytes read + written), medians."""
    import torch

    a = torch.ones(nbytes // 4, dtype=torch.float32)
    b = torch.empty_like(a)
    read = _median_seconds(a.sum, repeats)
    copy = _median_seconds(lambda: b.copy_(a), repeats)
    return {"read": a.numel() * 4 / read / GB, "copy": 2 * a.numel() * 4 / copy / GB}


def stream_report(stream: dict[str, float], mb: int) -> Report:
    report = Report("weights-memory", "Memory bandwidth (STREAM-like, this thread count)", {"MB": mb})
    report.checks = [
        Check("read bandwidth (sum of a float32 tensor)", stream["read"], "GB/s"),
        Check("copy bandwidth (bytes read + written)", stream["copy"], "GB/s"),
    ]
    report.notes = [
        f"a {mb} MB float32 tensor (far beyond the last-level cache) summed, and copied into another: "
        "median CPU time of several runs after a warm-up; the read bandwidth is what the step's weight "
        "bandwidth is held against"
    ]
    return report


def build_model(args: argparse.Namespace, dtype: str):
    """The `--model` (a pulled name or a path) in `dtype`, or a random-weight model of Qwen2.5-Coder-
    1.5B's shape with `--layers` decoder layers."""
    import torch

    if args.model:
        return fixtures.load_model(args.model, dtype)[0]
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(QWEN_1_5B, num_hidden_layers=args.layers)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()


def linear_bytes(model) -> int:
    """Bytes of every linear layer's weight and bias, the output head included (a tied head
    counted once): what a decode step reads at least once."""
    import torch

    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            for t in (module.weight, module.bias):
                if t is not None and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
    return total


class Step:
    """`requests` requests holding `context` positions of random K/V in a pool, and a decode step
    of all of them through a packed runner (the same slots rewritten every step)."""

    def __init__(self, model, requests: int, context: int) -> None:
        import torch

        from kvblocks.adapters import hf
        from kvblocks.cache.layout import KVLayout
        from kvblocks.cache.pool import KVPool
        from kvblocks.engine.attention.batch import Segment

        dtype = next(model.parameters()).dtype
        self.pool = KVPool(
            KVLayout(dtype, tuple(hf.describe_layers(model))), requests * (context + 1) + 8, "cpu"
        )
        self.slots = [self.pool.alloc(context + 1) for _ in range(requests)]
        g = torch.Generator().manual_seed(0)
        index = self.pool.index(np.concatenate(self.slots))
        for layer, tensor in enumerate(self.pool.layers):
            if tensor is not None:
                heads, dim = tensor.shape[2:]
                k, v = (torch.randn(len(index), heads, dim, generator=g) for _ in "kv")
                self.pool.scatter(layer, index, k, v)
        rng = np.random.default_rng(0)
        vocab = model.config.vocab_size
        self.segments = [Segment([int(rng.integers(vocab // 8, vocab // 2))], s) for s in self.slots]

    def runner(self, model, packed: bool):
        from kvblocks.engine.attention.forward import PackedForward
        from kvblocks.engine.scheduler import CHUNK

        return PackedForward(
            model, self.pool, invariant=True, chunk=CHUNK, packed_weights="all" if packed else "none"
        )

    def step(self, runner) -> Callable[[], None]:
        return lambda: runner.forward(self.segments)


def linears_alone(model, runner, rows: int) -> Callable[[], None]:
    """Every linear layer's product at `rows` rows as the runner runs it (packed or not), the head
    included: the ceiling a step's products can reach."""
    import torch

    from kvblocks.engine.head import scope

    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    dtype = next(model.parameters()).dtype
    inputs = {m.in_features: torch.randn(rows, m.in_features).to(dtype) for m in layers}

    def run() -> None:
        with torch.inference_mode(), scope(runner.head):
            for m in layers:
                m(inputs[m.in_features])

    return run


def step_report(args: argparse.Namespace, opts: BenchOptions, dtype: str, read_bw: float) -> Report:
    import torch

    model = build_model(args, dtype)
    nbytes = linear_bytes(model)
    both = Step(model, args.requests, args.context)
    runners = {PACKED: both.runner(model, True), PLAIN: both.runner(model, False)}
    samples = measure(
        [Variant(name, both.step(r)) for name, r in runners.items()], args.steps, opts, f"step {dtype}"
    )
    alone = {name: _median_seconds(linears_alone(model, r, args.requests), 3) for name, r in runners.items()}
    params = {"model": args.model or f"random weights, Qwen2.5-Coder-1.5B shape ({args.layers} layers)"}
    params |= {"dtype": dtype, "requests": args.requests, "context": args.context}
    params |= {"weight_MB": round(nbytes / 1e6), "clock": opts.clock}
    title = f"A decode step of {args.requests} requests, {dtype}: weight bandwidth"
    report = Report(f"weights-{dtype}", title, params, samples, baseline=PLAIN)
    achieved = {name: nbytes / report.median(name) / GB for name in runners}
    from kvblocks.engine import gemm

    # the most weight bytes a second the core's multiply-adds serve to this many rows (None: no kernel)
    ceiling = gemm.ceiling(getattr(torch, dtype), args.requests)
    report.checks = [
        Check(f"step time, {PACKED}", report.median(PACKED) * 1e3, "ms"),
        Check(f"step time, {PLAIN}", report.median(PLAIN) * 1e3, "ms"),
        Check(f"achieved weight bandwidth, {PACKED}", achieved[PACKED], "GB/s"),
        Check(f"achieved weight bandwidth, {PLAIN}", achieved[PLAIN], "GB/s"),
        Check(
            "achieved / measured read bandwidth (the engine's default)",
            achieved[PACKED] / read_bw,
            "",
            0.6,
            True,
        ),
        Check(f"achieved / measured read bandwidth, {PLAIN}", achieved[PLAIN] / read_bw),
        *(
            []
            if ceiling is None
            else [
                Check(
                    f"compute ceiling at {args.requests} rows (peak multiply-add rate)", ceiling / GB, "GB/s"
                ),
                Check("ceiling / measured read bandwidth (at most 1)", min(1.0, ceiling / GB / read_bw)),
            ]
        ),
        Check(f"linear layers alone at {args.requests} rows, reordered", nbytes / alone[PACKED] / GB, "GB/s"),
        Check(f"linear layers alone at {args.requests} rows, as kept", nbytes / alone[PLAIN] / GB, "GB/s"),
    ]
    from kvblocks.engine.head import KernelLinear

    packed = runners[PACKED].head
    kernels = sum(isinstance(p, KernelLinear) for p in getattr(packed, "layers", {}).values())
    report.notes = [
        f"weight bytes read per step = every linear layer's weight and bias, the output head once "
        f"({nbytes / 1e6:,.0f} MB); achieved = those bytes / the step's median time; measured read "
        f"bandwidth {read_bw:.1f} GB/s (the memory report)",
        f"the step: `PackedForward(invariant=True)` (the server's default on CPU) over {args.requests} "
        f"segments of one new token, each attending {args.context} positions of random K/V; the "
        "output head runs on the last row of each (logits_to_keep)",
        "reordered: "
        + (
            f"{len(packed.layers)} linear layers on weights packed once, {kernels} of them for "
            f"kvblocks' linear kernel (csrc/linear.cpp), the others reordered for oneDNN "
            f"({packed.nbytes / 1e6:,.0f} MB beside the model's own)"
            if packed is not None
            else "none (no oneDNN or kernel, or their probes failed in this dtype)"
        ),
        "linear layers alone: each linear layer once on random input of the batch's rows, no attention, "
        "norms or Python around them",
    ]
    if ceiling is not None:
        report.notes.append(
            "compute ceiling: the core's peak rate of the product's multiply-add (`gemm.peak`, CPU time) x "
            f"the weight-row multiply-adds of one instruction / {args.requests} rows x the weight's bytes "
            "(`gemm.ceiling`); the step cannot read weights faster than the lower of it and the read bandwidth"
        )
    if args.profile:
        from kvblocks.bench import stepprofile

        for name, r in runners.items():
            profile = stepprofile.profile_step(both.step(r), repeats=3)
            shares = ", ".join(f"{part} {share:.0%}" for part, share in profile.shares.items())
            report.notes.append(f"where a step goes, {name} ({profile.seconds * 1e3:.0f} ms CPU): {shares}")
    return report
