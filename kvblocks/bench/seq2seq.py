"""`kvblocks bench seq2seq`: encoder-decoder models, source reuse and speculative decoding.

A random-weight BART-shaped model (no seq2seq checkpoint ships in an installed package) answers
several questions over one long source:

- reuse: TTFT of a question (a fresh decoder prompt) over a source the cache holds, against the
  same question with no cache (the encoder runs over the whole source every time); the encoder
  runs and tokens the reused questions cost (the target: none);
- specdec: greedy decoding with `Seq2SeqSpeculativeGenerator` against `Seq2SeqCachedGenerator` on
  the same warm cache (outputs must be identical), with the trie drafter (repeated questions) and a
  seq2seq drafter (the target with its decoder cut to its first layer, sharing weights). Decode
  speed counts the tokens after the first; the predicted walltime factor
  S = (1 - a^(g+1)) / ((1 - a)(g c + v)) takes alpha from the runs and c, v from timed forwards.
"""

from __future__ import annotations

import argparse
import copy
import time

import numpy as np

from kvblocks.bench.harness import BenchOptions, Check, Report, Variant, add_suite, ints, measure, repeats_row
from kvblocks.bench.specdec import predicted_speedup

BENCHMARKS = ("reuse", "specdec")

OPTIONS = ints(
    "",
    [
        repeats_row(5),
        ("source", 1000, "source tokens"),
        ("decoder", 20, "decoder prompt tokens per question"),
        ("hidden", 256, "d_model"),
        ("layers", 4, "encoder and decoder layers each"),
        ("vocab", 4096, "vocabulary"),
        ("gamma", 4, "drafts per round"),
        ("tokens", 40, "new tokens per question, specdec"),
        ("seed", 0, "seed of the weights and token ids"),
    ],
)


def add_parser(suites: argparse._SubParsersAction) -> None:
    add_suite(
        suites,
        "seq2seq",
        run,
        help="encoder-decoder models: TTFT and encoder work with source reuse; speculative decoding",
        description="Questions over one long source on a random-weight BART-shaped model: source reuse "
        "against no cache, and speculative decoding measured against its predicted speed-up.",
        only=BENCHMARKS,
        options=OPTIONS,
    )


def build_model(hidden: int, layers: int, vocab: int, source: int, seed: int):
    import torch
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(seed)
    config = BartConfig(
        vocab_size=vocab,
        d_model=hidden,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=max(1, hidden // 64),
        decoder_attention_heads=max(1, hidden // 64),
        encoder_ffn_dim=4 * hidden,
        decoder_ffn_dim=4 * hidden,
        max_position_embeddings=max(1024, source + 64),
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        forced_eos_token_id=None,
        decoder_start_token_id=1,
    )
    return BartForConditionalGeneration(config).eval()


def first_layer_drafter(model):
    """The target with its decoder cut to its first layer (weights shared): a cheap seq2seq drafter.
    Only the modules on the path to the layer list are copied (their `_modules` too), so the target
    itself keeps all its layers."""
    draft, inner, decoder = copy.copy(model), copy.copy(model.model), copy.copy(model.model.decoder)
    for module in (draft, inner, decoder):
        module._modules = dict(module._modules)
    decoder._modules["layers"] = type(decoder.layers)(list(decoder.layers)[:1])
    inner._modules["decoder"] = decoder
    draft._modules["model"] = inner
    draft.config = copy.deepcopy(model.config)
    draft.config.decoder_layers = 1
    return draft


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    from kvblocks.generate.text import IdTokenizer

    selected = args.only or list(BENCHMARKS)
    model = build_model(args.hidden, args.layers, args.vocab, args.source, args.seed)
    rng = np.random.default_rng(args.seed)
    source = rng.integers(2, args.vocab, args.source).tolist()
    questions = [
        rng.integers(2, args.vocab, args.decoder).tolist() for _ in range(args.repeats + opts.warmup + 8)
    ]
    params = dict(
        source=args.source, decoder=args.decoder, hidden=args.hidden, layers=args.layers, vocab=args.vocab
    )
    reports = []
    if "reuse" in selected:
        reports.append(bench_reuse(opts, model, IdTokenizer(), source, questions, args.repeats, params))
    if "specdec" in selected:
        for kind in ("trie", "model"):
            reports.append(
                bench_specdec(opts, model, IdTokenizer(), source, questions[0], kind, args, params)
            )
    return reports


def bench_reuse(opts, model, tokenizer, source, questions, repeats, params) -> Report:
    from kvblocks.seq2seq import Seq2SeqCache, Seq2SeqCachedGenerator, Seq2SeqPrompt

    cache = Seq2SeqCache.for_model(model, 1 << 14, source_capacity_tokens=1 << 13)
    reuse = Seq2SeqCachedGenerator(model, tokenizer, cache)
    plain = Seq2SeqCachedGenerator(model, tokenizer, None)
    reuse.generate(Seq2SeqPrompt(source, questions[-1]), max_new_tokens=1)  # the source's record is kept
    asked = iter(questions)

    def ask(gen):
        return lambda: gen.generate(Seq2SeqPrompt(source, next(asked)), max_new_tokens=1)

    before = cache.stats()
    variants = [Variant("no reuse", ask(plain)), Variant("reuse", ask(reuse))]
    samples = measure(variants, repeats, opts, "seq2seq reuse")
    after = cache.stats()
    runs = after["encoder_runs"] - before["encoder_runs"]
    ratio = float(np.median(samples["reuse"]) / np.median(samples["no reuse"]))
    return Report(
        "seq2seq-reuse",
        f"Seq2seq: a fresh {params['decoder']}-token question over a cached {len(source)}-token source",
        params,
        samples,
        [
            Check("TTFT reuse / no reuse (median)", ratio, target=0.3),
            Check("encoder runs on the repeated source", runs, target=0),
            Check(
                "encoder tokens on the repeated source",
                after["encoder_tokens"] - before["encoder_tokens"],
                target=0,
            ),
            Check("source reuses", after["encoder_reused"] - before["encoder_reused"], unit="requests"),
        ],
        [
            "time per variant = one request with max_new_tokens=1 (its TTFT plus returning the token), "
            f"on the {opts.clock} clock",
            "every request asks a different question: only the source (and the decoder start token) is reused",
        ],
        baseline="no reuse",
    )


def bench_specdec(opts, model, tokenizer, source, question, kind, args, params) -> Report:
    from kvblocks.seq2seq import Seq2SeqCache, Seq2SeqCachedGenerator, Seq2SeqPrompt
    from kvblocks.specdec import Seq2SeqModelDrafter, Seq2SeqSpeculativeGenerator, TrieDrafter

    cache = Seq2SeqCache.for_model(model, 1 << 14, source_capacity_tokens=1 << 13)
    if kind == "trie":
        drafter = TrieDrafter(cache.decoder)
    else:
        draft = first_layer_drafter(model)
        drafter = Seq2SeqModelDrafter(
            draft, Seq2SeqCache.for_model(draft, 1 << 14, source_capacity_tokens=1 << 13)
        )
    gamma, n = args.gamma, args.tokens
    base = Seq2SeqCachedGenerator(model, tokenizer, cache)
    spec = Seq2SeqSpeculativeGenerator(model, tokenizer, cache, drafter, gamma)
    prompt = Seq2SeqPrompt(source, question)
    want = base.generate(prompt, max_new_tokens=n, ignore_eos=True).token_ids  # warm: source and reply cached
    results: dict[str, list] = {"target only": [], "speculative": []}

    def go(gen, name):
        def once() -> None:
            results[name].append(gen.generate(prompt, max_new_tokens=n, ignore_eos=True))

        return once

    measure(
        [Variant("target only", go(base, "target only")), Variant("speculative", go(spec, "speculative"))],
        args.repeats,
        opts,
        f"seq2seq specdec {kind}",
    )
    decode = {
        name: [(r.total_s - r.ttft_s) / (len(r.token_ids) - 1) for r in rs] for name, rs in results.items()
    }
    exact = all(r.token_ids == want for rs in results.values() for r in rs)
    stats = [r.spec for r in results["speculative"]]
    accepted = sum(s.accepted for s in stats)
    alpha = accepted / max(1, accepted + sum(s.rejected_rounds for s in stats))
    c, v = step_costs(base, spec, drafter, prompt, kind, gamma, want)
    predicted = predicted_speedup(alpha, gamma, c, v)
    measured = float(np.median(decode["target only"]) / np.median(decode["speculative"]))
    return Report(
        f"seq2seq-specdec-{kind}",
        f"Seq2seq speculative decoding, {kind} drafter, gamma {gamma}",
        params | {"gamma": gamma, "tokens": n},
        decode,
        [
            Check("greedy output identical to target only", float(exact), target=1.0, higher_is_better=True),
            Check("alpha", alpha),
            Check("tokens per target call", float(np.mean([s.tokens_per_call for s in stats]))),
            Check("c (drafter / target step)", c),
            Check("v (verify / target step)", v),
            Check("predicted speed-up S", predicted),
            Check("measured speed-up", measured),
            Check("measured / predicted", measured / predicted, target=0.9, higher_is_better=True),
        ],
        ["samples are seconds per decoded token after the first (prefill left out of both)"],
        baseline="target only",
    )


def step_costs(base, spec, drafter, prompt, kind, gamma, reply) -> tuple[float, float]:
    """(c, v): median drafter cost per drafted token over a target one-token step, and a
    (gamma + 1)-token verify over that step, timed on the request's own caches."""
    from kvblocks.seq2seq.generator import new_past

    scope = base.open_source(base.encode_source(prompt.source), None)
    ids = base.decoder_ids(prompt.decoder) + reply[:8]

    def median_of(fn, repeats: int = 15) -> float:
        times = []
        for _ in range(repeats):
            past = new_past(None, scope)
            base.runner.forward(ids, past)
            t0 = time.perf_counter()
            fn(past)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    one = median_of(lambda past: base.runner.forward(reply[8:9], past))
    verify = median_of(lambda past: base.runner.forward(reply[8 : 9 + gamma], past, keep=gamma + 1))
    if kind == "trie":
        cache, salt = base.seq2seq.decoder, scope
        draft = median_of(lambda past: cache.continuation(ids, gamma, salt=salt)) / gamma
    else:
        draft = median_of(lambda past: drafter.runner.forward(reply[8:9], past))  # same cache shape
    return draft / one, verify / one
