"""`kvblocks bench dtype`: float32 against bfloat16 in the server's engine, side by side in one run.

The measurements behind `--dtype auto` (`kvblocks.models.default_dtype`): the model loaded in both
dtypes, each over a pool of its own dtype, through the batch-invariant packed runner the server
runs on CPU (`PackedForward(invariant=True, chunk=CHUNK)`).

- decode: B requests each hold a C-token context; one timed run is one decode step for all of them
  (one packed forward), then the same for a single request (padded to `MIN_ROWS` rows).
- prefill: a P-token prompt computed in the engine's 64-position chunks, rewritten into the same slots
  on every run.

Both dtypes greedy-decode on their own; the exactness of each dtype is what tests/test_dtype.py and
`kvblocks bench packed --only exactness` check, so here the tokens are only reported.
"""

from __future__ import annotations

import argparse

import numpy as np

from kvblocks.bench import fixtures
from kvblocks.bench.harness import BenchOptions, Check, Report, Variant, add_suite, ints, measure

BENCHMARKS = ("decode", "prefill")
DTYPES = ("float32", "bfloat16")
OPTIONS = (
    *ints("", [
        ("requests", 16, "decode: concurrent requests"),
        ("context", 600, "decode: tokens of context per request"),
        ("steps", 10, "decode: timed decode steps per variant"),
        ("prompt", 512, "prefill: tokens of the prompt"),
        ("runs", 5, "prefill: timed prefills per variant"),
    ]),
)  # fmt: skip


def add_parser(suites: argparse._SubParsersAction) -> None:
    add_suite(
        suites,
        "dtype",
        run,
        help="float32 vs bfloat16 decode and prefill tokens/s in the server's batch-invariant engine",
        description="The model in float32 and bfloat16 through the batch-invariant packed runner, side by side.",
        model=True,
        only=BENCHMARKS,
        options=OPTIONS,
    )


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    from kvblocks import models

    loaded = {dtype: fixtures.load_model(args.model, dtype)[0] for dtype in DTYPES}
    native = models.native_bf16()
    params = {
        "model": args.model or models.DEFAULT_MODEL,
        "native_bf16": native,
        "auto": models.default_dtype(),
    }
    reports = []
    if not args.only or "decode" in args.only:
        reports += [decode(loaded, args.requests, args, opts, params), decode(loaded, 1, args, opts, params)]
    if not args.only or "prefill" in args.only:
        reports.append(prefill(loaded, args, opts, params))
    for report in reports:
        target = 1.0 if native else None  # where auto picks bf16, bf16 must be the faster
        report.checks.insert(
            0, Check("tokens/s, bfloat16 / float32", report.ratio(*DTYPES), "x", target, True)
        )
    return reports


def _runner(model, capacity: int):
    import torch

    from kvblocks.adapters import hf
    from kvblocks.cache.layout import KVLayout
    from kvblocks.cache.pool import KVPool
    from kvblocks.engine.attention.forward import PackedForward
    from kvblocks.engine.scheduler import CHUNK

    pool = KVPool(KVLayout(next(model.parameters()).dtype, tuple(hf.describe_layers(model))), capacity, "cpu")
    with torch.inference_mode():
        return PackedForward(model, pool, invariant=True, chunk=CHUNK), pool


class Decoding:
    """`b` requests of `context` tokens prefilled into a pool of the model's dtype; `step` decodes one
    more token for each of them in one packed forward."""

    def __init__(self, model, prompts: list[list[int]], steps: int) -> None:
        from kvblocks.engine.attention.batch import Segment
        from kvblocks.engine.scheduler import CHUNK, chunk_ends

        self.segment = Segment
        capacity = sum(len(p) + steps + 2 for p in prompts) + 16
        self.runner, self.pool = _runner(model, capacity)
        self.slots = [self.pool.alloc(len(p)) for p in prompts]
        self.tokens = []
        for prompt, slots in zip(prompts, self.slots):
            start = 0
            for end in chunk_ends(0, len(prompt), CHUNK):  # the engine's fixed cuts
                (logits,) = self.runner.forward([Segment(prompt[start:end], slots[:end])])
                start = end
            self.tokens.append([int(logits[-1].argmax())])

    def step(self) -> None:
        segments = []
        for i, tokens in enumerate(self.tokens):
            self.slots[i] = np.concatenate([self.slots[i], self.pool.alloc(1)])
            segments.append(self.segment(tokens[-1:], self.slots[i]))
        for tokens, logits in zip(self.tokens, self.runner.forward(segments)):
            tokens.append(int(logits[-1].argmax()))


def decode(
    loaded: dict, b: int, args: argparse.Namespace, opts: BenchOptions, params: dict, suite: str = "dtype"
) -> Report:
    """Decode steps of `b` requests in each of `loaded`'s models (the first is the baseline)."""
    vocab = next(iter(loaded.values())).config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(vocab // 8, vocab // 2, args.context).tolist() for _ in range(b)]
    ways = {dtype: Decoding(model, prompts, args.steps + opts.warmup + 1) for dtype, model in loaded.items()}
    samples = measure([Variant(d, w.step) for d, w in ways.items()], args.steps, opts, f"decode x{b}")
    title = f"Decode steps of {b} request{'s' * (b > 1)}, {args.context}-token contexts, batch-invariant"
    report = Report(f"{suite}-decode-{b}", title, params | {"requests": b, "context": args.context}, samples)
    report.baseline = next(iter(loaded))
    same = sum(x == y for x, y in zip(*(w.tokens for w in ways.values())))
    report.notes = [
        "tokens/s: " + ", ".join(f"{d} {b / report.median(d):.1f}" for d in ways),
        f"requests whose greedy tokens are the same in both: {same} of {b} ({' and '.join(ways)} round differently)",
    ]
    return report


def prefill(
    loaded: dict, args: argparse.Namespace, opts: BenchOptions, params: dict, suite: str = "dtype"
) -> Report:
    """A prompt's chunked prefill in each of `loaded`'s models (the first is the baseline)."""
    from kvblocks.engine.attention.batch import Segment
    from kvblocks.engine.scheduler import CHUNK, chunk_ends

    vocab = next(iter(loaded.values())).config.vocab_size
    prompt = np.random.default_rng(1).integers(vocab // 8, vocab // 2, args.prompt).tolist()
    ends = chunk_ends(0, len(prompt), CHUNK)

    def way(model):
        runner, pool = _runner(model, len(prompt) + 16)
        slots = pool.alloc(len(prompt))

        def run() -> None:
            for start, end in zip([0, *ends], ends):
                runner.forward([Segment(prompt[start:end], slots[:end])])

        return run

    samples = measure([Variant(d, way(m)) for d, m in loaded.items()], args.runs, opts, "prefill")
    title = f"Prefill of a {args.prompt}-token prompt in {CHUNK}-token chunks, batch-invariant"
    report = Report(
        f"{suite}-prefill", title, params | {"prompt": args.prompt}, samples, baseline=next(iter(loaded))
    )
    report.notes = ["tokens/s: " + ", ".join(f"{d} {args.prompt / report.median(d):.1f}" for d in loaded)]
    return report
