"""Spill promotion races: KV fetched from Redis never lands at the wrong positions.

`KVCacheTrie.match` reads the device hit under the trie lock, fetches the chunks that follow it
from Redis without the lock, and promotes them under the lock again. Another request may evict
the prefix the fetched run continues in between (and reuse its slots). This file proves, against
a real redis-server and a real tiny model, that such a run is dropped (counted in
`spill_lost_tokens`) and the output stays that of a run without any cache:

- one forced interleaving, with the eviction injected right after the Redis fetch returns, and
  its positive control (without the eviction the fetched run is promoted);
- a stress test: threads sharing one trie whose capacity is far below the working set, every
  request's next-token logits checked against a run without any cache, and afterwards every
  record the threads left in Redis checked the same way from a cold trie.

Without a Redis server the tests skip, except in CI (KVBLOCKS_CI=1), where they fail.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from conftest import IdTokenizer, tiny_llama
from redis_server import RedisServer, RedisUnavailable, unavailable

from kvblocks import CachedGenerator, KVCacheTrie
from kvblocks.adapters import hf
from kvblocks.spill.redis_tier import RedisTier

CHUNK = 8
VOCAB = 128  # tiny_llama's
TOKENIZER = IdTokenizer()
FAST = dict(chunk_tokens=CHUNK, timeout_s=0.2, connect_timeout_s=0.2, retry_interval_s=0.2)
# Closer than this to a run without any cache: chunked and one-shot prefills differ by ~1e-16
# in float64 (and ~1e-6 in float32); KV at the wrong positions moves logits by ~1e-1.
ATOL = {torch.float32: 1e-4, torch.float64: 1e-9}


# ---- servers, tiers, models ------------------------------------------------------------------


@pytest.fixture
def server(tmp_path):
    try:
        srv = RedisServer(tmp_path / "redis").start()
    except RedisUnavailable as exc:
        unavailable(str(exc))
    yield srv
    srv.stop()


@pytest.fixture
def tiers():
    """Makes RedisTiers; drains and closes them after the test."""
    made: list[RedisTier] = []

    def make(url: str, **overrides) -> RedisTier:
        tier = RedisTier(url, **(FAST | overrides))
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.flush(timeout_s=3)
        tier.close()


_models: dict[torch.dtype, torch.nn.Module] = {}


def model_of(dtype: torch.dtype):
    if dtype not in _models:
        _models[dtype] = tiny_llama(dtype, seed=0)
    return _models[dtype]


def random_ids(rng: np.random.Generator, n: int, first: int | None = None) -> list[int]:
    ids = rng.integers(0, VOCAB, n).tolist()
    if first is not None:
        ids[0] = first
    return ids


def text_of(ids: list[int]) -> str:
    return " ".join(str(t) for t in ids)


@torch.inference_mode()
def prefill(model, ids: list[int]):
    """A transformers cache holding the KV of all of `ids` (for direct `insert` calls)."""
    return model(
        input_ids=torch.tensor([ids]), past_key_values=hf.empty_cache(model.config), use_cache=True
    ).past_key_values


# ---- a forced interleaving -------------------------------------------------------------------

PROMPT_TOKENS = 80
NEW_TOKENS = 8
HELD = 36  # B's resident prefix of the prompt: Redis is asked for chunks 4.. (positions 32..71)
FETCHED = ((PROMPT_TOKENS - 1) // CHUNK - HELD // CHUNK) * CHUNK
B_CAPACITY = 96
B_FREE_AFTER_REUSE = 10  # slots left free once another request holds the rest locked


def interleaving(dtype: torch.dtype, server: RedisServer, tiers, *, evict: bool):
    """Trie A caches the prompt in Redis; trie B holds its first HELD tokens, then generates it.

    B's Redis fetch is wrapped: with `evict`, once the real fetch has returned (before the trie
    retakes its lock to promote the run), B's resident prefix is evicted and its slots reused by
    another request that keeps them locked, so only B_FREE_AFTER_REUSE slots stay free.
    Returns (B's result, the result without any cache, B's stats, what the wrapper saw).
    """
    model = model_of(dtype)
    rng = np.random.default_rng(7)
    ids = random_ids(rng, PROMPT_TOKENS)
    other = random_ids(rng, B_CAPACITY - B_FREE_AFTER_REUSE, first=(ids[0] + 1) % VOCAB)
    text = text_of(ids)
    plain = CachedGenerator(model, TOKENIZER, None).generate(
        text, max_new_tokens=NEW_TOKENS, output_logits=True
    )

    tier_a = tiers(server.url)
    a = KVCacheTrie.for_model(model, capacity_tokens=1000, spill=tier_a)
    CachedGenerator(model, TOKENIZER, a).generate(text, max_new_tokens=NEW_TOKENS)
    assert tier_a.flush()
    assert a.stats()["redis_written_chunks"] == (PROMPT_TOKENS + NEW_TOKENS - 1) // CHUNK

    tier_b = tiers(server.url)
    b = KVCacheTrie.for_model(model, capacity_tokens=B_CAPACITY, spill=tier_b)
    assert b.insert(ids[:HELD], prefill(model, ids[:HELD])) == HELD
    assert tier_b.flush()

    real_fetch = tier_b.fetch
    seen: dict = {"fetches": [], "held": []}

    def fetch_then_interfere(ns_key, token_ids, start, limit):
        fetched = real_fetch(ns_key, token_ids, start, limit)
        seen["fetches"].append(None if fetched is None else (start, fetched.start, fetched.length))
        if evict and not seen["held"]:
            seen["evicted"] = b.evict(B_CAPACITY)
            b.insert(other, prefill(model, other))
            # A concurrent request on `other`: its hit keeps the reused slots locked (and, with all
            # of `other` resident, its own match never asks Redis).
            seen["held"].append(b.match([*other, 0]))
        return fetched

    tier_b.fetch = fetch_then_interfere
    try:
        cached = CachedGenerator(model, TOKENIZER, b).generate(
            text, max_new_tokens=NEW_TOKENS, output_logits=True
        )
    finally:
        tier_b.fetch = real_fetch
        for hit in seen["held"]:
            hit.release()
    return cached, plain, b.stats(), seen


def assert_same_as_no_cache(cached, plain, dtype: torch.dtype) -> None:
    assert cached.token_ids == plain.token_ids
    assert len(cached.logits) == len(plain.logits) == NEW_TOKENS
    for got, want in zip(cached.logits, plain.logits, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_eviction_between_redis_fetch_and_promotion_gives_correct_output(dtype, server, tiers):
    cached, plain, stats, seen = interleaving(dtype, server, tiers, evict=True)
    # The interleaving really happened: Redis returned the chunks after B's HELD tokens, and
    # those tokens were gone (their slots locked by another request) before promotion.
    assert seen["fetches"] == [(HELD, HELD // CHUNK * CHUNK, FETCHED)]
    assert seen["evicted"] == HELD
    assert seen["held"][0].length == B_CAPACITY - B_FREE_AFTER_REUSE
    assert_same_as_no_cache(cached, plain, dtype)
    # The fetched run was dropped, not stored at positions 0.. in the free slots; the whole
    # prompt was prefilled.
    assert stats["spill_lost_tokens"] == FETCHED
    assert stats["spill_hit_tokens"] == 0
    assert cached.cached_tokens == 0
    assert stats["locked_tokens"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_without_eviction_between_fetch_and_promotion_the_fetched_run_is_promoted(dtype, server, tiers):
    cached, plain, stats, seen = interleaving(dtype, server, tiers, evict=False)
    start = HELD // CHUNK * CHUNK
    assert seen["fetches"] == [(HELD, start, FETCHED)]
    assert stats["spill_lost_tokens"] == 0
    assert stats["spill_hit_tokens"] == start + FETCHED - HELD > 0
    assert cached.cached_tokens == start + FETCHED
    assert_same_as_no_cache(cached, plain, dtype)
    assert stats["locked_tokens"] == 0


# ---- many threads ----------------------------------------------------------------------------

THREADS = 4
REQUESTS_PER_THREAD = 1250
STRESS_CAPACITY = 192


def stress_prompts() -> list[list[int]]:
    """4 system prefixes x 6 suffixes, and a follow-up turn of half of them: 36 prompts of 20-80
    tokens sharing prefixes, about 900 distinct tokens in all."""
    rng = np.random.default_rng(11)
    prompts = []
    for p, length in enumerate((12, 20, 27, 36)):
        system = random_ids(rng, length, first=p)
        for s in range(6):
            first = system + random_ids(rng, int(rng.integers(max(8, 28 - length), 56 - length)))
            prompts.append(first)
            if s % 2 == 0:
                prompts.append(first + random_ids(rng, int(rng.integers(8, 81 - len(first)))))
    assert all(20 <= len(p) <= 80 for p in prompts)
    return prompts


@torch.inference_mode()
def next_token_logits(model, ids: list[int], past) -> torch.Tensor:
    """Logits of the token after `ids`; `past` holds the KV of a prefix of `ids` and grows to all."""
    computed = past.get_seq_length()
    out = model(input_ids=torch.tensor([ids[computed:]]), past_key_values=past, use_cache=True)
    return out.logits[0, -1]


def test_many_threads_with_a_real_redis_and_capacity_below_the_working_set_give_no_wrong_output(
    server, tiers
):
    dtype = torch.float64
    model = model_of(dtype)
    prompts = stress_prompts()
    reference = [next_token_logits(model, ids, hf.empty_cache(model.config)) for ids in prompts]
    working_set = len({tuple(ids[: i + 1]) for ids in prompts for i in range(len(ids))})
    assert working_set > STRESS_CAPACITY * 4

    tier = tiers(server.url, timeout_s=2.0, connect_timeout_s=2.0)
    cache = KVCacheTrie.for_model(model, capacity_tokens=STRESS_CAPACITY, spill=tier)
    wrong: list[tuple[int, int, float]] = []  # (prompt, hit length, max |logit difference|)
    errors: list[str] = []
    done = [0] * THREADS
    start = threading.Barrier(THREADS)

    def worker(t: int) -> None:
        picks = random.Random(t)
        start.wait()
        with torch.inference_mode():
            for _ in range(REQUESTS_PER_THREAD):
                p = picks.randrange(len(prompts))
                ids = prompts[p]
                try:
                    with cache.match(ids) as hit:
                        past = hit.to_hf_cache()
                        logits = next_token_logits(model, ids, past)
                        cache.insert(ids, past)
                except Exception as exc:
                    errors.append(f"thread {t}, prompt {p}: {exc!r}")
                    continue
                if not torch.allclose(logits, reference[p], rtol=0, atol=ATOL[dtype]):
                    wrong.append((p, hit.length, (logits - reference[p]).abs().max().item()))
                done[t] += 1

    threads = [threading.Thread(target=worker, args=(t,), name=f"stress-{t}") for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in threads), "a worker hung"

    stats = cache.stats()
    summary = {k: stats[k] for k in ("queries", "hit_tokens", "evicted_tokens", "spill_hit_tokens")}
    summary |= {k: stats[k] for k in ("spill_lost_tokens", "redis_hit_tokens", "redis_errors")}
    assert (len(wrong), len(errors)) == (0, 0), (
        f"wrong outputs (prompt, hit length, max diff): {wrong[:5]}; exceptions: {errors[:3]}; {summary}"
    )
    assert sum(done) == stats["queries"] == THREADS * REQUESTS_PER_THREAD
    assert stats["spill_hit_tokens"] > 0, summary  # Redis restores happened
    assert stats["evicted_tokens"] > 0, summary
    assert stats["redis_verify_failures"] == 0
    assert stats["locked_tokens"] == 0
    assert stats["resident_tokens"] <= STRESS_CAPACITY

    # What the threads left in Redis is exact too: a cold trie that restores every prompt's
    # chunks from it computes the same next-token logits as a run without any cache.
    assert tier.flush()
    cold = KVCacheTrie.for_model(model, capacity_tokens=100, spill=tiers(server.url, timeout_s=2.0))
    restored = 0
    for ids, want in zip(prompts, reference, strict=True):
        with cold.match(ids) as hit:
            restored += hit.length
            got = next_token_logits(model, ids, hit.to_hf_cache())
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL[dtype])
        cold.evict(100)
    assert restored == cold.stats()["spill_hit_tokens"] > 0
