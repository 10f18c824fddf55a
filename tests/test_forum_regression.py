"""The forum report: reusing a cached system prompt changed greedy answers (Llama-3.1, Qwen2.5).

Root cause: the prefix was tokenised alone and looked up by text. With byte-level BPE the last
token of "You are a helpful assistant. " is a lone space `Ġ`, which merges into `ĠHelp` when the
user's text follows. transformers' `generate(full_ids, past_key_values=prefix_cache)` drops the
first `cache length` ids without checking them, so the model runs with the KV of `Ġ` where the
prompt says `ĠHelp`. kvblocks matches by ids, so the boundary token is simply a miss and is
recomputed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from kvblocks import CachedGenerator, KVCacheTrie

SYSTEM = "You are a helpful assistant. "
QUESTION = "Help me plan a trip to Paris."
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def setup(smollm2):
    model, tokenizer = smollm2
    prefix_ids = tokenizer(SYSTEM)["input_ids"]
    full_ids = tokenizer(SYSTEM + QUESTION)["input_ids"]
    with torch.inference_mode():
        no_cache = model.generate(torch.tensor([full_ids]), do_sample=False, max_new_tokens=NEW_TOKENS)
    return model, tokenizer, prefix_ids, full_ids, no_cache[0, len(full_ids) :].tolist()


def test_system_prompt_ends_in_a_token_that_merges_with_the_user_text(setup):
    _, tokenizer, prefix_ids, full_ids, _ = setup
    boundary = len(prefix_ids) - 1
    assert tokenizer.convert_ids_to_tokens(prefix_ids[boundary]) == "Ġ"
    assert full_ids[:boundary] == prefix_ids[:boundary]
    assert tokenizer.convert_ids_to_tokens(full_ids[boundary]) == "ĠHelp"


def test_kvblocks_reusing_the_system_prompt_gives_the_uncached_answer(setup):
    model, tokenizer, prefix_ids, full_ids, no_cache = setup
    gen = CachedGenerator(model, tokenizer, KVCacheTrie.for_model(model, capacity_tokens=512))
    gen.generate(SYSTEM, max_new_tokens=1)  # caches exactly the system prompt's ids
    result = gen.generate(SYSTEM + QUESTION, max_new_tokens=NEW_TOKENS)
    assert result.prompt_ids == full_ids
    assert result.cached_tokens == len(prefix_ids) - 1  # everything but the lone `Ġ`
    assert result.token_ids == no_cache


def test_plain_transformers_prefix_cache_recipe_changes_the_answer(setup):
    """The failure kvblocks avoids: generate() trusts that the cache holds the prompt's first ids."""
    model, _, prefix_ids, full_ids, no_cache = setup
    with torch.inference_mode():
        prefix_cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([prefix_ids]), past_key_values=prefix_cache, use_cache=True)
        out = model.generate(
            torch.tensor([full_ids]),
            past_key_values=copy.deepcopy(prefix_cache),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
        )
    assert out[0, len(full_ids) :].tolist() != no_cache
