"""`kvblocks bench quant`: the model in float32 against `--quantization int8`, speed and quality.

Speed: both models through the batch-invariant packed runner the server runs on CPU (`bench dtype`'s
decode and prefill: a decode step of B requests with C-token contexts, of one request, and a P-token
prefill in the engine's 64-position chunks); the float model with every layer packed, as served.

Quality (int8 is approximate: `kvblocks.engine.quant`): for each of a fixed set of chat prompts the
float model writes a greedy reply; both models then read prompt and reply in one forward, and the
report counts the positions where the int8 model's next token is the float model's (teacher-forced
top-1 agreement), their mean KL divergence (float to int8, nats), and the replies the int8 model
writes greedily, token for token the same.
"""

from __future__ import annotations

import argparse

from kvblocks.bench import dtype, fixtures
from kvblocks.bench.harness import BenchOptions, Check, Report, add_suite, ints

BENCHMARKS = ("decode", "prefill", "quality")
VARIANTS = ("float32", "int8")
AGREEMENT_TARGET = 0.9  # teacher-forced next tokens shared with the float model (measured 0.94-1.0)
PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is and give an example in JavaScript.",
    "Fix the bug: def add(a, b): return a - b",
    "How do I reverse a linked list in C?",
    "Summarise the difference between a process and a thread.",
    "Write a SQL query that lists the ten customers with the most orders.",
    "What does the HTTP status code 429 mean, and how should a client react?",
    "Give me three tips for writing clean code.",
)
OPTIONS = (  # bench dtype's decode and prefill sizes, then the quality run's
    *dtype.OPTIONS,
    *ints("", [
        ("chats", len(PROMPTS), "quality: chat prompts (of a fixed set of agent-like questions)"),
        ("reply", 48, "quality: tokens of each greedy reply"),
    ]),
)  # fmt: skip


def add_parser(suites: argparse._SubParsersAction) -> None:
    add_suite(
        suites,
        "quant",
        run,
        help="float32 vs --quantization int8: decode and prefill tokens/s, and how close int8's tokens stay",
        description="The model in float32 and quantised to int8 (kvblocks.engine.quant) through the batch-"
        "invariant packed runner, side by side; then teacher-forced agreement and KL on chat replies.",
        model=True,
        only=BENCHMARKS,
        options=OPTIONS,
    )


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    from kvblocks import models
    from kvblocks.engine import quant

    model, tokenizer = fixtures.load_model(args.model, "float32")
    quantized, _ = fixtures.load_model(args.model, "float32")
    quant.quantize(quantized, "int8")
    loaded = dict(zip(VARIANTS, (model, quantized)))
    params = {
        "model": args.model or models.DEFAULT_MODEL,
        "int8 weights (MiB)": round(quant.nbytes(quantized) / 2**20),
    }
    reports = []
    if not args.only or "decode" in args.only:
        reports += [dtype.decode(loaded, b, args, opts, params, suite="quant") for b in (args.requests, 1)]
    if not args.only or "prefill" in args.only:
        reports.append(dtype.prefill(loaded, args, opts, params, suite="quant"))
    for report in reports:
        report.checks.insert(0, Check("tokens/s, int8 / float32", report.ratio(*VARIANTS), "x", None, True))
    if not args.only or "quality" in args.only:
        reports.append(quality(model, quantized, tokenizer, args, params))
    return reports


def quality(model, quantized, tokenizer, args: argparse.Namespace, params: dict) -> Report:
    import torch
    import torch.nn.functional as F

    agree = positions = same = 0
    kl = 0.0
    for content in PROMPTS[: args.chats]:
        messages = [{"role": "user", "content": content}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        start = ids.shape[1] - 1
        with torch.inference_mode():
            text = model.generate(ids, max_new_tokens=args.reply, do_sample=False)
            want = F.log_softmax(model(text).logits[0, start:-1].float(), -1)
            got = F.log_softmax(quantized(text).logits[0, start:-1].float(), -1)
            mine = quantized.generate(ids, max_new_tokens=args.reply, do_sample=False)
        agree += int((want.argmax(-1) == got.argmax(-1)).sum())
        kl += float((want.exp() * (want - got)).sum())
        positions += want.shape[0]
        same += int(torch.equal(mine, text))
    chats = min(args.chats, len(PROMPTS))
    report = Report(
        "quant-quality",
        f"int8 against float32 on {chats} chat replies of {args.reply} tokens (teacher-forced, greedy)",
        params | {"chats": chats, "reply": args.reply},
    )
    report.checks = [
        Check("next token the float model's (teacher-forced)", agree / positions, "", AGREEMENT_TARGET, True),
        Check("mean KL divergence, float32 to int8", kl / positions, "nats"),
        Check("greedy replies token for token the float model's", same / chats, ""),
    ]
    report.notes = [
        f"{positions} positions; the int8 model is another model (approximate): its responses carry "
        "`quantization: int8` and its cache namespace is its own",
    ]
    return report
