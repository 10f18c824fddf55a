"""Blocks stored ahead of use (`CachedGenerator.store_block`): the first request that uses the block
finds it at any offset, per salt and tenant; and `kvblocks.chat_blocks`, the chat template's
rendering with marked parts as `Block`s."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import IdTokenizer, tiny_llama
from server_proc import tiny_model_dir

from kvblocks import Block, CachedGenerator, KVCacheTrie, PromptError, Scope, chat_blocks
from kvblocks.generate.generator import Working

VOCAB = 128


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


SYSTEM, DOC, QUESTION = ids(7, 1), ids(20, 2), ids(5, 4)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(torch.float64, num_hidden_layers=3)


def generator(model) -> CachedGenerator:
    return CachedGenerator(model, IdTokenizer(), KVCacheTrie.for_model(model, capacity_tokens=4096))


def test_a_stored_block_is_found_whole_by_the_first_request_that_uses_it(model):
    gen = generator(model)
    stored = gen.store_block(DOC)
    assert (stored.tokens, stored.held, stored.already_stored) == (len(DOC), 0, False)
    r = gen.generate([SYSTEM, Block(DOC), QUESTION], max_new_tokens=2, kv_mode="concat").blocks
    assert r.block_fill_tokens == 0 and r.reused_tokens == len(DOC)
    assert r.blocks[0].stored == len(DOC)


def test_storing_a_held_block_again_computes_nothing(model):
    gen = generator(model)
    gen.store_block(Block(DOC))
    steps = list(gen.store_steps(DOC, chunk=4))
    assert not any(isinstance(step, Working) for step in steps)
    assert steps[-1].already_stored and steps[-1].held == len(DOC)


def test_store_steps_run_the_fill_in_forwards_of_at_most_the_chunk(model):
    gen = generator(model)
    steps = list(gen.store_steps(DOC, chunk=6))
    work = [s.tokens for s in steps if isinstance(s, Working)]
    assert work == [6, 6, 6, 2] and steps[-1].held == 0


def test_a_block_stored_under_one_tenant_is_not_found_by_another(model):
    gen = generator(model)
    gen.store_block(DOC, salt=Scope("acme", ""))
    other = gen.generate(
        [SYSTEM, Block(DOC), QUESTION], max_new_tokens=2, kv_mode="concat", salt=Scope("globex", "")
    )
    assert other.blocks.block_fill_tokens == len(DOC)
    own = gen.generate(
        [SYSTEM, Block(DOC), QUESTION], max_new_tokens=2, kv_mode="concat", salt=Scope("acme", "")
    )
    assert own.blocks.block_fill_tokens == 0


@pytest.mark.parametrize("block", [[], "", [VOCAB + 5]])
def test_an_empty_or_out_of_vocabulary_block_is_refused(model, block):
    with pytest.raises(PromptError):
        generator(model).store_block(block)


def test_a_block_longer_than_the_context_is_refused(model):
    gen = generator(model)
    with pytest.raises(PromptError, match="context"):
        gen.store_block(ids(gen.max_context + 1, 9))


def test_chat_blocks_renders_the_template_with_each_marked_part_a_block_tokenised_alone():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    doc = "The code of Vendor Q7 is 4821.\n"
    messages = [
        {"role": "system", "content": "Answer from the documents."},
        {"role": "user", "content": [{"type": "text", "text": doc, "kvblocks_block": True},
                                     {"type": "text", "text": "What is the code?"}]},
    ]  # fmt: skip
    segments = chat_blocks(tokenizer, messages)
    blocks = [s for s in segments if isinstance(s, Block)]
    assert [b.content for b in blocks] == [tuple(tokenizer(doc, add_special_tokens=False)["input_ids"])]
    plain = [{"role": m["role"], "content": doc + "What is the code?" if m["role"] == "user" else m["content"]}
             for m in messages]  # fmt: skip
    text = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    flat = [t for s in segments for t in (s.content if isinstance(s, Block) else s)]
    assert tokenizer.decode(flat) == text


def test_chat_blocks_refuses_a_part_without_text():
    with pytest.raises(PromptError, match="text part"):
        chat_blocks(IdTokenizer(), [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])
