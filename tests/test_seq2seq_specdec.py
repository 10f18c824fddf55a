"""Speculative decoding for encoder-decoder targets: exact in greedy mode, the target's
distribution when sampling, and rejected drafts trimmed from the decoder's self-attention only."""

from __future__ import annotations

import copy
import functools
from collections import Counter

import pytest
import torch
from conftest import IdTokenizer
from test_specdec_sampling import chi_square_p_value
from tiny_seq2seq import tiny_seq2seq

from kvblocks.generate.sampling import SamplingParams, distribution
from kvblocks.seq2seq import Seq2SeqCache, Seq2SeqCachedGenerator, Seq2SeqPrompt
from kvblocks.seq2seq.generator import Seq2SeqRunner, open_source
from kvblocks.specdec import (
    PromptLookupDrafter,
    Round,
    Seq2SeqModelDrafter,
    Seq2SeqSpeculativeGenerator,
    TrieDrafter,
)

TOK = IdTokenizer()
SOURCE = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 7, 8, 9, 10, 11, 12, 13] * 3
DECODER = [7, 8, 9]


@functools.cache
def model(family: str, seed: int = 0, **overrides):
    return tiny_seq2seq(family, torch.float64, seed=seed, **overrides)


def drafter_for(kind: str, family: str, cache: Seq2SeqCache):
    if kind == "model":
        draft = model(family, 1, **({"num_decoder_layers": 1} if "t5" in family else {"decoder_layers": 1}))
        return Seq2SeqModelDrafter(draft, Seq2SeqCache.for_model(draft, 2048, source_capacity_tokens=2048))
    if kind == "target-itself":
        return Seq2SeqModelDrafter(model(family))
    return PromptLookupDrafter() if kind == "lookup" else TrieDrafter(cache.decoder)


KINDS = ["model", "target-itself", "lookup", "trie"]
# the nested-config families draft with everything but a smaller model of their own (no flat layer count)
GREEDY_CASES = [(f, k) for f in ("bart", "t5") for k in KINDS] + [
    (f, k) for f in ("t5gemma", "encoder-decoder:bert+gpt2") for k in KINDS[1:]
]


@pytest.mark.parametrize(("family", "kind"), GREEDY_CASES)
def test_greedy_drafts_give_the_target_only_tokens_and_never_touch_cross_attention(family, kind):
    target = model(family)
    cache = Seq2SeqCache.for_model(target, 4096, source_capacity_tokens=4096)
    seen: list[tuple] = []

    def check(rnd: Round) -> None:
        """Right after each round: the decoder holds the committed tokens but the last, and the
        cross-attention K/V are the very tensors of the first round, source-long."""
        cross = rnd.target_past.cache.cross_attention_cache
        seen.append(
            (
                rnd.target_past.decoder.get_seq_length() - (len(rnd.committed) - 1),
                [(layer.keys.data_ptr(), layer.keys.shape[-2]) for layer in cross.layers],
            )
        )

    sg = Seq2SeqSpeculativeGenerator(target, TOK, cache, drafter_for(kind, family, cache), 4, on_round=check)
    plain = Seq2SeqCachedGenerator(target, TOK, None)
    prompt = Seq2SeqPrompt(SOURCE, DECODER)
    want = plain.generate(prompt, max_new_tokens=16, ignore_eos=True).token_ids
    for _ in range(2):  # the second request hits the source, the decoder prefix and (trie) the reply
        seen.clear()
        r = sg.generate(prompt, max_new_tokens=16, ignore_eos=True)
        assert r.token_ids == want
        assert [extra for extra, _ in seen] == [0] * len(seen)  # rejected drafts trimmed
        assert all(cross == seen[0][1] for _, cross in seen)
        assert {n for _, cross in seen for _, n in cross} == {len(SOURCE)}
    assert r.encoder_cached_tokens == len(SOURCE)
    if kind != "trie":
        assert r.spec.accepted > 0
    else:
        assert r.spec.alpha == 1.0  # the second request's reply is in the trie
    assert cache.stats()["encoder_runs"] == 1 and cache.stats()["locked_tokens"] == 0


def test_a_seq2seq_drafter_encodes_each_source_once_with_its_own_cache():
    target = model("bart")
    sg = Seq2SeqSpeculativeGenerator(target, TOK, None, drafter_for("model", "bart", None), 3)
    for decoder in ([5], [6], [7]):
        sg.generate(Seq2SeqPrompt(SOURCE, decoder), max_new_tokens=6, ignore_eos=True)
    assert sg.drafter.seq2seq.stats()["encoder_runs"] == 1


# ---- sampling: the target's distribution -------------------------------------------------------

SMALL_VOCAB = 8
NEW_TOKENS = 2
SAMPLES = 1_500
SAMPLING = dict(temperature=0.9, top_p=0.95, top_k=6)
SMALL_SOURCE = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]


@functools.cache
def small(seed: int):
    return tiny_seq2seq(
        "bart",
        torch.float64,
        seed=seed,
        vocab_size=SMALL_VOCAB,
        init_std=0.3,
        encoder_layers=1,
        decoder_layers=1,
    )


@functools.cache
def small_drafter():
    """The target with a random bias on its logits: q overlaps p, so drafts are often but not
    always accepted."""
    draft = copy.deepcopy(small(0))
    noise = torch.randn(
        draft.final_logits_bias.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    draft.final_logits_bias += 1.5 * noise
    return draft


@functools.cache
def joint() -> dict[tuple[int, ...], float]:
    """The target's exact probability of every NEW_TOKENS-token reply over SMALL_SOURCE."""
    target = small(0)
    runner = Seq2SeqRunner(target)
    params = SamplingParams(**SAMPLING)

    def step(decoder: list[int]) -> torch.Tensor:
        scope = open_source(runner, None, SMALL_SOURCE, None)
        past = Seq2SeqCachedGenerator(target, TOK, None)._new_past(None, scope)
        return distribution(runner.forward([1, *decoder], past)[-1], params)

    out = {(): 1.0}
    for _ in range(NEW_TOKENS):
        longer = {}
        for seq, prob in out.items():
            p = step(list(seq))
            for x in torch.nonzero(p).flatten().tolist():
                longer[(*seq, x)] = prob * float(p[x])
        out = longer
    return out


def test_model_drafter_sampling_has_the_target_distribution():
    target, draft = small(0), small_drafter()
    cache = Seq2SeqCache.for_model(target, 1 << 15, source_capacity_tokens=1024)
    draft_cache = Seq2SeqCache.for_model(draft, 1 << 15, source_capacity_tokens=1024)
    sg = Seq2SeqSpeculativeGenerator(target, TOK, cache, Seq2SeqModelDrafter(draft, draft_cache), gamma=2)
    counts, accepted, rejected = Counter(), 0, 0
    for seed in range(SAMPLES):
        r = sg.generate(
            Seq2SeqPrompt(SMALL_SOURCE), max_new_tokens=NEW_TOKENS, seed=seed, ignore_eos=True, **SAMPLING
        )
        counts[tuple(r.token_ids)] += 1
        accepted += r.spec.accepted
        rejected += r.spec.rejected_rounds
    assert accepted > SAMPLES // 4 and rejected > SAMPLES // 4, "both acceptance and rejection paths run"
    probs = joint()
    assert set(counts) <= set(probs)
    p_value = chi_square_p_value(counts, probs, SAMPLES)
    assert p_value > 1e-3, f"chi-square p-value {p_value:.3g}: not the target's distribution"


@pytest.mark.parametrize("kind", ["lookup", "trie"])
def test_point_mass_drafters_reproduce_target_only_sampling_seed_for_seed(kind):
    target = model("bart")
    cache = Seq2SeqCache.for_model(target, 4096, source_capacity_tokens=4096)
    sg = Seq2SeqSpeculativeGenerator(target, TOK, cache, drafter_for(kind, "bart", cache), 3)
    plain = Seq2SeqCachedGenerator(target, TOK, None)
    accepted = 0
    for seed in range(12):
        args = dict(max_new_tokens=10, seed=seed % 4, ignore_eos=True, **SAMPLING)
        r = sg.generate(Seq2SeqPrompt(SOURCE, DECODER), **args)
        assert r.token_ids == plain.generate(Seq2SeqPrompt(SOURCE, DECODER), **args).token_ids, f"seed {seed}"
        accepted += r.spec.accepted
    assert accepted > 0
