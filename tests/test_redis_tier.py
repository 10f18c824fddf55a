"""RedisTier against real servers: shared across processes, exact, and harmless when Redis fails.

Every cached generation here is checked against a run without any cache (greedy tokens of the
float32 tiny llama are identical). Servers are real (tests/redis_server.py). Without a server the
tests skip, except in CI (KVBLOCKS_CI=1), where they fail.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import IdTokenizer, tiny_llama
from redis_server import LocalCluster, RedisServer, free_port, start_redis, started

import kvblocks
from kvblocks import CachedGenerator, KVCacheTrie
from kvblocks.cache.layout import KVLayout
from kvblocks.spill.records import NativeCodec, chain_hashes, encode_record
from kvblocks.spill.redis_tier import DEFAULT_TTL_S, RedisTier
from kvblocks.spill.sealing import Sealer

SEED = 0
CHUNK = 8
PROMPT_TOKENS = 80
NEW_TOKENS = 8
# Chunks a cold trie can take from Redis for an 80-token prompt: all complete chunks of the
# first 79 tokens (the last prompt token is always recomputed).
FULL_HIT = (PROMPT_TOKENS - 1) // CHUNK * CHUNK
FAST = dict(chunk_tokens=CHUNK, timeout_s=0.2, connect_timeout_s=0.2, retry_interval_s=0.2)
TESTS_DIR = Path(__file__).parent
TOKENIZER = IdTokenizer()


# ---- servers ---------------------------------------------------------------------------------


@pytest.fixture
def server(redis_server):
    return redis_server


@pytest.fixture
def tiers():
    """Makes RedisTiers with short timeouts; drains and closes them after the test."""
    made: list[RedisTier] = []

    def make(url: str, **overrides) -> RedisTier:
        tier = RedisTier(url, **(FAST | overrides))
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.flush(timeout_s=3)
        tier.close()


# ---- model, prompts, exactness ---------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=SEED)


def prompt(seed: int, n: int = PROMPT_TOKENS) -> str:
    return " ".join(str(t) for t in np.random.default_rng(seed).integers(0, 128, n))


def ids_of(text: str) -> list[int]:
    return TOKENIZER(text)["input_ids"]


# (id(model), text) -> (model, tokens); the model is kept so that its id is never reused.
_baselines: dict[tuple[int, str], tuple[object, list[int]]] = {}


def no_cache_tokens(model, text: str) -> list[int]:
    key = (id(model), text)
    if key not in _baselines:
        result = CachedGenerator(model, TOKENIZER, None).generate(text, max_new_tokens=NEW_TOKENS)
        _baselines[key] = (model, result.token_ids)
    return _baselines[key][1]


def trie(model, tier: RedisTier | None, capacity_tokens: int = 1000) -> KVCacheTrie:
    return KVCacheTrie.for_model(model, capacity_tokens=capacity_tokens, spill=tier)


def generate_exact(model, cache: KVCacheTrie, text: str, **kwargs):
    """Generate with `cache`; the greedy tokens must equal those of a run without any cache."""
    expected = no_cache_tokens(model, text)
    result = CachedGenerator(model, TOKENIZER, cache).generate(text, max_new_tokens=NEW_TOKENS, **kwargs)
    assert result.token_ids == expected
    return result


def prefill(model, text: str):
    """A transformers cache holding the KV of the whole prompt (for direct `insert` calls)."""
    with torch.inference_mode():
        return model(torch.tensor([ids_of(text)]), use_cache=True).past_key_values


def chunk_key(tier: RedisTier, cache: KVCacheTrie, text: str, k: int) -> str:
    ns = cache.namespace.key
    return tier.key(ns, tier.codec.chunk_hashes(ns, np.array(ids_of(text)), CHUNK)[k])


def redis_stats(cache: KVCacheTrie) -> dict[str, int]:
    return {k: v for k, v in cache.stats().items() if k.startswith(("redis_", "spill_"))}


# ---- sharing ---------------------------------------------------------------------------------


def test_redis_tier_is_public_as_kvblocks_RedisTier():
    assert kvblocks.RedisTier is RedisTier


PROCESS_B = """
import json, sys
import torch
from conftest import IdTokenizer, tiny_llama
from kvblocks import CachedGenerator, KVCacheTrie
from kvblocks.spill.redis_tier import RedisTier

args = json.loads(sys.argv[1])
runs = []
for dtype in args["dtypes"]:
    model = tiny_llama(getattr(torch, dtype), seed=args["seed"])
    tier = RedisTier(args["url"], **args["tier"])
    cache = KVCacheTrie.for_model(model, capacity_tokens=1000, spill=tier)
    gen = CachedGenerator(model, IdTokenizer(), cache)
    cached = gen.generate(args["prompt"], max_new_tokens=args["new_tokens"])
    plain = CachedGenerator(model, IdTokenizer(), None).generate(args["prompt"], max_new_tokens=args["new_tokens"])
    tier.close()
    runs.append(dict(dtype=dtype, tokens=cached.token_ids, no_cache_tokens=plain.token_ids,
                     cached_tokens=cached.cached_tokens, stats=cache.stats()))
print(json.dumps(runs))
"""


@pytest.fixture(scope="module")
def process_b(model, tmp_path_factory):
    """This process caches a prompt; a fresh OS process then runs it in float32 and float64."""
    srv = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        text = prompt(1)
        tier = RedisTier(srv.url, **FAST)
        cache = trie(model, tier)
        generate_exact(model, cache, text)
        assert tier.flush()
        written = cache.stats()["redis_written_chunks"]
        tier.close()
        args = dict(url=srv.url, seed=SEED, dtypes=["float32", "float64"], prompt=text)
        args |= dict(new_tokens=NEW_TOKENS, tier=FAST)
        env = os.environ | {"PYTHONPATH": str(TESTS_DIR), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            [sys.executable, "-c", PROCESS_B, json.dumps(args)],
            cwd=TESTS_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs = {run["dtype"]: run for run in json.loads(proc.stdout.strip().splitlines()[-1])}
        return text, written, runs
    finally:
        srv.stop()


def test_second_process_with_an_empty_pool_hits_redis_and_matches_no_cache(model, process_b):
    text, written, runs = process_b
    run = runs["float32"]
    assert written == (PROMPT_TOKENS + NEW_TOKENS - 1) // CHUNK
    assert run["cached_tokens"] == FULL_HIT
    assert run["stats"]["spill_hit_tokens"] == FULL_HIT
    assert run["stats"]["redis_verify_failures"] == 0
    assert run["tokens"] == run["no_cache_tokens"] == no_cache_tokens(model, text)


def test_process_with_another_dtype_never_uses_the_records(process_b):
    run = process_b[2]["float64"]
    assert run["cached_tokens"] == 0
    assert run["stats"]["redis_hit_chunks"] == 0
    assert run["stats"]["redis_verify_failures"] == 0
    assert run["tokens"] == run["no_cache_tokens"]


def test_records_of_other_weights_or_another_salt_are_never_used(model, server, tiers):
    text = prompt(2)
    a = trie(model, tiers(server.url))
    generate_exact(model, a, text)
    generate_exact(model, a, text, salt="tenant-a")
    assert a.spill.flush()

    other_weights = tiny_llama(seed=SEED + 1)
    b = trie(other_weights, tiers(server.url))
    assert generate_exact(other_weights, b, text).cached_tokens == 0
    assert redis_stats(b)["redis_hit_chunks"] == redis_stats(b)["redis_verify_failures"] == 0

    c = trie(model, tiers(server.url))
    assert generate_exact(model, c, text, salt="tenant-b").cached_tokens == 0
    assert generate_exact(model, c, text, salt="tenant-a").cached_tokens == FULL_HIT
    assert redis_stats(c)["redis_verify_failures"] == 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    nodes = started(LocalCluster(3, tmp_path_factory.mktemp("cluster")))
    yield nodes
    nodes.stop()


def test_cluster_shares_chunks_between_tries_and_output_matches_no_cache(model, cluster, tiers):
    texts = [prompt(3), prompt(4)]
    a = trie(model, tiers(cluster.url))
    for text in texts:
        generate_exact(model, a, text)
    assert a.spill.flush()
    written = redis_stats(a)["redis_written_chunks"]
    per_node = [node.client().dbsize() for node in cluster.nodes]
    assert sum(per_node) == written == 2 * ((PROMPT_TOKENS + NEW_TOKENS - 1) // CHUNK)
    assert sum(n > 0 for n in per_node) >= 2

    plain_url = cluster.url.replace("redis+cluster://", "redis://")
    b = trie(model, tiers(plain_url, cluster=True))
    for text in texts:
        assert generate_exact(model, b, text).cached_tokens == FULL_HIT
    assert redis_stats(b)["redis_errors"] == 0


def test_cluster_with_a_node_down_gives_misses_not_errors(model, cluster, tiers):
    a = trie(model, tiers(cluster.url))
    generate_exact(model, a, prompt(5))
    assert a.spill.flush()
    cluster.nodes[1].stop()
    b = trie(model, tiers(cluster.url))
    generate_exact(model, b, prompt(5))
    generate_exact(model, a, prompt(6))
    assert a.spill.flush() and b.spill.flush()
    assert redis_stats(b)["redis_errors"] >= 1


def test_unreachable_cluster_is_a_miss_not_an_error(model, tiers):
    """redis-py raises RedisClusterException, not a RedisError, when no startup node answers."""
    cache = trie(model, tiers(f"redis+cluster://127.0.0.1:{free_port()}"))
    assert generate_exact(model, cache, prompt(7)).cached_tokens == 0
    assert cache.spill.flush()
    assert redis_stats(cache)["redis_errors"] >= 1


def test_ttl_s_puts_an_expiry_on_every_written_key_and_defaults_to_a_day(model, tmp_path, tiers):
    srv = start_redis(tmp_path / "redis", unix_socket=True)
    try:
        client = srv.client()
        with_ttl = trie(model, tiers(srv.url, ttl_s=30))
        generate_exact(model, with_ttl, prompt(6))
        assert with_ttl.spill.flush()
        keys = client.keys("*")
        assert len(keys) == redis_stats(with_ttl)["redis_written_chunks"] > 0
        assert all(0 < client.pttl(k) <= 30_000 for k in keys)

        client.flushall()
        default = trie(model, tiers(srv.url))
        generate_exact(model, default, prompt(6))
        assert default.spill.flush()
        assert all(0 < client.pttl(k) <= DEFAULT_TTL_S * 1000 for k in client.keys("*"))

        client.flushall()
        without = trie(model, tiers(srv.url, ttl_s=None))
        generate_exact(model, without, prompt(6))
        assert without.spill.flush()
        assert [client.pttl(k) for k in client.keys("*")] == [-1] * redis_stats(without)[
            "redis_written_chunks"
        ]
    finally:
        srv.stop()


# ---- write modes and the queue ---------------------------------------------------------------


def test_write_back_writes_chunks_only_when_the_pool_evicts_them(model, server, tiers):
    client = server.client()
    first, second, third = prompt(7), prompt(8), prompt(9)
    a = trie(model, tiers(server.url, write_mode="back"), capacity_tokens=100)
    generate_exact(model, a, first)
    assert a.spill.flush()
    assert redis_stats(a)["redis_written_chunks"] == 0
    assert client.dbsize() == 0

    generate_exact(model, a, second)  # evicts most of `first`
    generate_exact(model, a, third)  # evicts the rest of it
    assert a.spill.flush()
    assert a.stats()["evicted_tokens"] >= PROMPT_TOKENS + NEW_TOKENS
    assert a.cached_length(ids_of(first)) == 0
    assert redis_stats(a)["redis_written_chunks"] > 0
    assert client.exists(*(chunk_key(a.spill, a, first, k) for k in range(PROMPT_TOKENS // CHUNK))) == 10

    b = trie(model, tiers(server.url))
    assert generate_exact(model, b, first).cached_tokens == FULL_HIT
    assert generate_exact(model, a, first).cached_tokens == FULL_HIT


def test_full_write_queue_drops_writes_and_never_blocks_inserts(model, server, tiers):
    texts = [prompt(10 + i) for i in range(5)]
    pasts = [prefill(model, t) for t in texts]
    tier = tiers(server.url, queue_size=1, timeout_s=1.0)
    cache = trie(model, tier)
    server.pause()
    try:
        t0 = time.monotonic()
        for text, past in zip(texts, pasts):
            assert cache.insert(ids_of(text), past) == PROMPT_TOKENS
        assert time.monotonic() - t0 < 0.5  # the writer is stuck for 1 s on its first job
        assert redis_stats(cache)["redis_write_drops"] >= 3
        t0 = time.monotonic()
        generate_exact(model, cache, prompt(15))
        assert time.monotonic() - t0 < 1.0 + 1.0
    finally:
        server.resume()
    assert tier.flush()
    for text in texts:
        assert generate_exact(model, cache, text).cached_tokens == PROMPT_TOKENS - 1


# ---- faults ----------------------------------------------------------------------------------


def test_redis_absent_at_start_gives_misses_then_is_used_once_it_is_up(model, tmp_path, tiers):
    srv = RedisServer(tmp_path / "redis", port=free_port())
    a = trie(model, tiers(srv.url))
    for seed in (20, 21):
        assert generate_exact(model, a, prompt(seed)).cached_tokens == 0
    assert a.spill.flush()
    stats = redis_stats(a)
    assert stats["redis_errors"] >= 1
    assert stats["redis_hit_chunks"] == stats["redis_written_chunks"] == 0

    started(srv)
    try:
        time.sleep(FAST["retry_interval_s"] + 0.05)
        generate_exact(model, a, prompt(22))
        assert a.spill.flush()
        assert redis_stats(a)["redis_written_chunks"] > 0
        b = trie(model, tiers(srv.url))
        assert generate_exact(model, b, prompt(22)).cached_tokens == FULL_HIT
    finally:
        srv.stop()


def test_redis_killed_between_requests_gives_misses_not_errors(model, server, tiers):
    a = trie(model, tiers(server.url))
    generate_exact(model, a, prompt(23))
    assert a.spill.flush()
    server.stop()

    generate_exact(model, a, prompt(24))
    b = trie(model, tiers(server.url))
    assert generate_exact(model, b, prompt(23)).cached_tokens == 0
    assert a.spill.flush() and b.spill.flush()
    assert redis_stats(a)["redis_errors"] >= 1
    assert redis_stats(b)["redis_errors"] >= 1


def test_redis_killed_with_writes_queued_holds_those_writes_for_a_retry(model, server, tiers):
    texts = [prompt(25 + i) for i in range(3)]
    pasts = [prefill(model, t) for t in texts]
    tier = tiers(server.url, timeout_s=1.0)
    cache = trie(model, tier)
    server.pause()
    for text, past in zip(texts, pasts):
        cache.insert(ids_of(text), past)
    assert redis_stats(cache)["redis_queue_depth"] >= 1
    server.kill()

    assert tier.flush(timeout_s=5)
    stats = redis_stats(cache)
    assert stats["redis_written_chunks"] == 0
    assert stats["redis_write_errors"] >= 1
    assert stats["redis_held_writes"] == stats["redis_write_jobs"] == 3  # retried once Redis is back
    assert generate_exact(model, cache, texts[0]).cached_tokens == PROMPT_TOKENS - 1
    generate_exact(model, cache, prompt(28))


def test_hung_redis_delays_a_request_by_at_most_the_timeout(model, server, tiers):
    timeout_s = FAST["timeout_s"]
    a = trie(model, tiers(server.url))
    texts = [prompt(30), prompt(31)]
    for text in texts:
        no_cache_tokens(model, text)
    server.pause()
    try:
        for text in texts:
            t0 = time.monotonic()
            assert generate_exact(model, a, text).cached_tokens == 0
            assert time.monotonic() - t0 < timeout_s + 1.0
        assert redis_stats(a)["redis_errors"] >= 1
    finally:
        server.resume()

    time.sleep(FAST["retry_interval_s"] + 0.05)
    generate_exact(model, a, prompt(32))
    assert a.spill.flush()
    assert redis_stats(a)["redis_written_chunks"] > 0
    b = trie(model, tiers(server.url))
    assert generate_exact(model, b, prompt(32)).cached_tokens == FULL_HIT


def test_restarted_redis_is_used_again_after_retry_interval(model, server, tiers):
    a, b = trie(model, tiers(server.url)), trie(model, tiers(server.url))
    generate_exact(model, a, prompt(33))
    assert a.spill.flush()
    assert generate_exact(model, b, prompt(33)).cached_tokens == FULL_HIT

    server.stop()
    generate_exact(model, a, prompt(34))
    assert a.spill.flush()
    errors = redis_stats(a)["redis_errors"]
    assert errors >= 1
    server.start()

    time.sleep(FAST["retry_interval_s"] + 0.05)
    written = redis_stats(a)["redis_written_chunks"]
    generate_exact(model, a, prompt(35))
    assert a.spill.flush()
    assert redis_stats(a)["redis_written_chunks"] > written
    assert generate_exact(model, b, prompt(35)).cached_tokens == FULL_HIT


def test_full_redis_with_lru_eviction_keeps_output_exact(model, server, tiers):
    client = server.client()
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.config_set("maxmemory", client.info("memory")["used_memory"] + 300_000)
    texts = [prompt(40 + i) for i in range(8)]
    a = trie(model, tiers(server.url))
    for text in texts:
        generate_exact(model, a, text)
        assert a.spill.flush()
    assert client.info("stats")["evicted_keys"] > 0
    assert client.dbsize() < redis_stats(a)["redis_written_chunks"]
    # Redis's LRU clock ticks once a second, so keys written within the same second are evicted
    # in no particular order. A prompt written a tick later is the newest and must survive whole.
    time.sleep(1.1)
    fresh = prompt(48)
    generate_exact(model, a, fresh)
    assert a.spill.flush()

    b = trie(model, tiers(server.url))
    assert generate_exact(model, b, fresh).cached_tokens == FULL_HIT
    for text in reversed(texts):
        generate_exact(model, b, text)
    assert redis_stats(a)["redis_errors"] == redis_stats(b)["redis_errors"] == 0


def test_full_redis_with_noeviction_counts_write_errors_and_requests_succeed(model, server, tiers):
    client = server.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)
    a = trie(model, tiers(server.url))
    generate_exact(model, a, prompt(50))
    assert a.spill.flush()
    stats = redis_stats(a)
    assert stats["redis_write_errors"] >= 1
    assert stats["redis_written_chunks"] == 0
    assert client.dbsize() == 0
    b = trie(model, tiers(server.url))
    assert generate_exact(model, b, prompt(50)).cached_tokens == 0


# ---- damaged and foreign values --------------------------------------------------------------

DAMAGED_CHUNK = 3
LAYOUT = KVLayout.from_shapes(torch.float32, ((2, 16), (2, 16)))  # tiny_llama: 2 layers, 2 KV heads of 16


def foreign_record(
    namespace: str, tokens: list[int], dtype: torch.dtype = torch.float32, *, key: str, secret: bytes | None
) -> bytes:
    """A well-formed record with random KV, sealed with `secret` if given: harmless only if
    verification refuses it."""
    layout = KVLayout.from_shapes(dtype, LAYOUT.shapes)
    kv = [torch.randn(len(tokens), 2, h, d).to(dtype) for h, d in layout.shapes]
    return encode_record(namespace, np.array(tokens), layout, kv, key=key, sealer=sealer_of(secret))


def sealer_of(secret: bytes | None) -> Sealer | None:
    return None if secret is None else Sealer(secret)


def damage(
    kind: str, value: bytes, later_value: bytes, namespace: str, tokens: list[int], key: str, secret
) -> bytes:
    if kind == "truncated":
        return value[: len(value) // 2]
    if kind == "flipped-payload-byte":
        return value[:-5] + bytes([value[-5] ^ 0x01]) + value[-4:]
    if kind == "flipped-header-byte":
        return value[:20] + bytes([value[20] ^ 0x01]) + value[21:]
    if kind == "garbage":
        return b"\x00garbage\xff" * 10
    if kind == "empty":
        return b""
    if kind == "record-of-the-next-chunk":
        return later_value
    if kind == "record-of-another-namespace":
        return foreign_record("another-namespace", tokens, key=key, secret=secret)
    if kind == "record-of-other-tokens":
        return foreign_record(namespace, [(t + 1) % 128 for t in tokens], key=key, secret=secret)
    if kind == "record-of-another-dtype":
        return foreign_record(namespace, tokens, torch.float64, key=key, secret=secret)
    if kind == "record-for-another-key":
        return foreign_record(namespace, tokens, key=key + "-elsewhere", secret=secret)
    raise AssertionError(kind)


DAMAGE = [
    "truncated",
    "flipped-payload-byte",
    "flipped-header-byte",
    "garbage",
    "empty",
    "record-of-the-next-chunk",
    "record-of-another-namespace",
    "record-of-other-tokens",
    "record-of-another-dtype",
    "record-for-another-key",
]
SECRET = b"test-deployment-secret-0123456789"
OTHER_SECRET = b"another-deployment-secret-987654"
SECRETS = [pytest.param(None, id="plain"), pytest.param(SECRET, id="sealed")]


@pytest.mark.parametrize("secret", SECRETS)
@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_or_foreign_value_is_a_miss_not_an_error(model, server, tiers, kind, secret):
    client = server.client()
    text = prompt(60)
    a = trie(model, tiers(server.url, secret=secret))
    generate_exact(model, a, text)
    assert a.spill.flush()
    key = chunk_key(a.spill, a, text, DAMAGED_CHUNK)
    later = client.get(chunk_key(a.spill, a, text, DAMAGED_CHUNK + 1))
    tokens = ids_of(text)[DAMAGED_CHUNK * CHUNK : (DAMAGED_CHUNK + 1) * CHUNK]
    client.set(key, damage(kind, client.get(key), later, a.namespace.key, tokens, key, secret))

    b = trie(model, tiers(server.url, secret=secret))
    assert generate_exact(model, b, text).cached_tokens == DAMAGED_CHUNK * CHUNK
    stats = redis_stats(b)
    refused = stats["redis_verify_failures"] + stats["redis_rejected_size"]
    assert refused == (0 if kind == "empty" else 1)  # an empty string reads as an absent record
    assert stats["redis_errors"] == 0


def test_damaged_value_is_rewritten_by_the_next_trie_that_computes_it(model, server, tiers):
    client = server.client()
    text = prompt(61)
    a = trie(model, tiers(server.url))
    generate_exact(model, a, text)
    assert a.spill.flush()
    key = chunk_key(a.spill, a, text, DAMAGED_CHUNK)
    client.set(key, client.get(key)[:-1])

    b = trie(model, tiers(server.url))
    assert generate_exact(model, b, text).cached_tokens == DAMAGED_CHUNK * CHUNK
    assert b.spill.flush()
    assert redis_stats(b)["redis_deleted_invalid"] == 1
    c = trie(model, tiers(server.url))
    assert generate_exact(model, c, text).cached_tokens == FULL_HIT
    assert redis_stats(c)["redis_verify_failures"] == 0


# ---- a run of chunks cut short by one that fails verification ----------------------------------

RUN_NS = "run-namespace"
RUN_CHUNKS = 5
RUN_LAYOUT = KVLayout.from_shapes(torch.float32, ((2, 16), (0, 0), (1, 8)))  # layer 1 caches nothing


def write_run(server, tier: RedisTier, secret, bad: str | None = None, k: int = -1):
    """Writes RUN_CHUNKS records of random KV for RUN_NS, chunk k spoiled as `bad` says; returns
    the token ids and the KV of the whole run as written before spoiling."""
    tier.bind(RUN_LAYOUT, torch.device("cpu"), lambda *args: None, RUN_NS)
    ids = np.arange(1000, 1000 + RUN_CHUNKS * CHUNK)
    g = torch.Generator().manual_seed(11)
    kv = [None if h == 0 else torch.randn(len(ids), 2, h, d, generator=g) for h, d in RUN_LAYOUT.shapes]
    client = server.client()
    for i, h in enumerate(tier.codec.chunk_hashes(RUN_NS, ids, CHUNK)):
        key, rows = tier.key(RUN_NS, h), slice(i * CHUNK, (i + 1) * CHUNK)
        part = [None if t is None else t[rows].clone() for t in kv]
        if i == k and bad == "non-finite":
            part[2][CHUNK // 2, 1, 0, 3] = float("nan")
        bound_to = key + "-elsewhere" if i == k and bad == "record-for-another-key" else key
        value = encode_record(RUN_NS, ids[rows], RUN_LAYOUT, part, key=bound_to, sealer=sealer_of(secret))
        if i == k and bad == "flipped-last-byte":  # plain: the checksummed payload; sealed: the tag
            value = value[:-1] + bytes([value[-1] ^ 0x01])
        client.set(key, value)
    return ids, kv


def storage_bytes(t: torch.Tensor) -> bytes:
    """Every byte of the buffer behind `t`, those outside its view included."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy().tobytes()


@pytest.mark.parametrize("secret", SECRETS)
def test_fetched_run_is_bit_exact_and_layers_without_kv_stay_empty(server, tiers, secret):
    tier = tiers(server.url, secret=secret)
    ids, kv = write_run(server, tier, secret)
    fetched = tier.fetch(RUN_NS, ids, CHUNK + 3, len(ids))
    assert (fetched.start, fetched.length) == (CHUNK, (RUN_CHUNKS - 1) * CHUNK)
    for got, want in zip(fetched.kv, kv, strict=True):
        assert (got is None and want is None) or torch.equal(got, want[CHUNK:])
    assert tier.stats()["redis_hit_chunks"] == RUN_CHUNKS - 1


@pytest.mark.parametrize("secret", SECRETS)
@pytest.mark.parametrize("bad", ["flipped-last-byte", "non-finite", "record-for-another-key"])
@pytest.mark.parametrize("k", [0, 2, RUN_CHUNKS - 1])
def test_chunk_failing_verification_ends_the_run_and_none_of_its_kv_is_kept(server, tiers, secret, bad, k):
    """Chunks decode into their rows before their tag or finiteness is checked: a failure keeps
    the chunks before it and leaves no byte of the failed chunk's KV in any returned buffer."""
    tier = tiers(server.url, secret=secret)
    ids, kv = write_run(server, tier, secret, bad, k)
    fetched = tier.fetch(RUN_NS, ids, 0, len(ids))
    stats = tier.stats()
    assert stats["redis_verify_failures"] + stats["redis_rejected_size"] == 1  # a longer key: another size
    assert stats["redis_hit_chunks"] == k
    if k == 0:
        assert fetched is None
        return
    assert (fetched.start, fetched.length) == (0, k * CHUNK)
    for got, want in zip(fetched.kv, kv, strict=True):
        if want is None:
            assert got is None
            continue
        assert torch.equal(got, want[: k * CHUNK])
        held = storage_bytes(got)
        assert not any(row.numpy().tobytes() in held for row in want[k * CHUNK : (k + 1) * CHUNK])


# ---- trust: authenticated, confidential records ------------------------------------------------


def attacker_record(model, victim_text: str, attacker_text: str, k: int, namespace: str, key: str) -> bytes:
    """The attack of issue 10: the real KV of the attacker's prompt, framed as a plain record of
    the victim's chunk k (victim's ids, namespace and key, a correct xxh3 checksum)."""
    past = prefill(model, attacker_text)
    part = slice(k * CHUNK, (k + 1) * CHUNK)
    kv = [  # [1, H, T, D] keys and values -> [T, 2, H, D]
        torch.stack((layer.keys[0], layer.values[0]), dim=0).permute(2, 0, 1, 3)[part].contiguous()
        for layer in past.layers
    ]
    tokens = np.array(ids_of(victim_text)[k * CHUNK : (k + 1) * CHUNK])
    return encode_record(namespace, tokens, LAYOUT, kv, key=key)


def test_without_a_secret_a_redis_writer_is_trusted(model, server, tiers):
    """The limit SECURITY.md states: a plain tier believes any well-formed record."""
    client = server.client()
    victim, attacker = prompt(70), prompt(71)
    a = trie(model, tiers(server.url))
    generate_exact(model, a, victim)
    assert a.spill.flush()
    for k in range(FULL_HIT // CHUNK):
        key = chunk_key(a.spill, a, victim, k)
        client.set(key, attacker_record(model, victim, attacker, k, a.namespace.key, key))
    b = trie(model, tiers(server.url))
    result = CachedGenerator(model, TOKENIZER, b).generate(victim, max_new_tokens=NEW_TOKENS)
    assert result.cached_tokens == FULL_HIT
    assert redis_stats(b)["redis_verify_failures"] == 0


def test_forged_record_with_a_valid_checksum_under_the_victims_key_is_a_miss_with_a_secret(
    model, server, tiers
):
    client = server.client()
    victim, attacker = prompt(70), prompt(71)
    a = trie(model, tiers(server.url, secret=SECRET))
    generate_exact(model, a, victim)
    generate_exact(model, a, attacker)
    assert a.spill.flush()
    # The attacker writes to Redis and even knows the victim's keys: a plain record with the
    # attacker's real KV and a valid checksum, and a swap of the attacker's own sealed records.
    for k in range(FULL_HIT // CHUNK):
        key = chunk_key(a.spill, a, victim, k)
        forged = attacker_record(model, victim, attacker, k, a.namespace.key, key)
        client.set(key, forged if k % 2 == 0 else client.get(chunk_key(a.spill, a, attacker, k)))
    b = trie(model, tiers(server.url, secret=SECRET))
    assert generate_exact(model, b, victim).cached_tokens == 0
    stats = redis_stats(b)
    assert stats["redis_verify_failures"] + stats["redis_rejected_size"] == 1  # a plain record: another size
    assert stats["redis_errors"] == stats["redis_hit_chunks"] == 0
    assert b.spill.flush()
    assert redis_stats(b)["redis_deleted_invalid"] == 1


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("secret", SECRETS)
def test_non_finite_record_is_a_miss_never_an_error(model, server, tiers, secret, value):
    client = server.client()
    text = prompt(72)
    a = trie(model, tiers(server.url, secret=secret))
    generate_exact(model, a, text)
    assert a.spill.flush()
    key = chunk_key(a.spill, a, text, 0)
    kv = [torch.full((CHUNK, 2, h, d), value) for h, d in LAYOUT.shapes]
    poisoned = encode_record(
        a.namespace.key, np.array(ids_of(text)[:CHUNK]), LAYOUT, kv, key=key, sealer=sealer_of(secret)
    )
    client.set(key, poisoned)
    b = trie(model, tiers(server.url, secret=secret))
    assert generate_exact(model, b, text).cached_tokens == 0
    assert redis_stats(b)["redis_verify_failures"] == 1
    assert b.spill.flush()

    client.set(key, poisoned)  # sampling must not fail either ("probability tensor contains nan")
    c = trie(model, tiers(server.url, secret=secret))
    sampled = CachedGenerator(model, TOKENIZER, c).generate(
        text, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=3
    )
    assert sampled.cached_tokens == 0
    assert len(sampled.token_ids) == NEW_TOKENS
    assert redis_stats(c)["redis_verify_failures"] == 1


def test_sealed_tier_keeps_token_ids_and_namespaces_out_of_redis(model, server, tiers):
    client = server.client()
    text = prompt(73)
    a = trie(model, tiers(server.url, secret=SECRET))
    generate_exact(model, a, text)
    assert a.spill.flush()
    ids = np.array(ids_of(text), dtype="<i4")
    ns = a.namespace.key
    keys = client.keys("*")
    assert len(keys) == redis_stats(a)["redis_written_chunks"] > 0
    for key in keys:
        value = client.get(key)
        assert ns.encode() not in key and ns.encode() not in value
        for k in range(len(ids) // CHUNK):
            assert ids[k * CHUNK : (k + 1) * CHUNK].tobytes() not in value
    # Nobody without the secret can name a prompt's record: the unkeyed key of every chunk, or
    # the key under another secret, is absent.
    for codec in (NativeCodec(), NativeCodec(sealer=Sealer(OTHER_SECRET))):
        names = [codec.key(ns, h) for h in codec.chunk_hashes(ns, ids, CHUNK)]
        assert client.exists(*names) == 0
    assert all(h not in str(keys) for h in chain_hashes(ns, ids, CHUNK))


def test_same_secret_shares_and_a_different_or_no_secret_never_does(model, server, tiers):
    text = prompt(74)
    a = trie(model, tiers(server.url, secret=SECRET))
    generate_exact(model, a, text)
    assert a.spill.flush()
    same = trie(model, tiers(server.url, secret=SECRET))
    assert generate_exact(model, same, text).cached_tokens == FULL_HIT
    for secret in (OTHER_SECRET, None):
        other = trie(model, tiers(server.url, secret=secret))
        assert generate_exact(model, other, text).cached_tokens == 0
        stats = redis_stats(other)
        assert stats["redis_hit_chunks"] == stats["redis_verify_failures"] == 0


def test_a_secret_cannot_be_combined_with_another_codec_or_be_short():
    with pytest.raises(ValueError, match="another codec"):
        RedisTier("redis://127.0.0.1:1/0", secret=SECRET, codec=NativeCodec())
    with pytest.raises(ValueError, match="at least 16 bytes"):
        RedisTier("redis://127.0.0.1:1/0", secret=b"short")


def test_no_maxmemory_is_reported_as_a_deployment_warning(server, tiers):
    tier = tiers(server.url)
    server.client().config_set("maxmemory", 0)
    assert any("no maxmemory" in w for w in tier.server_warnings())
    server.client().config_set("maxmemory", 64 << 20)
    assert tier.server_warnings() == []


def test_a_fine_tune_that_changed_one_weight_never_reuses_the_base_models_records(model, server, tiers):
    text = prompt(75)
    base = trie(model, tiers(server.url))
    generate_exact(model, base, text)
    assert base.spill.flush()
    tuned = copy.deepcopy(model)
    with torch.no_grad():  # where the old 4,096-element weight sample never looked
        tuned.model.layers[1].self_attn.v_proj.weight.view(-1)[-1] += 0.5
    cache = trie(tuned, tiers(server.url))
    assert cache.namespace.key != base.namespace.key
    assert generate_exact(tuned, cache, text).cached_tokens == 0
    assert redis_stats(cache)["redis_hit_chunks"] == 0


# ---- untrusted values: bounded, typed, deleted -------------------------------------------------


def run_key(tier: RedisTier, ids: np.ndarray, k: int) -> str:
    return tier.key(RUN_NS, tier.codec.chunk_hashes(RUN_NS, ids, CHUNK)[k])


def test_oversized_value_under_a_lookup_key_is_refused_unread_and_deleted(server, tiers):
    """Issue 21's value: 64 MiB ending in an intact bin header of a record's payload size. Only
    STRLEN touches it: the lookup allocates far less than the value and deletes it."""
    import tracemalloc

    tier = tiers(server.url)
    ids, _ = write_run(server, tier, None)
    client, key = server.client(), run_key(tier, ids, 2)
    payload = CHUNK * RUN_LAYOUT.token_bytes()
    client.set(key, b"\x81" + bytes(64 << 20) + b"\xc6" + payload.to_bytes(4, "big") + bytes(payload))
    tracemalloc.start()
    try:
        fetched = tier.fetch(RUN_NS, ids, 0, len(ids))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (fetched.start, fetched.length) == (0, 2 * CHUNK)
    assert peak < 4 << 20
    stats = tier.stats()
    assert stats["redis_rejected_size"] == 1 and stats["redis_errors"] == 0
    assert stats["redis_read_bytes"] < 3 * payload
    assert tier.flush() and not client.exists(key)
    assert tier.stats()["redis_deleted_invalid"] == 1


@pytest.mark.parametrize("secret", SECRETS)
def test_wrong_type_key_is_that_keys_miss_and_deleted_never_an_outage(server, tiers, secret):
    tier = tiers(server.url, secret=secret)
    ids, _ = write_run(server, tier, secret)
    client, key = server.client(), run_key(tier, ids, 2)
    client.delete(key)
    client.rpush(key, b"a", b"b")
    fetched = tier.fetch(RUN_NS, ids, 0, len(ids))
    assert (fetched.start, fetched.length) == (0, 2 * CHUNK)
    stats = tier.stats()
    assert stats["redis_rejected_type"] == 1
    assert stats["redis_errors"] == stats["redis_skipped_while_down"] == 0
    assert tier.flush() and not client.exists(key)
    assert tier.fetch(RUN_NS, ids, 3 * CHUNK, len(ids)).length == 2 * CHUNK  # not marked down
    assert tier.stats()["redis_skipped_while_down"] == 0


def huge_msgpack_headers():
    from hypothesis import strategies as st

    heads = st.sampled_from([b"\xdb", b"\xc6", b"\xdd", b"\xdf", b"\x81\xa2kv\xc6"])
    return st.tuples(heads, st.binary(min_size=4, max_size=4), st.binary(max_size=64)).map(b"".join)


@pytest.mark.parametrize("secret", SECRETS)
def test_any_bytes_under_a_lookup_key_are_a_miss_and_the_key_is_deleted(server, tiers, secret):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    tier = tiers(server.url, secret=secret)
    ids, _ = write_run(server, tier, secret)
    client, key = server.client(), run_key(tier, ids, 0)
    low, high = tier.codec.size_bounds(key, RUN_NS, CHUNK, RUN_LAYOUT)
    good = client.get(key)
    record_sized = st.integers(low, high).flatmap(lambda n: st.binary(min_size=n, max_size=n))
    flipped = st.tuples(st.integers(0, len(good) - 1), st.integers(1, 255)).map(
        lambda f: good[: f[0]] + bytes([good[f[0]] ^ f[1]]) + good[f[0] + 1 :]
    )

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(st.binary(max_size=4000), huge_msgpack_headers(), record_sized, flipped))
    def check(raw: bytes):
        client.set(key, raw)
        assert tier.fetch(RUN_NS, ids, 0, len(ids)) is None
        assert tier.flush()
        assert not client.exists(key) or raw == b""  # an empty string is an absent record
        assert tier.stats()["redis_errors"] == 0

    check()


def test_stopped_redis_makes_a_lookup_a_miss_within_the_fetch_timeout(server, tiers):
    fetch_timeout_s = 0.15
    tier = tiers(server.url, fetch_timeout_s=fetch_timeout_s, timeout_s=2.0)
    ids, _ = write_run(server, tier, None)
    server.pause()
    try:
        t0 = time.monotonic()
        assert tier.fetch(RUN_NS, ids, 0, len(ids)) is None
        assert time.monotonic() - t0 < fetch_timeout_s + 0.3
        assert tier.stats()["redis_errors"] == 1
    finally:
        server.resume()
    time.sleep(FAST["retry_interval_s"] + 0.05)
    assert tier.fetch(RUN_NS, ids, 0, len(ids)).length == RUN_CHUNKS * CHUNK


# ---- the shared tier repairs itself ------------------------------------------------------------


def wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_after_flushall_a_device_hit_rewrites_the_chunks_and_another_trie_restores_them(model, server, tiers):
    text = prompt(90)
    a = trie(model, tiers(server.url, recheck_interval_s=0.0))
    generate_exact(model, a, text)
    assert a.spill.flush()
    server.client().flushall()

    assert generate_exact(model, a, text).cached_tokens == PROMPT_TOKENS - 1  # a device hit
    assert a.spill.flush()
    assert redis_stats(a)["redis_repair_jobs"] >= 1
    b = trie(model, tiers(server.url))
    assert generate_exact(model, b, text).cached_tokens == FULL_HIT


def test_device_hits_check_redis_at_most_once_per_recheck_interval(model, server, tiers):
    text = prompt(91)
    a = trie(model, tiers(server.url, recheck_interval_s=60.0))
    generate_exact(model, a, text)
    assert a.spill.flush()
    jobs = redis_stats(a)["redis_write_jobs"]
    for _ in range(3):
        generate_exact(model, a, text)
    assert a.spill.flush()
    stats = redis_stats(a)
    assert stats["redis_repair_jobs"] == 0
    assert stats["redis_write_jobs"] == jobs  # and no other job: nothing new to write


def test_writes_that_meet_a_stopped_redis_are_retried_after_it_restarts(model, server, tiers):
    text = prompt(92)
    a = trie(model, tiers(server.url))
    server.stop()
    generate_exact(model, a, text)
    assert a.spill.flush()
    assert redis_stats(a)["redis_held_writes"] >= 1
    server.start()

    assert wait_for(lambda: redis_stats(a)["redis_written_chunks"] > 0)
    stats = redis_stats(a)
    assert stats["redis_write_deferred"] >= 1 and stats["redis_write_retried"] >= 1
    b = trie(model, tiers(server.url))
    assert generate_exact(model, b, text).cached_tokens == FULL_HIT


def test_writes_held_past_retry_size_drop_the_oldest(model, server, tiers):
    texts = [prompt(93 + i) for i in range(4)]
    pasts = [prefill(model, t) for t in texts]
    a = trie(model, tiers(server.url, retry_size=2))
    server.stop()
    for text, past in zip(texts, pasts):
        a.insert(ids_of(text), past)
    assert a.spill.flush()
    stats = redis_stats(a)
    assert stats["redis_held_writes"] == 2 and stats["redis_write_drops"] == 2
    server.start()

    assert wait_for(
        lambda: redis_stats(a)["redis_held_writes"] == 0 and redis_stats(a)["redis_written_chunks"] > 0
    )
    b = trie(model, tiers(server.url))
    assert [generate_exact(model, b, t).cached_tokens for t in texts] == [0, 0, FULL_HIT, FULL_HIT]
