"""`kvblocks bench blocks`: what reusing KV blocks at new positions costs in quality, and saves in time.

The RAG and agent workloads of `blocks_data` run on SmolLM2-135M-Instruct and on a tiny random
llama, under: full prefill (no cache), prefix-only reuse (kv_mode exact), blend at several
recompute shares, and concat. Every cache is warm: the documents were seen before in another
order, so prefix reuse gets the system prompt (and any shared leading document) and blocks are
stored. Per variant: TTFT (median), prompt tokens computed, greedy answers identical to full
prefill, mean KL(full || variant) of the next-token distribution over the answer tokens, and
exact-match accuracy.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from kvblocks.bench import fixtures
from kvblocks.bench.blocks_data import Task, agent_tasks, rag_tasks
from kvblocks.bench.harness import BenchOptions, Check, Option, Report, add_suite, progress
from kvblocks.cli.argtypes import positive_int

SHARES = (0.0, 0.05, 0.15, 0.3, 1.0)
TARGET_SHARE = 0.15
ANSWER_TOKENS = 6
FULL, PREFIX = "full prefill", "prefix only"


@dataclass(slots=True)
class Tally:
    """One variant's measurements over the tasks."""

    ttft_s: list[float] = field(default_factory=list)
    computed: float = 0.0  # prompt tokens computed through all layers (a probe counts its share of layers)
    agree: int = 0
    correct: int = 0
    kl: list[float] = field(default_factory=list)
    kl_exact: list[float] = field(default_factory=list)  # against prefix-only reuse (the exact path)


def add_parser(suites: argparse._SubParsersAction) -> None:
    add_suite(
        suites,
        "blocks",
        run,
        help="KV blocks: blend/concat against full prefill on a RAG and an agent workload (quality and TTFT)",
        description="KV blocks reused at new positions (kv_mode blend at several shares, concat) against "
        "full prefill and prefix-only reuse, on the --model (SmolLM2-135M-Instruct) and a tiny random llama "
        "over its tokenizer (--only model|tiny).",
        model=True,
        dtype=True,
        only=("model", "tiny"),
        options=[
            Option("--questions", positive_int, 6, "RAG questions (default 6)"),
            Option("--docs", positive_int, 3, "documents per RAG prompt (default 3)"),
            Option("--turns", positive_int, 3, "agent loop turns (default 3)"),
            Option("--seed", int, 0, "workload seed (default 0)"),
            Option(
                "--shares",
                blend_shares,
                SHARES,
                "blend_recompute shares to compare, comma-separated (default 0,0.05,0.15,0.3,1; "
                f"{TARGET_SHARE:g} and 1 are always run: the targets check them)",
            ),
        ],
    )


def blend_shares(text: str) -> tuple[float, ...]:
    """`--shares`: comma-separated shares in [0, 1], with the two the targets check added."""
    try:
        shares = {float(x) for x in text.split(",")}
    except ValueError:
        shares = {-1.0}
    if not all(0 <= s <= 1 for s in shares):
        raise argparse.ArgumentTypeError(f"expected comma-separated shares in [0, 1], got '{text}'")
    return tuple(sorted(shares | {TARGET_SHARE, 1.0}))


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    from kvblocks import models

    dtype = fixtures.model_dtype(args, packed=False)  # one request per forward: auto is float32, as in serve
    model, tokenizer = fixtures.load_model(args.model, dtype)
    tasks = rag_tasks(args.questions, args.docs, args.seed) + agent_tasks(args.turns, 3, args.seed)
    only = set(args.only or ("model", "tiny"))
    reports = []
    if "model" in only:
        title = args.model or models.DEFAULT_MODEL
        reports.append(bench_blocks("blocks-model", title, model, tokenizer, tasks, opts, args.shares))
    if "tiny" in only:
        tiny = tiny_llama(len(tokenizer))
        reports.append(
            bench_blocks(
                "blocks-tiny", "a tiny random llama", tiny, tokenizer, tasks, opts, args.shares, False
            )
        )
    for report in reports:
        report.params["dtype"] = dtype if report.name == "blocks-model" else "float32"
    return reports


def tiny_llama(vocab: int):
    """A 4-layer random llama over the real tokenizer's vocabulary (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=2048,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def variants(shares: tuple[float, ...] = SHARES) -> list[tuple[str, str, float]]:
    """(name, kv_mode, blend_recompute); full prefill and prefix-only first."""
    blends = [(f"blend {s:g}", "blend", s) for s in shares]
    return [(FULL, "exact", 0.0), (PREFIX, "exact", 0.0), *blends, ("concat", "concat", 0.0)]


def bench_blocks(
    name: str,
    title: str,
    model,
    tokenizer,
    tasks: list[Task],
    opts: BenchOptions,
    shares: tuple[float, ...] = SHARES,
    targets: bool = True,
) -> Report:
    from kvblocks import CachedGenerator, KVCacheTrie
    from kvblocks.blocks import Block, flatten

    def trie():
        return KVCacheTrie.for_model(model, capacity_tokens=16_384)

    blended = CachedGenerator(model, tokenizer, trie())  # blend < 1 and concat: only exact parts committed
    gens = {FULL: CachedGenerator(model, tokenizer, None), PREFIX: CachedGenerator(model, tokenizer, trie())}
    gens["blend 1"] = CachedGenerator(model, tokenizer, trie())  # the ordinary prefill: commits whole prompts
    table = variants(shares)
    layers = model.config.num_hidden_layers
    for task in tasks:  # warm: every document seen before, in the reverse order
        blocks = [s for s in task.segments if isinstance(s, Block)][::-1]
        seen = [task.segments[0], *blocks, task.segments[-1]]
        for gen in (gens[PREFIX], gens["blend 1"]):
            gen.generate(seen, max_new_tokens=1)
        blended.generate(seen, max_new_tokens=1, kv_mode="concat")
    tally = {v[0]: Tally() for v in table}
    with progress(len(tasks) * len(table), f"bench {name}", opts.progress) as bar:
        for i, task in enumerate(tasks):
            ids, _ = flatten(tokenizer, list(task.segments))
            results = {}
            k = i % len(table)
            for vname, mode, share in [*table[k:], *table[:k]]:
                gen = gens.get(vname, blended)
                prompt = ids if vname == FULL else list(task.segments)
                r = gen.generate(
                    prompt,
                    max_new_tokens=ANSWER_TOKENS,
                    kv_mode=mode,
                    blend_recompute=share,
                    output_logits=True,
                )
                results[vname] = r
                bar.update()
            reference = results[FULL]
            for vname, r in results.items():
                _score(tally[vname], r, reference, task.answer, layers)
                tally[vname].kl_exact.append(_answer_kl(results[PREFIX], r))
    return _report(name, title, tasks, tally, targets)


def _score(t: Tally, r, reference, answer: str, layers: int) -> None:
    t.ttft_s.append(r.ttft_s)
    if r.blocks is not None:
        t.computed += r.blocks.recomputed_tokens + r.blocks.probe_tokens * 2 / layers
    else:
        t.computed += r.prompt_tokens - r.cached_tokens
    t.agree += r.token_ids == reference.token_ids
    number = re.search(r"\d+", r.text)
    t.correct += number is not None and number.group() == answer
    t.kl.append(_answer_kl(reference, r))


def _answer_kl(reference, r) -> float:
    """Mean KL(reference || r) over the answer positions both share: up to and including the first
    token where their greedy answers part (after it, they condition on different text)."""
    kls = []
    for a, b, ta, tb in zip(reference.logits, r.logits, reference.token_ids, r.token_ids):
        p, q = a.double().log_softmax(-1), b.double().log_softmax(-1)
        kls.append(float((p.exp() * (p - q)).sum()))
        if ta != tb:
            break
    return float(np.mean(kls))


def _report(name: str, title: str, tasks: list[Task], tally: dict[str, Tally], targets: bool) -> Report:
    n = len(tasks)
    params = {"tasks": n, "rag": sum(t.kind == "rag" for t in tasks), "answer_tokens": ANSWER_TOKENS}
    report = Report(
        name,
        f"KV blocks on {title}: TTFT (warm)",
        params,
        samples={v: t.ttft_s for v, t in tally.items()},
        baseline=FULL,
    )
    full = tally[FULL]
    target = tally[f"blend {TARGET_SHARE:g}"]

    def goal(x: float) -> float | None:
        return x if targets else None

    report.checks += [
        Check("blend 0.15 prompt tokens computed / full", target.computed / full.computed, "x", goal(0.3)),
        Check("blend 0.15 TTFT / full (medians)", report.ratio("blend 0.15", FULL), "x", goal(0.5)),
        Check("blend 0.15 greedy answers = full", target.agree / n, "", goal(0.9), True),
        Check(
            "blend 0.15 accuracy gap to full", 100 * (full.correct - target.correct) / n, "points", goal(2)
        ),
        Check("blend 1 greedy answers = full", tally["blend 1"].agree / n, "", 1.0, True),
        Check("blend 1 max KL to prefix-only reuse", max(tally["blend 1"].kl_exact), "nats", 0.0),
    ]
    for v, t in tally.items():
        report.notes.append(
            f"{v}: tokens computed {t.computed / full.computed:.3f} of full, answers = full {t.agree}/{n}, "
            f"mean KL {np.mean(t.kl):.4f}, exact match {t.correct}/{n}, TTFT median "
            f"{np.median(t.ttft_s) * 1e3:.0f} ms"
        )
    return report
