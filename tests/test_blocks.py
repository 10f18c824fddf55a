"""KV blocks (`kvblocks.blocks`): block KV stored once, found at any offset, re-rotated exactly, and
the blend/concat prefill against full prefill and a reference built segment by segment."""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import IdTokenizer, tiny_llama
from redis_server import start_redis

from kvblocks import Block, CachedGenerator, GenerationParams, KVCacheTrie, ParamError
from kvblocks.adapters import hf
from kvblocks.blocks.prefill import block_scope
from kvblocks.blocks.rope import RopeShift
from kvblocks.blocks.segments import flatten
from kvblocks.generate.generator import Working

VOCAB = 128


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(torch.float64, num_hidden_layers=3)


def generator(model, cache=True, **kwargs) -> CachedGenerator:
    trie = KVCacheTrie.for_model(model, capacity_tokens=4096, **kwargs) if cache else None
    return CachedGenerator(model, IdTokenizer(), trie)


SYSTEM, DOC_A, DOC_B, QUESTION = ids(7, 1), ids(20, 2), ids(15, 3), ids(5, 4)


def rag(order: str) -> list:
    docs = {"A": Block(DOC_A), "B": Block(DOC_B)}
    return [SYSTEM, *(docs[c] for c in order), QUESTION]


def flat(prompt: list) -> list[int]:
    return [t for seg in prompt for t in (seg.content if isinstance(seg, Block) else seg)]


def run(gen, prompt, **kwargs):
    return gen.generate(prompt, max_new_tokens=4, output_logits=True, **kwargs)


def test_rerotation_composes_with_the_rotation_at_position_zero_to_1e12(model):
    shift = RopeShift(model)
    keys = torch.randn(6, 2, 16, dtype=torch.float64)
    at = [shift.shift(keys[i : i + 1], i) for i in range(6)]  # keys as stored: rotated to 0..5
    for offset in (1, 37, 300):
        moved = torch.cat([shift.shift(k, offset) for k in at])
        direct = torch.cat([shift.shift(keys[i : i + 1], i + offset) for i in range(6)])
        assert (moved - direct).abs().max() < 1e-12


def test_rerotated_block_keys_equal_the_models_keys_computed_at_the_offset(model):
    """Layer-0 keys depend on the token and its position only: a block's keys stored at 0..n-1 and
    moved by p equal the model's own keys at p..p+n-1 (transformers tabulates RoPE in float32)."""
    block = torch.tensor([DOC_A])
    at_zero, at_offset = hf.empty_cache(model.config), hf.empty_cache(model.config)
    p = 41
    with torch.inference_mode():
        model(input_ids=block, cache=at_zero, use_cache=True)
        positions = torch.arange(p, p + len(DOC_A))[None]
        model(input_ids=block, position_ids=positions, cache=at_offset, use_cache=True)
    stored = at_zero.layers[0].keys[0].transpose(0, 1)
    expected = at_offset.layers[0].keys[0].transpose(0, 1)
    moved = RopeShift(model).shift(stored, p)
    assert (moved - expected).abs().max() < 1e-5
    assert (stored - expected).abs().max() > 1e-2  # the shift is not a no-op


def test_a_block_is_stored_once_and_found_at_two_offsets_and_in_another_order(model):
    gen = generator(model)
    twice = [SYSTEM, Block(DOC_A), ids(3, 9), Block(DOC_A), QUESTION]
    first = run(gen, twice, kv_mode="concat").blocks
    assert [b.start for b in first.blocks] == [7, 30]
    assert first.block_fill_tokens == len(DOC_A)  # computed once for both places
    second = run(gen, rag("AB"), kv_mode="concat").blocks
    assert second.block_fill_tokens == len(DOC_B)
    third = run(gen, rag("BA"), kv_mode="concat").blocks
    assert third.block_fill_tokens == 0
    assert [(b.start, b.stored) for b in third.blocks] == [(7, len(DOC_B)), (22, len(DOC_A))]
    assert gen.cache.cached_length(DOC_A, salt=block_scope(None)) == len(DOC_A)
    assert gen.cache.cached_length(DOC_A) == 0  # not in the request's own namespace


def test_concat_equals_blocks_computed_alone_at_their_positions(model):
    """Reference: each block prefilled on its own at its position ids, its KV appended; plain
    segments prefilled over that cache as usual."""
    prompt = [SYSTEM, Block(DOC_B), ids(4, 5), Block(DOC_A), QUESTION]
    past = hf.empty_cache(model.config)
    start = 0
    with torch.inference_mode():
        for seg in prompt:
            tokens = torch.tensor([seg.content if isinstance(seg, Block) else seg])
            positions = torch.arange(start, start + tokens.shape[1])[None]
            if isinstance(seg, Block):
                alone = hf.empty_cache(model.config)
                model(input_ids=tokens, position_ids=positions, cache=alone, use_cache=True)
                for layer, own in zip(past.layers, alone.layers):
                    if layer.is_initialized:
                        layer.keys = torch.cat((layer.keys, own.keys), dim=-2)
                        layer.values = torch.cat((layer.values, own.values), dim=-2)
            else:
                logits = model(input_ids=tokens, position_ids=positions, cache=past).logits
            start += tokens.shape[1]
    result = run(generator(model), prompt, kv_mode="concat")
    assert (result.logits[0] - logits[0, -1]).abs().max() < 1e-5
    assert result.blocks.reused_tokens == len(DOC_A) + len(DOC_B)


def test_blend_share_one_equals_full_prefill_bit_for_bit(model):
    prompt = rag("BA")
    full = run(generator(model, cache=False), flat(prompt))
    gen = generator(model)
    run(gen, rag("AB"), kv_mode="blend")  # blocks stored, prefix cached
    blended = run(gen, prompt, kv_mode="blend", blend_recompute=1.0)
    assert blended.token_ids == full.token_ids
    assert all(torch.equal(a, b) for a, b in zip(blended.logits, full.logits))
    assert blended.blocks.recomputed_tokens == len(flat(prompt)) - blended.cached_tokens


def test_blend_share_zero_equals_concat(model):
    gen = generator(model)
    concat = run(gen, rag("AB"), kv_mode="concat")
    blend = run(gen, rag("AB"), kv_mode="blend", blend_recompute=0.0)
    assert all(torch.equal(a, b) for a, b in zip(blend.logits, concat.logits))
    assert blend.blocks.probe_tokens == 0


def test_blend_recomputes_the_share_and_accounts_every_prompt_token(model):
    gen = generator(model)
    result = run(gen, rag("AB"), kv_mode="blend", blend_recompute=0.3)
    report = result.blocks
    assert report.exact_tokens + report.reused_tokens + report.recomputed_tokens == result.prompt_tokens
    for use, doc in zip(report.blocks, (DOC_A, DOC_B)):
        assert use.length - use.reused == math.ceil(0.3 * len(doc))
    assert report.probe_tokens == len(DOC_A) + len(DOC_B)
    assert "block 1: 15 tokens at offset 27" in "\n".join(report.explain())


def test_blend_moves_logits_toward_full_prefill(model):
    prompt = rag("BA")
    full = run(generator(model, cache=False), flat(prompt)).logits[0]
    gen = generator(model)
    gaps = [
        (run(gen, prompt, kv_mode="blend", blend_recompute=s).logits[0] - full).abs().max()
        for s in (0, 0.5, 1)
    ]
    assert gaps[0] > gaps[1] > gaps[2] == 0


def test_exact_mode_with_blocks_equals_the_flat_prompt(model):
    plain = run(generator(model), flat(rag("AB")))
    exact = run(generator(model), rag("AB"))
    assert exact.token_ids == plain.token_ids and exact.blocks is None
    assert all(torch.equal(a, b) for a, b in zip(exact.logits, plain.logits))


def test_blended_kv_never_enters_the_prefix_cache(model):
    gen = generator(model)
    prompt = rag("AB")
    result = run(gen, prompt, kv_mode="concat")
    assert gen.cache.cached_length(flat(prompt) + result.token_ids) == len(SYSTEM)
    assert run(gen, prompt, kv_mode="concat").cached_tokens == len(SYSTEM)


def test_a_prompt_ending_in_a_block_computes_its_last_token(model):
    gen = generator(model)
    result = run(gen, [SYSTEM, Block(DOC_A)], kv_mode="concat")
    assert result.blocks.blocks[0].reused == len(DOC_A) - 1
    assert result.blocks.recomputed_tokens == len(SYSTEM) + 1  # the plain start, computed now


def test_unknown_kv_mode_is_refused_by_name():
    with pytest.raises(ParamError, match="kv_mode must be one of exact, blend, concat"):
        GenerationParams(kv_mode="smash")


def test_a_model_without_rope_is_refused_by_name_in_blend_and_concat():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(
        GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB, n_positions=64)
    ).eval()
    gen = CachedGenerator(gpt2, IdTokenizer(), KVCacheTrie.for_model(gpt2, capacity_tokens=256))
    for mode in ("blend", "concat"):
        with pytest.raises(ParamError, match="model type 'gpt2' has no rotary position embedding"):
            gen.generate([Block([1, 2, 3]), [4, 5]], max_new_tokens=1, kv_mode=mode)
    assert len(gen.generate([Block([1, 2, 3]), [4, 5]], max_new_tokens=1).token_ids) == 1


def test_a_block_is_shared_across_two_tries_through_one_redis(model, tmp_path):
    from kvblocks import RedisTier

    server = start_redis(tmp_path / "redis")
    try:
        writer = generator(model, spill=RedisTier(server.url, chunk_tokens=8))
        first = run(writer, rag("AB"), kv_mode="concat")
        writer.cache.spill.flush()
        reader = generator(model, spill=RedisTier(server.url, chunk_tokens=8))
        second = run(reader, rag("AB"), kv_mode="concat")
        assert [b.stored for b in second.blocks.blocks] == [16, 8]  # whole chunks of 20 and 15 tokens
        assert second.blocks.block_fill_tokens == 4 + 7
        assert second.token_ids == first.token_ids
        assert all((a - b).abs().max() < 1e-9 for a, b in zip(second.logits, first.logits))
        for gen in (writer, reader):
            gen.cache.close()
    finally:
        server.stop()


def test_blend_recomputing_every_block_token_out_of_order_equals_full_prefill(model):
    """Share 0.99 recomputes all block tokens through the masked forward (not the ordinary path):
    the mask and the write-back in position order make it the full prefill."""
    prompt = rag("BA")
    full = run(generator(model, cache=False), flat(prompt))
    gen = generator(model)
    result = run(gen, prompt, kv_mode="blend", blend_recompute=0.99)
    assert result.blocks.reused_tokens == 0 and result.blocks.probe_tokens > 0
    assert result.token_ids == full.token_ids
    assert all((a - b).abs().max() < 1e-10 for a, b in zip(result.logits, full.logits))


@pytest.mark.parametrize("share", [0.05, 0.3, 0.7])
def test_blend_of_blocks_whose_stored_kv_is_exact_equals_full_prefill_at_every_share(model, share):
    """A block at offset 0 computed alone is the full prefill's own KV there: whatever share is
    recomputed, the masked forward (each recomputed token attends causally to reused and recomputed
    tokens before it, at its own position) must give the full prefill back."""
    prompt = [Block(DOC_A), QUESTION]
    full = run(generator(model, cache=False), flat(prompt))
    gen = generator(model)
    run(gen, prompt, kv_mode="concat")  # the block stored
    result = run(gen, prompt, kv_mode="blend", blend_recompute=share)
    assert 0 < result.blocks.reused_tokens < len(DOC_A)
    assert result.token_ids == full.token_ids
    assert all((a - b).abs().max() < 1e-10 for a, b in zip(result.logits, full.logits))


@pytest.mark.parametrize("mode", ["concat", "blend"])
def test_block_work_in_chunks_gives_the_logits_of_the_whole_forwards(model, mode):
    """`stream(block_chunk=N)` splits the exact prefix, each fill, the probe and the recompute into
    forwards of at most N tokens; chunks of a causal forward attend to what the whole one does."""
    prompt = [SYSTEM, Block(DOC_A), QUESTION[:2], Block(DOC_B), Block(DOC_A), QUESTION]
    whole = run(generator(model), prompt, kv_mode=mode, blend_recompute=0.3)
    gen = generator(model)
    steps = list(gen.stream(prompt, max_new_tokens=4, output_logits=True, kv_mode=mode, blend_recompute=0.3,
                            block_chunk=3))  # fmt: skip
    work = [s.tokens for s in steps if isinstance(s, Working)]
    chunked = steps[-1].result
    assert max(work) <= 3 and chunked.blocks.block_fill_tokens == len(DOC_A) + len(DOC_B)
    b = chunked.blocks  # the trailing QUESTION is prefilled as usual, after the block work
    assert sum(work) == b.block_fill_tokens + b.probe_tokens + b.recomputed_tokens - len(QUESTION)
    assert chunked.token_ids == whole.token_ids
    assert chunked.blocks.reused_tokens == whole.blocks.reused_tokens
    assert all((a - b).abs().max() < 1e-10 for a, b in zip(chunked.logits, whole.logits))


def test_a_closed_stream_in_the_middle_of_its_block_work_holds_no_lock(model):
    gen = generator(model)
    stream = gen.stream([SYSTEM, Block(DOC_A), Block(DOC_B), QUESTION], max_new_tokens=2, kv_mode="blend",
                        block_chunk=4)  # fmt: skip
    for _ in range(5):
        assert isinstance(next(stream), Working)
    stream.close()
    assert gen.cache.stats()["locked_tokens"] == 0


def test_an_empty_block_is_refused_by_name():
    from kvblocks.generate.text import PromptError

    with pytest.raises(PromptError, match="must not be empty"):
        Block([])
    tokenizer = IdTokenizer()
    with pytest.raises(PromptError, match="gives no tokens"):
        flatten(tokenizer, [[1, 2], Block(" ")])
