"""Encoder-decoder prefix reuse is exact, family by family, and never crosses sources.

The reference is plain transformers with no kvblocks code: the encoder over the source, the whole
decoder prompt in one forward into a fresh `EncoderDecoderCache`, then one token per step. With
the cache, greedy tokens must be identical (float32 and float64) and float64 logits equal to
~1e-12 (a decoder suffix prefilled after a hit runs matmuls of other shapes than one call).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from conftest import IdTokenizer
from redis_server import RedisServer
from tiny_seq2seq import SEQ2SEQ_FAMILIES, START, VOCAB, tiny_seq2seq
from transformers import DynamicCache, EncoderDecoderCache

from kvblocks import KVCacheTrie, RedisTier, UnsupportedModelError
from kvblocks.seq2seq import Seq2SeqCache, Seq2SeqCachedGenerator, Seq2SeqPrompt

DTYPES = [torch.float32, torch.float64]
NEW_TOKENS = 5
# fsmt's and t5gemma's eager attention (t5gemma's soft-capping has no sdpa path) compute their
# softmax in float32: plain transformers' own logits for a decoder prompt fed in several calls differ
# from one call by ~5e-6 (fsmt) and ~3e-8 (t5gemma: 13 + 1 + 1 + 1 + 1 + 5 tokens against 22 at once,
# how much depends on the CPU's vector width) in a float64 model
FP64_LIMIT = {"fsmt": 1e-4, "t5gemma": 1e-6}


@functools.cache
def model_for(family: str, dtype: torch.dtype):
    return tiny_seq2seq(family, dtype)


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (n,), generator=g).tolist()


@contextmanager
def encoder_calls(model) -> Iterator[list[int]]:
    """Counts the encoder's forward calls inside the block."""
    calls: list[int] = []
    handle = model.get_encoder().register_forward_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


@torch.inference_mode()
def reference(model, source: list[int], decoder: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    src = torch.tensor([source])
    mask = torch.ones_like(src)
    encoded = model.get_encoder()(input_ids=src, attention_mask=mask, return_dict=True)
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    feed, tokens, logits = [START, *decoder], [], []
    while len(tokens) < n:
        out = model(
            encoder_outputs=encoded,
            attention_mask=mask,
            decoder_input_ids=torch.tensor([feed]),
            cache=cache,
            use_cache=True,
        )
        logits.append(out.logits[0, -1].clone())
        tokens.append(int(logits[-1].argmax()))
        feed = tokens[-1:]
    return tokens, logits


class Harness:
    def __init__(self, family: str, dtype: torch.dtype, **options) -> None:
        self.family, self.dtype = family, dtype
        self.model = model_for(family, dtype)
        self.cache = Seq2SeqCache.for_model(
            self.model, capacity_tokens=4096, source_capacity_tokens=4096, **options
        )
        self.generator = Seq2SeqCachedGenerator(self.model, IdTokenizer(), self.cache)

    def request(self, source: list[int], decoder: list[int], n: int = NEW_TOKENS):
        r = self.generator.generate(
            Seq2SeqPrompt(source, decoder), max_new_tokens=n, output_logits=True, ignore_eos=True
        )
        tokens, logits = reference(self.model, source, decoder, n)
        assert r.token_ids == tokens, f"{self.family}: greedy tokens differ from a run without the cache"
        diff = max((a - b).abs().max().item() for a, b in zip(r.logits, logits))
        limit = FP64_LIMIT.get(self.family, 1e-12) if self.dtype == torch.float64 else 1e-4
        assert diff <= limit, f"{self.family}: logits differ by {diff:.3e} (hit {r.cached_tokens})"
        assert self.cache.stats()["locked_tokens"] == 0
        return r


family_and_dtype = pytest.mark.parametrize(
    ("family", "dtype"),
    [pytest.param(f, d, id=f"{f}-{str(d).removeprefix('torch.')}") for f in SEQ2SEQ_FAMILIES for d in DTYPES],
)


@family_and_dtype
def test_reuse_of_source_and_decoder_prefix_equals_no_cache(family, dtype):
    h = Harness(family, dtype)
    source, question = ids(40, 1), ids(12, 2)
    first = h.request(source, question)
    assert (first.cached_tokens, first.encoder_cached_tokens) == (0, 0)
    # the next turn: the source, the question and the reply are reused
    longer = h.request(source, [*question, *first.token_ids, *ids(4, 3)])
    assert longer.encoder_cached_tokens == len(source)
    assert longer.cached_tokens == 1 + len(question) + NEW_TOKENS - 1  # start token + prompt + reply
    branch = h.request(source, [*question[:6], *ids(5, 4)])
    assert branch.cached_tokens == 1 + 6
    stats = h.cache.stats()
    assert (stats["encoder_runs"], stats["encoder_reused"]) == (1, 2)


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_a_source_that_begins_another_shares_nothing_with_it(family):
    h = Harness(family, torch.float64)
    source, question = ids(30, 5), ids(8, 6)
    h.request(source, question)
    longer = h.request([*source, *ids(6, 7)], question)
    shorter = h.request(source[:20], question)
    for r in (longer, shorter):
        assert (r.cached_tokens, r.encoder_cached_tokens) == (0, 0)
    assert h.cache.stats()["encoder_runs"] == 3


def test_salt_and_tenant_separate_the_same_source():
    h = Harness("t5", torch.float64)
    source, question = ids(30, 8), ids(8, 9)
    h.generator.generate(Seq2SeqPrompt(source, question), max_new_tokens=2, salt="a")
    r = h.generator.generate(Seq2SeqPrompt(source, question), max_new_tokens=2, salt="b")
    assert (r.cached_tokens, r.encoder_cached_tokens) == (0, 0)
    again = h.generator.generate(Seq2SeqPrompt(source, question), max_new_tokens=2, salt="a")
    assert again.encoder_cached_tokens == len(source) and again.cached_tokens > 0


def test_a_repeated_source_runs_the_encoder_zero_times():
    h = Harness("bart", torch.float32)
    source = ids(50, 10)
    h.request(source, ids(5, 11))
    for seed in (12, 13, 14):
        with encoder_calls(h.model) as calls:
            r = h.generator.generate(Seq2SeqPrompt(source, ids(5, seed)), max_new_tokens=3)
        assert calls == [] and r.encoder_cached_tokens == len(source)
    assert h.cache.stats()["encoder_runs"] == 1


@pytest.mark.parametrize("mode", ["blend", "concat"])
def test_kv_blocks_modes_are_refused_by_name(mode):
    from kvblocks.generate.params import ParamError

    h = Harness("bart", torch.float32)
    with pytest.raises(ParamError, match="kv_mode 'exact' only") as info:
        h.generator.generate(Seq2SeqPrompt(ids(20, 10), ids(3, 11)), max_new_tokens=2, kv_mode=mode)
    assert info.value.param == "kv_mode"


def test_the_source_record_survives_redis_into_a_second_cache(tmp_path):
    server = RedisServer(tmp_path / "redis").start()  # must start: a missing Redis fails this test
    try:
        secret = b"s" * 32

        def tiers() -> dict:
            return {
                "spill": RedisTier(server.url, chunk_tokens=4, secret=secret),
                "source_spill": RedisTier(server.url, chunk_tokens=4, secret=secret),
            }

        writer = Harness("t5", torch.float64, **tiers())
        source, question = ids(37, 15), ids(10, 16)  # neither a whole number of chunks
        writer.request(source, question)
        writer.cache.close()  # queued writes finish first
        reader = Harness("t5", torch.float64, **tiers())
        with encoder_calls(reader.model) as calls:
            r = reader.generator.generate(
                Seq2SeqPrompt(source, question), max_new_tokens=NEW_TOKENS, ignore_eos=True
            )
        assert calls == [] and r.encoder_cached_tokens == len(source)
        assert r.token_ids == reference(reader.model, source, question, NEW_TOKENS)[0]
        assert r.cached_tokens == 8  # the decoder's whole chunks (start token + 10 ids: two chunks)
        reader.cache.close()
    finally:
        server.stop()


def test_a_block_sparse_encoder_is_refused_by_name_and_left_as_it_was():
    model = tiny_seq2seq("bigbird_pegasus", torch.float32, attention_type="block_sparse", block_size=4)
    with pytest.raises(UnsupportedModelError, match="block_sparse"):
        Seq2SeqCache.for_model(model, 64, source_capacity_tokens=64)
    assert model.config.attention_type == "block_sparse"


def test_time_to_first_token_counts_the_encoder_run_and_a_held_source_saves_it():
    h = Harness("bart", torch.float32)
    handle = h.model.get_encoder().register_forward_hook(lambda *_: time.sleep(0.3))
    try:
        prompt = Seq2SeqPrompt(ids(30, 23), ids(4, 24))
        encoded, held = (h.generator.generate(prompt, max_new_tokens=2) for _ in range(2))
    finally:
        handle.remove()
    assert encoded.encoder_cached_tokens == 0 and held.encoder_cached_tokens == 30
    assert encoded.ttft_s >= 0.3 > held.ttft_s
    assert encoded.total_s >= encoded.ttft_s


def test_prophetnet_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match=r"prophetnet.*length 1"):
        Seq2SeqCache.for_model(tiny_seq2seq("prophetnet"), 64, source_capacity_tokens=64)


@torch.inference_mode()
def test_plain_prophetnet_cannot_continue_a_cached_decoder_by_more_than_one_token():
    model = tiny_seq2seq("prophetnet")
    src = torch.tensor([ids(20, 21)])
    encoded = model.get_encoder()(input_ids=src, attention_mask=torch.ones_like(src), return_dict=True)
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    model(encoder_outputs=encoded, decoder_input_ids=torch.tensor([[START, 5]]), cache=cache, use_cache=True)
    with pytest.raises(AssertionError, match="length 1"):
        model(encoder_outputs=encoded, decoder_input_ids=torch.tensor([[6, 7]]), cache=cache, use_cache=True)


@torch.inference_mode()
def test_plain_prophetnet_gives_nan_logits_in_float64_with_an_attention_mask():
    model = tiny_seq2seq("prophetnet", torch.float64)
    src, decoder = torch.tensor([ids(20, 22)]), torch.tensor([[START, 5, 6, 7]])
    masked = model(input_ids=src, attention_mask=torch.ones_like(src), decoder_input_ids=decoder).logits
    unmasked = model(input_ids=src, decoder_input_ids=decoder).logits
    assert masked.isnan().all() and unmasked.isfinite().all()


def test_kvcachetrie_refuses_a_seq2seq_model_and_names_the_cache_that_takes_it():
    with pytest.raises(UnsupportedModelError, match="Seq2SeqCache"):
        KVCacheTrie.for_model(model_for("t5", torch.float32), capacity_tokens=64)


def test_sampling_with_a_seed_repeats_with_and_without_reuse():
    h = Harness("mbart", torch.float64)
    plain = Seq2SeqCachedGenerator(h.model, IdTokenizer(), None)
    prompt = Seq2SeqPrompt(ids(30, 17), ids(6, 18))
    want = plain.generate(prompt, max_new_tokens=8, temperature=0.9, seed=3, ignore_eos=True).token_ids
    for _ in range(2):
        got = h.generator.generate(prompt, max_new_tokens=8, temperature=0.9, seed=3, ignore_eos=True)
        assert got.token_ids == want
    assert got.encoder_cached_tokens == 30


def test_a_tenants_stats_show_its_own_records_and_no_server_wide_encoder_work():
    from kvblocks import Scope

    h = Harness("bart", torch.float32)
    h.generator.generate(Seq2SeqPrompt(ids(20, 19), ids(4, 20)), max_new_tokens=2, salt=Scope("acme"))
    mine, theirs = h.cache.stats(tenant="acme"), h.cache.stats(tenant="other")
    assert "encoder_runs" not in mine and h.cache.stats()["encoder_runs"] == 1
    assert mine["source_resident_tokens"] == 20 and theirs["source_resident_tokens"] == 0
