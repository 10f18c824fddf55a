"""TierStack with two real tiers: a HostTier (run on the CPU here) above a real Redis.

A hit in Redis is promoted into the host tier, a hit in the host tier never asks Redis, write-back
demotes what the host tier evicts into Redis, an outage in Redis leaves the host tier serving, and a
damaged or forged record in either tier is a counted miss, deleted from that tier, with the run
continued from the tier below. Every cached generation is checked against a run without any cache.
Without a Redis server the tests skip, except in CI (KVBLOCKS_CI=1), where they fail.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import IdTokenizer, tiny_llama

from kvblocks import CachedGenerator, KVCacheTrie
from kvblocks.spill.host import HostTier
from kvblocks.spill.redis_tier import redis_store
from kvblocks.spill.stack import TierStack
from kvblocks.spill.tier import Tier, TierHealth, TierUnavailable

CHUNK = 8
PROMPT_TOKENS = 80
NEW_TOKENS = 4
FULL_HIT = (PROMPT_TOKENS - 1) // CHUNK * CHUNK  # what a cold trie can take from the tiers
CHUNKS = FULL_HIT // CHUNK
FAST = dict(timeout_s=0.2, connect_timeout_s=0.2, fetch_timeout_s=0.2)
SECRET = b"a tier-stack test secret"
TOKENIZER = IdTokenizer()


@pytest.fixture
def server(redis_server):
    return redis_server


@pytest.fixture
def stacks():
    """Makes [host, redis] stacks with short timeouts; drains and closes them after the test."""
    made: list[TierStack] = []

    def make(url: str, host_bytes: int = 64 << 20, **options) -> TierStack:
        tiers = [HostTier(host_bytes), redis_store(url, **FAST)]
        stack = TierStack(tiers, chunk_tokens=CHUNK, retry_interval_s=0.2, **options)
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.flush(timeout_s=3)
        stack.close()


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def prompt(seed: int) -> str:
    return " ".join(str(t) for t in np.random.default_rng(seed).integers(0, 128, PROMPT_TOKENS))


_plain: dict[str, list[int]] = {}


def generate_exact(model, cache: KVCacheTrie, text: str):
    if text not in _plain:
        _plain[text] = (
            CachedGenerator(model, TOKENIZER, None).generate(text, max_new_tokens=NEW_TOKENS).token_ids
        )
    result = CachedGenerator(model, TOKENIZER, cache).generate(text, max_new_tokens=NEW_TOKENS)
    assert result.token_ids == _plain[text]
    return result


def trie(model, stack: TierStack, capacity_tokens: int = 1000) -> KVCacheTrie:
    return KVCacheTrie.for_model(model, capacity_tokens=capacity_tokens, spill=stack)


def keys_of(stack: TierStack, cache: KVCacheTrie, text: str) -> list[str]:
    ns, ids = cache.namespace.key, np.array(TOKENIZER(text)["input_ids"])
    return [stack.key(ns, h) for h in stack.codec.chunk_hashes(ns, ids, CHUNK)]


def test_write_through_fills_both_tiers_and_a_redis_hit_is_promoted_into_the_host_tier(model, server, stacks):
    text = prompt(1)
    a_stack = stacks(server.url)
    a = trie(model, a_stack)
    generate_exact(model, a, text)
    assert a_stack.flush()
    host, _ = a_stack.tiers
    written = (PROMPT_TOKENS + NEW_TOKENS - 1) // CHUNK
    assert host.records() == written and server.client().dbsize() == written

    b_stack = stacks(server.url)
    b = trie(model, b_stack)
    assert generate_exact(model, b, text).cached_tokens == FULL_HIT
    assert b_stack.flush()
    s = b.stats()
    assert s["host_hit_chunks"] == 0 and s["redis_hit_chunks"] == CHUNKS
    assert s["host_promoted_chunks"] == CHUNKS and s["redis_hit_tokens"] == FULL_HIT
    assert b_stack.tiers[0].records() >= CHUNKS

    b.clear()  # the device forgets: the host tier serves it now, Redis is not asked
    assert generate_exact(model, b, text).cached_tokens == FULL_HIT
    s = b.stats()
    assert s["host_hit_chunks"] == CHUNKS and s["redis_hit_chunks"] == CHUNKS and s["redis_lookups"] == 1
    sizes = {row["name"]: row for row in b_stack.tier_sizes()}
    assert sizes["host"]["used_bytes"] > 0 and sizes["host"]["capacity_bytes"] == 64 << 20
    assert sizes["redis"]["records"] == written and sizes["redis"]["health"] == "ok"


def test_promotions_past_the_writers_byte_bound_are_dropped_and_counted_and_the_restore_stands(
    model, server, stacks
):
    text = prompt(2)
    a = trie(model, stacks(server.url))
    generate_exact(model, a, text)
    assert a.spill.flush()
    tight = stacks(server.url, queue_bytes=1000)  # less than one record: no promotion fits
    b = trie(model, tight)
    assert generate_exact(model, b, text).cached_tokens == FULL_HIT
    assert tight.flush()
    s = b.stats()
    assert s["redis_hit_chunks"] == CHUNKS and s["host_promoted_chunks"] == 0
    assert s["host_write_drops"] == 1 and s["host_queue_bytes"] == 0
    assert tight.tiers[0].records() == s["host_written_chunks"]  # its own write-through, no promotion


def test_write_back_writes_the_host_tier_on_eviction_and_demotes_what_it_evicts_into_redis(
    model, server, stacks
):
    texts = [prompt(10 + i) for i in range(4)]
    # the host tier holds about two prompts' chunks: the rest is demoted into Redis as it evicts
    record = 2 * 2 * 4 * 8 * 4 * CHUNK + 400  # layers, K/V, heads, head dim, float32, per chunk + frame
    stack = stacks(server.url, host_bytes=2 * CHUNKS * record, write_policy="write-back")
    cache = trie(model, stack, capacity_tokens=100)  # one prompt at a time
    for text in texts:
        generate_exact(model, cache, text)
    cache.clear()
    assert stack.flush()
    s = cache.stats()
    assert s["host_written_chunks"] >= 3 * CHUNKS and s["redis_written_chunks"] == 0
    assert s["host_evictions"] > 0 and s["redis_demoted_chunks"] == s["host_evictions"]
    assert server.client().dbsize() == s["redis_demoted_chunks"]

    cold_stack = stacks(server.url)
    cold = trie(model, cold_stack)
    assert generate_exact(model, cold, texts[0]).cached_tokens == FULL_HIT  # demoted: from Redis
    assert cold.stats()["redis_hit_chunks"] == CHUNKS
    assert generate_exact(model, cache, texts[-1]).cached_tokens == FULL_HIT  # still in the host tier
    assert cache.stats()["host_hit_chunks"] >= CHUNKS


def test_redis_down_is_skipped_and_the_host_tier_keeps_serving(model, server, stacks):
    text = prompt(20)
    stack = stacks(server.url)
    cache = trie(model, stack)
    server.stop()
    generate_exact(model, cache, text)
    assert stack.flush()
    cache.clear()
    assert generate_exact(model, cache, text).cached_tokens == FULL_HIT
    s = cache.stats()
    assert s["host_hit_chunks"] == CHUNKS and s["host_errors"] == 0
    assert s["redis_errors"] >= 1 and s["redis_held_writes"] >= 1
    assert {row["name"]: row["health"] for row in stack.tier_sizes()}["redis"] == "down"
    server.start()  # the writes held for Redis land once it answers
    assert wait_for(lambda: server.client().dbsize() > 0)


class Broken:
    """A tier whose store is gone (a disk unplugged): every operation raises TierUnavailable."""

    name = "broken"

    def _gone(self, *args):
        raise TierUnavailable("gone")

    sizes = get = put = delete = scan = used_bytes = capacity_bytes = _gone

    def health(self):
        return TierHealth("down", "gone")

    def counters(self):
        return {}

    def close(self):
        pass


def test_a_tier_that_fails_every_call_costs_misses_never_a_request(model, server, stacks):
    text = prompt(21)
    assert isinstance(Broken(), Tier)
    stack = TierStack([Broken(), redis_store(server.url, **FAST)], chunk_tokens=CHUNK, retry_interval_s=0.2)
    try:
        a = trie(model, stack)
        generate_exact(model, a, text)
        assert stack.flush()
        a.clear()
        assert generate_exact(model, a, text).cached_tokens == FULL_HIT  # from Redis
        s = a.stats()
        assert s["broken_errors"] >= 1 and s["redis_hit_chunks"] == CHUNKS
        assert [row["health"] for row in stack.tier_sizes()] == ["down", "ok"]
    finally:
        stack.close()


DAMAGED = 3


@pytest.mark.parametrize("secret", [None, SECRET])
def test_damaged_record_in_the_host_tier_is_a_counted_miss_deleted_and_redis_continues(
    model, server, stacks, secret
):
    text = prompt(30)
    stack = stacks(server.url, secret=secret)
    cache = trie(model, stack)
    generate_exact(model, cache, text)
    assert stack.flush()
    host = stack.tiers[0]
    key = keys_of(stack, cache, text)[DAMAGED]
    good = host.get([key], [1 << 30])[0]
    host.put([(key, good[:-1] + bytes([good[-1] ^ 1]))])  # one bit flipped, the size kept
    cache.clear()
    assert generate_exact(model, cache, text).cached_tokens == FULL_HIT
    assert stack.flush()
    s = cache.stats()
    assert s["host_verify_failures"] == 1 and s["host_deleted_invalid"] == 1
    assert s["host_hit_chunks"] == DAMAGED and s["redis_hit_chunks"] == CHUNKS - DAMAGED
    assert s["redis_verify_failures"] == 0
    assert host.sizes([key]) != [0]  # deleted, then promoted again from Redis, verified
    assert host.get([key], [1 << 30])[0] == good or secret is not None


@pytest.mark.parametrize("secret", [None, SECRET])
def test_forged_record_in_redis_is_a_counted_miss_and_deleted_there(model, server, stacks, secret):
    text, other = prompt(40), prompt(41)
    a_stack = stacks(server.url, secret=secret)
    a = trie(model, a_stack)
    generate_exact(model, a, text)
    generate_exact(model, a, other)
    assert a_stack.flush()
    client = server.client()
    key = keys_of(a_stack, a, text)[DAMAGED]
    forged = client.get(keys_of(a_stack, a, other)[DAMAGED])  # another prompt's record: same size
    client.set(key, forged)
    b_stack = stacks(server.url, secret=secret)
    b = trie(model, b_stack)
    assert generate_exact(model, b, text).cached_tokens == DAMAGED * CHUNK
    assert b_stack.flush()
    s = b.stats()
    assert s["redis_verify_failures"] == 1 and s["redis_deleted_invalid"] == 1
    assert client.get(key) != forged  # deleted, then written again by b's write-through
    c = trie(model, stacks(server.url, secret=secret))
    assert generate_exact(model, c, text).cached_tokens == FULL_HIT


def wait_for(condition, timeout_s: float = 5.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_host_tier_is_an_lru_by_bytes_and_refuses_a_record_larger_than_itself():
    evicted = []
    host = HostTier(100)
    host.bind_demote(evicted.extend)
    host.put([("a", bytes(40)), ("b", bytes(40))])
    host.get(["a"], [100])  # a is now the most recent
    host.put([("c", bytes(40))])
    assert evicted == [("b", bytes(40))] and host.used_bytes() == 80 and host.records() == 2
    host.put([("big", bytes(101))])
    assert host.counters()["refused_too_large"] == 1 and host.sizes(["big", "a", "c"]) == [0, 40, 40]
    assert host.get(["a"], [10]) == [bytes(10)] and sorted(host.scan("")) == ["a", "c"]
    assert host.delete(["a", "zz"]) == 1 and host.used_bytes() == 40
    with pytest.raises(ValueError):
        HostTier(0)


def test_a_recurrent_models_snapshots_are_found_in_the_host_tier_or_in_redis_and_promoted(server, stacks):
    """State snapshots at chunk ends go to both tiers; a cold trie whose host tier is empty finds the
    furthest one in Redis and promotes it; after the device forgets, the host tier serves it."""
    import torch
    from test_hybrid import model_for, one_shot
    from tiny_models import random_ids

    model = model_for("qwen3_next", torch.float64)
    prompt = random_ids(40, seed=17)
    follow = [*prompt[:35], *random_ids(5, seed=18)]

    def hybrid(stack: TierStack) -> KVCacheTrie:
        return KVCacheTrie.for_model(model, capacity_tokens=4096, snapshot_every=16, spill=stack)

    writer_stack = TierStack([HostTier(64 << 20), redis_store(server.url, **FAST)], chunk_tokens=16)
    writer = hybrid(writer_stack)
    CachedGenerator(model, IdTokenizer(), writer).generate(prompt, max_new_tokens=4)
    assert writer_stack.flush()
    s = writer.stats()
    assert s["host_written_states"] >= 2 and s["redis_written_states"] == s["host_written_states"]
    writer_stack.close()

    stack = TierStack([HostTier(64 << 20), redis_store(server.url, **FAST)], chunk_tokens=16)
    try:
        reader = hybrid(stack)
        result = CachedGenerator(model, IdTokenizer(), reader).generate(follow, max_new_tokens=4)
        assert result.cached_tokens == 32 and result.token_ids == one_shot(model, follow, 4)[0]
        assert stack.flush()
        s = reader.stats()
        assert s["host_state_hits"] == 0 and s["redis_state_hits"] == 1 and s["host_promoted_chunks"] >= 1
        reader.clear()
        result = CachedGenerator(model, IdTokenizer(), reader).generate(follow, max_new_tokens=4)
        assert result.cached_tokens == 32 and result.token_ids == one_shot(model, follow, 4)[0]
        s = reader.stats()
        assert s["host_state_hits"] == 1 and s["redis_state_hits"] == 1
    finally:
        stack.close()
