"""The slot manager: every slot has one owner (the trie, or one sequence), through reserve, commit,
complete and release, with no forward involved (the slots' KV content is not looked at)."""

from __future__ import annotations

import pytest
import torch
from test_batch_engine import no_leaks
from test_scheduler import sequence
from tiny_models import tiny_model

from kvblocks import KVCacheTrie
from kvblocks.engine.slots import SlotManager


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", torch.float32)


def test_a_committed_prompt_is_the_tries_and_stays_locked_until_release(model):
    cache = KVCacheTrie.for_model(model, capacity_tokens=64)
    slots = SlotManager(cache)
    s = sequence(10)
    slots.lock_prefix(s)
    assert (s.start, s.computed, s.cached_tokens) == (0, 0, 0)
    slots.reserve(s, 12)  # the prompt and two more positions
    s.computed = 10
    slots.commit_prompt(s)
    assert s.start == 10 and len(s.slots) == 12 and cache.stats()["locked_tokens"] == 10
    assert SlotManager(cache).cached_length(sequence(10)) == 10  # a request admitted now hits it
    slots.release(s)
    no_leaks(cache)
    assert cache.stats()["resident_tokens"] == 10


def test_complete_passes_the_computed_reply_to_the_trie_and_frees_the_rest(model):
    cache = KVCacheTrie.for_model(model, capacity_tokens=64)
    slots = SlotManager(cache)
    s = sequence(6)
    slots.lock_prefix(s)
    slots.reserve(s, 9)
    s.computed = 6
    slots.commit_prompt(s)
    s.sequence += [1, 2]
    s.computed = 7  # the last sampled token has no KV yet
    slots.complete(s)
    no_leaks(cache)
    assert cache.stats()["resident_tokens"] == 7 and s.hit is None and len(s.slots) == 0


def test_the_tries_slots_are_never_given_back_by_a_sequence(model):
    cache = KVCacheTrie.for_model(model, capacity_tokens=64)
    slots = SlotManager(cache)
    s = sequence(6)
    slots.lock_prefix(s)
    slots.reserve(s, 6)
    s.computed = 6
    slots.commit_prompt(s)
    with pytest.raises(AssertionError, match="not the sequence's"):
        slots.trim(s, 3)
    slots.release(s)
    no_leaks(cache)
