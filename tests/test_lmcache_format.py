"""LMCache's Redis format: keys, hashes and bytes equal what a real LMCache server wrote.

The constants below were recorded from lmcache 0.5.6 (`lmcache server --chunk-size 16` with a
Redis L2, KV stored through LMCache's own vLLM worker client, `LMCacheMPWorkerAdapter`, with a
`[2, blocks, 4, 2, 4]` paged cache per layer). The KV of each run is `formula_kv`, so a test can
rebuild it and compare kvblocks' encoding with LMCache's bytes (length, sha256, first bytes).
The end-to-end check against a live server is scripts/lmcache-interop (docs/LMCACHE.md).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from conftest import IdTokenizer, tiny_llama

from kvblocks import CachedGenerator, KVCacheTrie
from kvblocks.adapters.lmcache import (
    NONE_HASH,
    LMCacheCodec,
    LMCacheRedisTier,
    chunk_hashes,
    from_lmcache,
    kv_rank,
    object_key,
    to_lmcache,
)
from kvblocks.cache.layout import KVLayout
from kvblocks.spill.records import VerificationError

CHUNK = 16
LAYERS, HEADS, DIM = 2, 2, 4
LAYOUT32 = KVLayout.from_shapes(torch.float32, ((HEADS, DIM),) * LAYERS)

# ---- recorded from the real lmcache 0.5.6 run ------------------------------------------------

LMCACHE_NONE_HASH = "7e3eff9ef7613a50340eb12677ee03b83ac759fcba9bb32705f07248d56d473b"
LMCACHE_KV_RANK_ONE_WORKER = 16777472  # ObjectKey.ComputeKVRank(1, 0, 1, 0)
LMCACHE_KV_RANK_TP2_RANK1 = 33620481  # ObjectKey.ComputeKVRank(2, 1, 2, 1)

# Case 1: 53 tokens (3 full chunks + 5 left over), float32, unsalted. Token 3 is above 2**31.
IDS_1 = [(i * 7919 + 13) % 200_000 for i in range(53)]
IDS_1[3] = 3_000_000_000
MODEL_1 = "HuggingFaceTB/SmolLM2-135M-Instruct"
HASHES_1 = [
    "38028cde63d316abe064a2f4feed6ed2069206f0c29ddd22031925ac06574c8f",
    "4e3578d5c712c4e321397dcf672c318d0746b1761a1c249e78c0fbd8ee3cb0c4",
    "55b6f788003ac90eb286e1f0be37c2b21ea22aee6f2ae46add185c875f163960",
]
# (length, sha256, first 16 bytes) of each chunk's value, in chunk order.
VALUES_1 = [
    (
        2048,
        "b0b3733d6e1e4878efaf2fd5ce6bf23ad1df1b75490eab4021abcbc780d85ada",
        "0000fac10000f8c10000f6c10000f4c1",
    ),
    (
        2048,
        "de1c565fae39229e8e8b5669c7d218a46d506f6fc2031df8b3cf3a1179bf0726",
        "0000f0c10000eec10000ecc10000eac1",
    ),
    (
        2048,
        "9d573e92d5340151ceea8249d83725000ef849293480614eb20513b66e9419de",
        "0000e6c10000e4c10000e2c10000e0c1",
    ),
]

# Case 2: 20 tokens (1 full chunk), bfloat16, stored with cache_salt "tenant-a".
IDS_2 = list(range(100, 120))
MODEL_2 = "meta-llama/Llama-3.1-8B-Instruct"
SALTED_KEY_2 = (
    "meta-llama/Llama-3.1-8B-Instruct@01000100@0@"
    "c5977d249eeb44e22fc51188438fb1c1e3189cd1178766ac6f9fa4f7aca7f23c@tenant-a"
)
VALUES_2 = [
    (
        1024,
        "12717d5a3c1686d4ff85d3474456b9100940d6fca90e51445fed4b7e6b692f60",
        "fac1f8c1f6c1f4c1f2c1f0c1eec1ecc1",
    )
]


def formula_kv(n: int, dtype: torch.dtype) -> torch.Tensor:
    """`[layers, n, 2, H, D]`: the KV the recorded runs stored (exact in float32 and bfloat16)."""
    flat = torch.arange(LAYERS * n * 2 * HEADS * DIM, dtype=torch.float64)
    return ((flat.reshape(LAYERS, n, 2, HEADS, DIM) % 251 - 125) / 4).to(dtype)


def bound_codec(model: str, dtype: torch.dtype = torch.float32, home: str = "home") -> LMCacheCodec:
    codec = LMCacheCodec(model, redis_is_trusted=True)
    codec.bind(KVLayout.from_shapes(dtype, LAYOUT32.shapes), home)
    return codec


# ---- hashes and keys -------------------------------------------------------------------------


def test_chain_seed_is_lmcache_none_hash():
    assert NONE_HASH.hex() == LMCACHE_NONE_HASH


@pytest.mark.parametrize(("ids", "expected"), [(IDS_1, HASHES_1), (IDS_2, [SALTED_KEY_2.split("@")[3]])])
def test_chunk_hashes_equal_lmcache_for_full_chunks_only(ids, expected):
    assert [h.hex() for h in chunk_hashes(ids, CHUNK)] == expected
    assert [h.hex() for h in chunk_hashes(np.array(ids, dtype=np.int64), CHUNK)] == expected


def test_chunk_hash_depends_on_every_earlier_token():
    changed = list(IDS_1)
    changed[0] += 1
    assert not set(chunk_hashes(changed, CHUNK)) & set(chunk_hashes(IDS_1, CHUNK))


def test_token_ids_outside_uint32_are_refused():
    with pytest.raises(ValueError, match="uint32"):
        chunk_hashes([1, -2, 3], 2)
    with pytest.raises(ValueError, match="uint32"):
        chunk_hashes([2**32], 1)


def test_kv_rank_packs_like_lmcache():
    assert kv_rank() == LMCACHE_KV_RANK_ONE_WORKER
    assert kv_rank(2, 1) == LMCACHE_KV_RANK_TP2_RANK1


def test_keys_of_the_trie_namespace_equal_lmcache_unsalted_keys():
    codec = bound_codec(MODEL_1)
    hashes = codec.chunk_hashes("home", np.array(IDS_1), CHUNK)
    assert [codec.key("home", h) for h in hashes] == [f"{MODEL_1}@01000100@0@{h}" for h in HASHES_1]


def test_salted_key_equals_lmcache():
    (h,) = chunk_hashes(IDS_2, CHUNK)
    assert object_key(MODEL_2, h, cache_salt="tenant-a") == SALTED_KEY_2


def test_other_namespaces_get_their_own_cache_salt():
    codec = bound_codec(MODEL_1)
    h = HASHES_1[0]
    home, tenant_a, tenant_b = (codec.key(ns, h) for ns in ("home", "a" * 32, "b" * 32))
    assert len({home, tenant_a, tenant_b}) == 3
    assert tenant_a == f"{home}@kvblocks-{'a' * 32}"


def test_model_name_with_lmcache_separator_is_refused():
    with pytest.raises(ValueError, match="'@'"):
        LMCacheCodec("org/model@v2", redis_is_trusted=True)


# ---- values ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ids", "dtype", "recorded"), [(IDS_1, torch.float32, VALUES_1), (IDS_2, torch.bfloat16, VALUES_2)]
)
def test_encoded_values_are_the_bytes_lmcache_stored(ids, dtype, recorded):
    codec = bound_codec(MODEL_1, dtype)
    layout = KVLayout.from_shapes(dtype, LAYOUT32.shapes)
    kv = formula_kv(len(ids), dtype)
    for k, (length, sha, head) in enumerate(recorded):
        part = slice(k * CHUNK, (k + 1) * CHUNK)
        raw = codec.encode("", "home", np.array(ids[part]), layout, list(kv[:, part]))
        assert (len(raw), hashlib.sha256(raw).hexdigest(), raw[:16].hex()) == (length, sha, head)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_decode_inverts_encode_bit_exact(dtype):
    layout = KVLayout.from_shapes(dtype, LAYOUT32.shapes)
    codec = bound_codec(MODEL_1, dtype)
    kv = list(torch.randn(LAYERS, CHUNK, 2, HEADS, DIM).to(dtype))
    out = codec.decode(
        codec.encode("", "home", np.array(IDS_1[:CHUNK]), layout, kv),
        "",
        "home",
        IDS_1[:CHUNK],
        layout,
        "cpu",
    )
    for got, want in zip(out, kv, strict=True):
        assert got.shape == (CHUNK, 2, HEADS, DIM)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_layout_conversion_puts_k_then_v_then_layers_then_tokens():
    kv = list(formula_kv(3, torch.float32))
    blob = to_lmcache(kv)
    assert blob.shape == (2, LAYERS, 3, HEADS * DIM)
    assert torch.equal(blob[1, 0, 2].view(HEADS, DIM), kv[0][2, 1])
    assert all(torch.equal(a, b) for a, b in zip(from_lmcache(blob, HEADS, DIM), kv, strict=True))


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"\0" * 2047, "size"),
        (b"\0" * 2049, "size"),
        (b"", "size"),
        (torch.full((512,), float("nan")).numpy().tobytes(), "non-finite"),
        (torch.full((512,), float("inf")).numpy().tobytes(), "non-finite"),
    ],
)
def test_values_that_cannot_be_this_chunk_are_verification_errors(raw, why):
    with pytest.raises(VerificationError, match=why):
        bound_codec(MODEL_1).decode(raw, "", "home", IDS_1[:CHUNK], LAYOUT32, "cpu")


@pytest.mark.parametrize(
    "layers", [((2, 4), (1, 4)), ((2, 4), (2, 8)), ((2, 4), (0, 0))], ids=["heads", "head-dim", "no-kv-layer"]
)
def test_layouts_lmcache_cannot_hold_are_refused_at_bind(layers):
    with pytest.raises(ValueError, match="same heads and head_dim"):
        LMCacheCodec(MODEL_1, redis_is_trusted=True).bind(KVLayout.from_shapes(torch.float32, layers), "home")


def test_rejected_values_are_never_deleted_they_may_belong_to_the_fleet():
    assert LMCacheCodec.delete_invalid is False


# ---- as a tier, against a real Redis ---------------------------------------------------------


def generate(model, tier, ids):
    cache = KVCacheTrie.for_model(model, capacity_tokens=1000, spill=tier)
    result = CachedGenerator(model, IdTokenizer(), cache).generate(ids, max_new_tokens=8)
    tier.flush()
    return result, cache


def test_lmcache_tier_shares_chunks_under_lmcache_keys_and_output_matches_no_cache(redis_url):
    import redis

    model = tiny_llama()
    ids = np.random.default_rng(0).integers(0, 128, 70).tolist()
    plain = CachedGenerator(model, IdTokenizer(), None).generate(ids, max_new_tokens=8)
    writer, _ = generate(
        model, LMCacheRedisTier(redis_url, model_name="tiny", chunk_tokens=CHUNK, redis_is_trusted=True), ids
    )
    keys = {k.decode() for k in redis.Redis.from_url(redis_url).keys("*")}
    assert keys >= {f"tiny@01000100@0@{h.hex()}" for h in chunk_hashes(ids, CHUNK)}

    reader, cache = generate(
        model, LMCacheRedisTier(redis_url, model_name="tiny", chunk_tokens=CHUNK, redis_is_trusted=True), ids
    )
    assert cache.stats()["spill_hit_tokens"] == len(ids) // CHUNK * CHUNK
    assert writer.token_ids == reader.token_ids == plain.token_ids


def test_lmcache_tier_treats_a_damaged_value_as_a_miss_and_leaves_it(redis_url):
    import redis

    model = tiny_llama()
    ids = np.random.default_rng(1).integers(0, 128, 40).tolist()
    plain = CachedGenerator(model, IdTokenizer(), None).generate(ids, max_new_tokens=8)
    generate(
        model, LMCacheRedisTier(redis_url, model_name="tiny", chunk_tokens=CHUNK, redis_is_trusted=True), ids
    )
    client = redis.Redis.from_url(redis_url)
    second = f"tiny@01000100@0@{chunk_hashes(ids, CHUNK)[1].hex()}"
    damaged = client.get(second)[:-4]
    client.set(second, damaged)

    result, cache = generate(
        model, LMCacheRedisTier(redis_url, model_name="tiny", chunk_tokens=CHUNK, redis_is_trusted=True), ids
    )
    stats = cache.stats()
    refused = stats["redis_verify_failures"] + stats["redis_rejected_size"]  # a cut value: another size
    assert (stats["spill_hit_tokens"], refused) == (CHUNK, 1)
    assert result.token_ids == plain.token_ids
    assert client.get(second) == damaged


def test_the_unauthenticated_format_needs_an_explicit_trust_opt_in():
    with pytest.raises(ValueError, match="redis_is_trusted=True"):
        LMCacheCodec(MODEL_1)
    with pytest.raises(ValueError, match="redis_is_trusted=True"):
        LMCacheRedisTier("redis://127.0.0.1:1/0", model_name="tiny")
