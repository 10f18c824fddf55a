"""`kvblocks bench packed`: decode throughput of packed forwards over the pool vs one request at a time.

B requests each hold a C-token context. One timed run is one decode step for all of them: either
one packed forward (`kvblocks.paged.PagedRunner`: every request's next token in one `[1, B]`
sequence, attention per request through its pool slots) or B forwards of one token each on the
request's own `DynamicCache` (what the server's engine does today). Both greedy-decode the same
tokens from the same contexts; the suite checks that the token streams are identical.
"""

from __future__ import annotations

import argparse

import numpy as np

from kvblocks.bench import fixtures
from kvblocks.bench.harness import BenchOptions, Check, Report, Variant, add_suite, int_options, measure


def add_parser(suites: argparse._SubParsersAction) -> None:
    p = add_suite(
        suites,
        "packed",
        run,
        help="decode throughput: one packed forward over the pool vs one forward per request",
        description="Decode steps of B requests as one packed forward (kvblocks.paged) vs one at a time.",
        model=True,
    )
    int_options(
        p,
        "",
        [
            ("requests", 16, "concurrent requests"),
            ("context", 600, "tokens of context per request"),
            ("steps", 10, "timed decode steps per variant"),
        ],
    )


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    import torch

    from kvblocks.adapters import hf
    from kvblocks.layout import KVLayout
    from kvblocks.paged import PagedRunner, Segment
    from kvblocks.pool import KVPool

    model, _ = fixtures.load_model(args.model)
    b, context = args.requests, args.context
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [rng.integers(vocab // 8, vocab // 2, context).tolist() for _ in range(b)]
    capacity = b * (context + args.steps + opts.warmup + 2)
    pool = KVPool(KVLayout(next(model.parameters()).dtype, tuple(hf.describe_layers(model))), capacity, "cpu")
    runner = PagedRunner(model, pool)
    slots = [pool.alloc(context) for _ in range(b)]
    packed_tokens: list[list[int]] = []
    solo_tokens: list[list[int]] = []
    caches = []
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            first = runner.forward([Segment(prompt, slots[i])])[0][-1]
            packed_tokens.append([int(first.argmax())])
            cache = hf.empty_cache(model.config)
            logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits
            solo_tokens.append([int(logits[0, -1].argmax())])
            caches.append(cache)

    def packed_step() -> None:
        segments = []
        for i in range(b):
            slots[i] = np.concatenate([slots[i], pool.alloc(1)])
            segments.append(Segment(packed_tokens[i][-1:], slots[i]))
        for i, logits in enumerate(runner.forward(segments)):
            packed_tokens[i].append(int(logits[-1].argmax()))

    @torch.inference_mode()
    def solo_step() -> None:
        for i in range(b):
            ids = torch.tensor([solo_tokens[i][-1:]])
            logits = model(input_ids=ids, past_key_values=caches[i], use_cache=True).logits
            solo_tokens[i].append(int(logits[0, -1].argmax()))

    variants = [Variant("packed forward", packed_step), Variant("one request at a time", solo_step)]
    samples = measure(variants, args.steps, opts, "packed")
    report = Report(
        "packed-decode",
        f"Decode steps of {b} requests, {context}-token contexts",
        {
            "model": args.model or "SmolLM2-135M-Instruct",
            "requests": b,
            "context": context,
            "steps": args.steps,
        },
        samples,
        baseline="one request at a time",
    )
    speedup = report.median("one request at a time") / report.median("packed forward")
    report.checks = [
        Check("decode throughput, packed / one at a time", speedup, "x", 2.5, True),
        Check(
            "requests whose greedy tokens differ",
            sum(p != s for p, s in zip(packed_tokens, solo_tokens)),
            "",
            0,
        ),
    ]
    report.notes = [
        f"tokens/s: packed {b / report.median('packed forward'):.1f}, one at a time "
        f"{b / report.median('one request at a time'):.1f}; every request decoded "
        f"{len(packed_tokens[0])} tokens in each variant",
        "packed = kvblocks.paged.PagedRunner (K/V written to and read from pool slots, no per-request "
        "cache); one at a time = a transformers DynamicCache per request, one forward per token",
    ]
    return [report]
