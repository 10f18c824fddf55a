"""KV blocks beyond the prefill itself: the blend's deviation rule, reused tokens counted by the tier
their KV came from, blocks of `exact` requests promoted into the block store, and `explain_blocks`."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import IdTokenizer, tiny_llama
from redis_server import start_redis

from kvblocks import Block, CachedGenerator, KVCacheTrie, RedisTier
from kvblocks.blocks.explain import explain_blocks
from kvblocks.blocks.prefill import PROMOTE_SHARE, block_scope, kv_deviation
from kvblocks.blocks.segments import flatten
from kvblocks.spill.disk import DiskTier
from kvblocks.spill.host import HostTier
from kvblocks.spill.stack import TierStack

VOCAB = 128


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(torch.float64, num_hidden_layers=3)


def generator(model, capacity: int = 4096, **kwargs) -> CachedGenerator:
    return CachedGenerator(
        model, IdTokenizer(), KVCacheTrie.for_model(model, capacity_tokens=capacity, **kwargs)
    )


SYSTEM, DOC_A, DOC_B, QUESTION = ids(7, 1), ids(20, 2), ids(15, 3), ids(5, 4)


def rag(order: str) -> list:
    docs = {"A": Block(DOC_A), "B": Block(DOC_B)}
    return [SYSTEM, *(docs[c] for c in order), QUESTION]


def run(gen, prompt, **kwargs):
    return gen.generate(prompt, max_new_tokens=2, **kwargs)


def test_kv_deviation_weighs_a_value_error_as_much_as_a_key_error_of_the_same_relative_size():
    fresh = torch.ones(3, 2, 2, 4, dtype=torch.float64)
    fresh[:, 0] *= 10.0  # keys ten times the values' norm, as in SmolLM2's layer 1
    reused = fresh.clone()
    reused[0, 0, 1] *= 1.1  # token 0: one head's key 10% off
    reused[1, 1, 1] *= 1.1  # token 1: the same head's value 10% off
    deviation = kv_deviation(fresh, reused)
    assert deviation[0] == pytest.approx(deviation[1]) and deviation[0] > 0
    assert deviation[2] == 0
    raw = (fresh - reused).pow(2).sum(dim=(1, 2, 3))
    assert raw[0] == pytest.approx(100 * raw[1])  # what the unnormalised rule saw


def test_reused_block_tokens_are_counted_by_the_tier_their_kv_came_from(model):
    gen = generator(model)
    first = run(gen, rag("AB"), kv_mode="concat").blocks
    assert first.reused_by_tier == {
        "device": 0,
        "host": 0,
        "disk": 0,
        "redis": 0,
        "fill": first.reused_tokens,
    }
    second = run(gen, rag("BA"), kv_mode="blend", blend_recompute=0.2).blocks
    assert second.reused_by_tier == {
        "device": second.reused_tokens,
        "host": 0,
        "disk": 0,
        "redis": 0,
        "fill": 0,
    }
    assert [b.device for b in second.blocks] == [len(DOC_B), len(DOC_A)]


def test_block_tokens_fetched_from_redis_are_counted_as_redis(model, tmp_path):
    server = start_redis(tmp_path / "redis")
    try:
        writer = generator(model, spill=RedisTier(server.url, chunk_tokens=8))
        run(writer, rag("AB"), kv_mode="concat")
        writer.cache.spill.flush()
        reader = generator(model, spill=RedisTier(server.url, chunk_tokens=8))
        r = run(reader, rag("BA"), kv_mode="concat").blocks
        assert [(b.device, b.stored) for b in r.blocks] == [(0, 8), (0, 16)]  # whole chunks only
        assert r.reused_by_tier == {"device": 0, "host": 0, "disk": 0, "redis": 8 + 16, "fill": 7 + 4}
        for gen in (writer, reader):
            gen.cache.close()
    finally:
        server.stop()


def test_an_exact_request_promotes_its_blocks_so_a_later_concat_finds_them(model):
    gen = generator(model)
    exact = run(gen, rag("AB"), output_logits=True)
    assert exact.blocks is None
    flat = flatten(IdTokenizer(), rag("AB"))[0]
    alone = run(generator(model), flat, output_logits=True)
    assert exact.token_ids == alone.token_ids
    assert all(torch.equal(a, b) for a, b in zip(exact.logits, alone.logits))  # exact output unchanged
    assert gen.cache.cached_length(DOC_A, salt=block_scope(None)) == len(DOC_A)
    promoted = gen.block_prefill().promotions
    assert (promoted.blocks, promoted.tokens, promoted.skipped_blocks) == (2, len(DOC_A) + len(DOC_B), 0)
    later = run(gen, rag("BA"), kv_mode="concat").blocks
    assert later.block_fill_tokens == 0 and later.reused_tokens == len(DOC_A) + len(DOC_B)
    run(gen, rag("BA"))  # held already: nothing computed again
    assert gen.block_prefill().promotions.tokens == len(DOC_A) + len(DOC_B)


def test_promotion_skips_blocks_over_the_capacity_share_and_counts_them(model):
    capacity = 64
    big = ids(int(PROMOTE_SHARE * capacity) + 1, 5)
    gen = generator(model, capacity=capacity)
    run(gen, [SYSTEM, Block(big), Block(DOC_B), QUESTION])
    promoted = gen.block_prefill().promotions
    assert (promoted.blocks, promoted.skipped_blocks, promoted.skipped_tokens) == (1, 1, len(big))
    assert gen.cache.cached_length(big, salt=block_scope(None)) == 0


def test_explain_blocks_says_what_the_store_holds_and_each_mode_would_reuse(model):
    gen = generator(model)
    run(gen, rag("A"), kv_mode="concat")  # DOC_A stored, DOC_B not
    prompt_ids, spans = flatten(IdTokenizer(), rag("BA"))
    explained = {
        mode: explain_blocks(gen.cache, prompt_ids, spans, 0, None, mode, 0.25)
        for mode in ("exact", "concat", "blend")
    }
    b, a = explained["concat"]
    assert (b["offset"], b["length"], b["held"], b["device_tokens"]) == (7, len(DOC_B), False, 0)
    assert (a["offset"], a["held"], a["device_tokens"], a["redis_tokens"]) == (22, True, len(DOC_A), 0)
    assert [e["reused_tokens"] for e in explained["exact"]] == [0, 0]
    assert [e["reused_tokens"] for e in explained["concat"]] == [len(DOC_B), len(DOC_A)]
    assert [e["reused_tokens"] for e in explained["blend"]] == [15 - 4, 20 - 5]
    actual = run(gen, rag("BA"), kv_mode="blend", blend_recompute=0.25).blocks
    assert [u.reused for u in actual.blocks] == [15 - 4, 20 - 5]
    assert gen.cache.cached_length(DOC_B, salt=block_scope(None)) == len(DOC_B)  # stored by the run only


def test_block_tokens_are_counted_by_the_spill_tier_that_gave_them_and_explain_changes_nothing(
    model, tmp_path
):
    def stack() -> TierStack:  # host memory, then a disk directory another process may have filled
        return TierStack([HostTier(16 << 20), DiskTier(tmp_path / "disk", 64 << 20)], chunk_tokens=8)

    writer = generator(model, spill=stack())
    run(writer, rag("AB"), kv_mode="concat")
    writer.cache.spill.flush()
    writer.cache.close()
    reader = generator(model, spill=stack())
    prompt_ids, spans = flatten(IdTokenizer(), rag("BA"))
    before = reader.cache.spill.stats()
    explained = explain_blocks(reader.cache, prompt_ids, spans, 0, None, "concat", 0.0)
    assert [(e["device_tokens"], e["spill_tokens"], e["tiers"], e["redis_tokens"]) for e in explained] == [
        (0, 8, [{"tier": "disk", "tokens": 8}], 0),  # whole chunks only
        (0, 16, [{"tier": "disk", "tokens": 16}], 0),
    ]
    assert reader.cache.spill.stats() == before  # a dry run: nothing read, promoted or counted
    assert reader.cache.spill.tier_sizes()[0]["records"] == 0  # the host tier: nothing promoted
    r = run(reader, rag("BA"), kv_mode="concat").blocks
    assert [b.origin for b in r.blocks] == [{"device": 0, "disk": 8}, {"device": 0, "disk": 16}]
    assert r.reused_by_tier == {"device": 0, "host": 0, "disk": 8 + 16, "redis": 0, "fill": 7 + 4}
    assert "8 found stored (8 in disk)" in "\n".join(r.explain())
    reader.cache.close()
