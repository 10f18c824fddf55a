"""KVCacheTrie: rules of the public API on a real tiny model, a state machine against a reference
model, and a multi-threaded stress test.

The state machine and the stress test use synthetic KV that is a pure function of (salt, token
prefix), so whatever the trie hands back can be checked by recomputation without a model.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import zlib

import numpy as np
import pytest
import torch
from conftest import tiny_llama
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule
from transformers import DynamicCache, LlamaConfig

from kvblocks import Hit, KVCacheTrie, PinLimitError
from kvblocks.adapters import hf
from kvblocks.cache.layout import LayerSpec
from kvblocks.cache.namespace import Namespace

# ---- synthetic KV: a pure function of (salt, prefix) ----------------------------------------------

HEADS, HEAD_DIM, LAYERS = 2, 3, 2
CONFIG = LlamaConfig(
    hidden_size=16,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=HEADS,
    head_dim=HEAD_DIM,
    vocab_size=16,
)
SPECS = [LayerSpec("full", HEADS, HEAD_DIM)] * LAYERS
_OFFSETS = torch.arange(LAYERS * 2 * HEADS * HEAD_DIM, dtype=torch.float64).reshape(
    LAYERS, 1, 2, HEADS, HEAD_DIM
)


def synthetic_trie(capacity: int, max_pinned_tokens: int | None = None) -> KVCacheTrie:
    return KVCacheTrie(
        CONFIG,
        SPECS,
        Namespace("synthetic", "float64"),
        capacity_tokens=capacity,
        dtype=torch.float64,
        device="cpu",
        max_pinned_tokens=max_pinned_tokens,
    )


def synthetic_kv(ids, salt: str) -> torch.Tensor:
    """`[layers, T, 2, heads, head_dim]`; position i depends on the salt and all of ids[: i + 1]."""
    h, hashes = zlib.crc32(salt.encode()), []
    for t in ids:
        h = (h * 1_000_003 + int(t) + 1) % 2_147_483_647
        hashes.append(h)
    base = torch.tensor(hashes, dtype=torch.float64).reshape(1, -1, 1, 1, 1) * 1024
    return base + _OFFSETS


def synthetic_past(ids, salt: str) -> DynamicCache:
    if len(ids) == 0:
        return DynamicCache(config=CONFIG)
    kv = synthetic_kv(ids, salt)
    layers = [(kv[i, :, 0].transpose(0, 1)[None], kv[i, :, 1].transpose(0, 1)[None]) for i in range(LAYERS)]
    return DynamicCache(ddp_cache_data=layers, config=CONFIG)


def assert_synthetic_cache(cache: DynamicCache, ids, salt: str) -> None:
    """`cache` holds exactly the synthetic KV of `ids`."""
    assert cache.get_seq_length() == len(ids)
    if len(ids) == 0:
        return
    kv = synthetic_kv(ids, salt)
    for i, layer in enumerate(cache.layers):
        assert torch.equal(layer.keys[0].transpose(0, 1), kv[i, :, 0]), f"layer {i} keys differ"
        assert torch.equal(layer.values[0].transpose(0, 1), kv[i, :, 1]), f"layer {i} values differ"


def resident_prefixes(trie: KVCacheTrie, salts) -> dict[tuple[str, tuple[int, ...]], int]:
    """(salt, prefix) -> slot of every resident token, from a full walk of the tree."""
    salt_of = {trie.namespace.with_salt(s).key: s for s in salts}
    out = {}
    for node in trie._tree.iter_nodes():
        ids, slots = trie._tree.path(node)
        salt = salt_of[trie._tree.namespace_of(node)]
        start = len(ids) - len(node.tokens)
        for i in range(start, len(ids)):
            out[(salt, tuple(ids[: i + 1].tolist()))] = int(slots[i])
    return out


def check_trie_invariants(trie: KVCacheTrie, salts) -> dict[tuple[str, tuple[int, ...]], int]:
    """Capacity, slot ownership, counters and stored KV, all against a full walk; returns the walk."""
    resident = resident_prefixes(trie, salts)
    nodes = list(trie._tree.iter_nodes())
    stats = trie.stats()
    assert stats["resident_tokens"] == len(resident) == sum(len(n.tokens) for n in nodes)
    assert stats["resident_tokens"] <= stats["capacity_tokens"]
    assert stats["resident_bytes"] == len(resident) * trie.token_bytes
    assert stats["nodes"] == len(nodes)
    assert stats["pinned_tokens"] == sum(len(n.tokens) for n in nodes if n.pin_ref > 0)
    assert stats["pinned_tokens"] <= trie.max_pinned_tokens
    assert stats["locked_tokens"] == sum(len(n.tokens) for n in nodes if n.lock_ref > 0)
    assert stats["inserted_tokens"] - stats["evicted_tokens"] == len(resident)
    for node in nodes:
        assert node.lock_ref >= sum(c.lock_ref for c in node.children.values())
        assert node.pin_ref >= sum(c.pin_ref for c in node.children.values())

    slots = list(resident.values())
    free = trie._pool._free[: trie._pool.num_free].tolist()
    assert len(set(slots)) == len(slots), "two resident tokens share a slot"
    assert not set(slots) & set(free), "a resident token's slot is on the free list"
    assert sorted(slots + free) == list(range(trie._pool.capacity))

    for (salt, prefix), slot in resident.items():
        got = torch.stack([trie._pool.layers[i][slot] for i in range(LAYERS)])
        assert torch.equal(got, synthetic_kv(prefix, salt)[:, -1]), f"KV of {salt!r}{prefix} changed"
    return resident


# ---- a real tiny model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_llama(torch.float64)


@torch.no_grad()
def prefill(model, ids: list[int]) -> DynamicCache:
    out = model(input_ids=torch.tensor([ids]), past_key_values=hf.empty_cache(model.config), use_cache=True)
    return out.past_key_values


def assert_cache_equals_live(cache: DynamicCache, live: DynamicCache, length: int) -> None:
    assert cache.get_seq_length() == length
    for got, want in zip(cache.layers, live.layers, strict=True):
        assert torch.equal(got.keys, want.keys[:, :, :length])
        assert torch.equal(got.values, want.values[:, :, :length])


def seq(first: int, n: int) -> list[int]:
    """`n` ids starting with `first` (distinct firsts never share a prefix)."""
    return [first] + [(first * 7 + 3 * i) % 100 + 20 for i in range(1, n)]


def test_to_hf_cache_is_bit_identical_to_the_inserted_kv(model):
    ids = seq(1, 12)
    live = prefill(model, ids)
    trie = KVCacheTrie.for_model(model, capacity_tokens=64)
    assert trie.insert(ids, live) == 12
    with trie.match([*ids, 5]) as hit:
        assert hit.length == 12
        assert_cache_equals_live(hit.to_hf_cache(), live, 12)
    with trie.match([*ids[:7], 99, 98]) as hit:
        assert hit.length == 7
        assert_cache_equals_live(hit.to_hf_cache(), live, 7)


def test_cache_from_a_hit_resumes_the_model_like_a_full_prefill(model):
    ids = seq(1, 12)
    trie = KVCacheTrie.for_model(model, capacity_tokens=64)
    trie.insert(ids[:8], prefill(model, ids[:8]))
    with torch.no_grad(), trie.match(ids) as hit:
        assert hit.length == 8
        out = model(input_ids=torch.tensor([ids[8:]]), past_key_values=hit.to_hf_cache(), use_cache=True)
        full = model(
            input_ids=torch.tensor([ids]), past_key_values=hf.empty_cache(model.config), use_cache=True
        )
    torch.testing.assert_close(out.logits[0], full.logits[0, 8:], rtol=0, atol=1e-12)


def test_full_hit_still_recomputes_last_token(model):
    ids = seq(1, 10)
    trie = KVCacheTrie.for_model(model, capacity_tokens=64)
    trie.insert(ids, prefill(model, ids))
    with trie.match(ids) as hit:
        assert hit.length == len(ids) - 1
        assert hit.to_hf_cache().get_seq_length() == len(ids) - 1
    with trie.match(ids[:1]) as hit:
        assert hit.length == 0
    with trie.match([]) as hit:
        assert hit.length == 0
        assert hit.to_hf_cache().get_seq_length() == 0
    assert trie.stats()["hit_tokens"] == len(ids) - 1


def test_strict_prefix_prompt_hits_all_but_its_last_token(model):
    ids = seq(1, 10)
    live = prefill(model, ids)
    trie = KVCacheTrie.for_model(model, capacity_tokens=64)
    trie.insert(ids, live)
    with trie.match(torch.tensor([ids[:5]])) as hit:
        assert hit.length == 4
        assert_cache_equals_live(hit.to_hf_cache(), live, 4)
    assert trie.cached_length(ids[:5]) == 5


def test_insert_stores_only_tokens_not_cached_yet(model):
    ids = seq(1, 10)
    live = prefill(model, ids)
    trie = KVCacheTrie.for_model(model, capacity_tokens=64)
    assert trie.insert(ids[:6], live) == 6
    assert trie.insert(ids, live) == 4
    assert trie.insert(ids, live) == 0
    assert trie.insert(ids[:3], live) == 0
    stats = trie.stats()
    assert stats["inserted_tokens"] == stats["resident_tokens"] == 10
    with trie.match([*ids, 0]) as hit:
        assert_cache_equals_live(hit.to_hf_cache(), live, 10)


def test_insert_skips_ids_beyond_the_length_of_the_cache(model):
    ids = seq(1, 8)
    trie = KVCacheTrie.for_model(model, capacity_tokens=64)
    assert trie.insert([*ids, 42], prefill(model, ids)) == 8
    assert trie.cached_length([*ids, 42]) == 8


def test_eviction_under_tiny_capacity_drops_the_least_recently_used_tail(model):
    a, b, c = seq(1, 10), seq(2, 10), seq(3, 6)
    live_a = prefill(model, a)
    trie = KVCacheTrie.for_model(model, capacity_tokens=16)
    trie.insert(a, live_a)
    trie.insert(b, prefill(model, b))
    assert trie.stats()["resident_tokens"] == 16
    assert trie.cached_length(a) == 6, "a was least recently used: its last 4 tokens go"
    assert trie.cached_length(b) == 10
    with trie.match(a) as hit:
        assert_cache_equals_live(hit.to_hf_cache(), live_a, 6)
    trie.insert(c, prefill(model, c))
    assert trie.cached_length(b) == 4, "a was just matched, so b is now the oldest"
    assert trie.cached_length(a) == 6
    stats = trie.stats()
    assert stats["resident_tokens"] == 16
    assert stats["evicted_tokens"] == 10
    assert trie.evict(100) == 16
    assert trie.stats()["resident_tokens"] == 0


def test_insert_only_partly_fits_when_everything_else_is_locked(model):
    a, b = seq(1, 10), seq(2, 10)
    live_a, live_b = prefill(model, a), prefill(model, b)
    trie = KVCacheTrie.for_model(model, capacity_tokens=16)
    trie.insert(a, live_a)
    with trie.match([*a, 0]) as hit:
        assert trie.insert(b, live_b) == 6
        stats = trie.stats()
        assert stats["insert_dropped_tokens"] == 4
        assert stats["resident_tokens"] == 16
        assert stats["locked_tokens"] == 10
        assert trie.cached_length(b) == 6
        assert trie.evict(100) == 6, "only b's unlocked tokens can go"
        assert_cache_equals_live(hit.to_hf_cache(), live_a, 10)
    assert trie.insert(b, live_b) == 10
    assert trie.cached_length(a) == 6
    with trie.match([*b, 0]) as hit:
        assert_cache_equals_live(hit.to_hf_cache(), live_b, 10)


def test_insert_into_a_pool_full_of_locked_tokens_stores_nothing(model):
    a, b = seq(1, 8), seq(2, 8)
    trie = KVCacheTrie.for_model(model, capacity_tokens=8)
    trie.insert(a, prefill(model, a))
    with trie.match([*a, 0]):
        assert trie.insert(b, prefill(model, b)) == 0
        assert trie.stats()["insert_dropped_tokens"] == 8
    assert trie.stats()["evicted_tokens"] == 0


def test_pin_beyond_the_cap_raises_pin_limit_error_and_pins_nothing(model):
    a, b = seq(1, 10), seq(2, 4)
    trie = KVCacheTrie.for_model(model, capacity_tokens=32, max_pinned_tokens=8)
    trie.insert(a, prefill(model, a))
    trie.insert(b, prefill(model, b))
    assert trie.pin(a[:6]) == 6
    assert trie.pin(a[:6]) == 6, "pinning an already pinned prefix adds no tokens"
    with pytest.raises(PinLimitError, match="cap of 8"):
        trie.pin(b)
    with pytest.raises(PinLimitError):
        trie.pin(a)
    assert trie.stats()["pinned_tokens"] == 6
    assert trie.pin(a[:8]) == 8
    assert trie.stats()["pinned_tokens"] == 8


def test_pin_of_an_uncached_prefix_pins_nothing(model):
    trie = KVCacheTrie.for_model(model, capacity_tokens=32)
    assert trie.pin(seq(1, 5)) == 0
    assert trie.unpin(seq(1, 5)) == 0
    assert trie.stats()["pinned_tokens"] == 0


def test_pinned_prefix_survives_eviction_pressure_until_unpinned(model):
    system = seq(1, 8)
    live = prefill(model, system)
    trie = KVCacheTrie.for_model(model, capacity_tokens=20)
    trie.insert(system, live)
    assert trie.pin(system[:6]) == 6
    for first in range(2, 9):
        other = seq(first, 9)
        trie.insert(other, prefill(model, other))
        assert trie.stats()["resident_tokens"] <= 20
    assert trie.cached_length(system) == 6
    with trie.match(system) as hit:
        assert_cache_equals_live(hit.to_hf_cache(), live, 6)
    resident = trie.stats()["resident_tokens"]
    assert trie.evict(100) == resident - 6
    assert trie.cached_length(system) == 6
    assert trie.unpin(system[:6]) == 6
    assert trie.stats()["pinned_tokens"] == 0
    assert trie.evict(100) == 6
    assert trie.cached_length(system) == 0


def test_unpin_undoes_one_pin_of_exactly_that_prefix(model):
    ids = seq(1, 8)
    trie = KVCacheTrie.for_model(model, capacity_tokens=32)
    trie.insert(ids, prefill(model, ids))
    trie.pin(ids[:4])
    trie.pin(ids[:4])
    trie.pin(ids)
    assert trie.unpin(ids[:5]) == 0, "no pin ends at 5 tokens"
    assert trie.unpin(ids) == 8
    assert trie.unpin(ids) == 0
    assert trie.stats()["pinned_tokens"] == 4
    assert trie.unpin(ids[:4]) == 4
    assert trie.stats()["pinned_tokens"] == 4
    assert trie.unpin(ids[:4]) == 4
    assert trie.stats()["pinned_tokens"] == 0
    assert trie.unpin(ids[:4]) == 0


def test_unpin_of_a_prefix_that_was_never_pinned_is_a_no_op():
    trie = synthetic_trie(32)
    trie.insert([1, 2, 3, 4], synthetic_past([1, 2, 3, 4], ""))
    assert trie.pin([1, 2, 3, 4]) == 4
    trie.insert([1, 2, 9], synthetic_past([1, 2, 9], ""))
    assert trie.unpin([1, 2]) == 0, "[1, 2] was never pinned"
    assert trie.stats()["pinned_tokens"] == 4
    assert trie.unpin([1, 2, 3, 4]) == 4
    assert trie.stats()["pinned_tokens"] == 0


def test_salted_namespaces_never_share(model):
    ids = seq(1, 10)
    live = prefill(model, ids)
    trie = KVCacheTrie.for_model(model, capacity_tokens=64)
    assert trie.insert(ids, live, salt="alice") == 10
    assert trie.cached_length(ids) == 0
    assert trie.cached_length(ids, salt="bob") == 0
    with trie.match(ids, salt="bob") as hit:
        assert hit.length == 0
    assert trie.pin(ids, salt="bob") == 0
    assert trie.insert(ids, live, salt="bob") == 10
    assert trie.insert(ids, live) == 10
    assert trie.stats()["resident_tokens"] == 30
    trie.evict(10)
    assert sorted(trie.cached_length(ids, salt=s) for s in ("alice", "bob", None)) == [0, 10, 10]
    assert trie.cached_length(ids, salt="") == trie.cached_length(ids, salt=None)


def test_stats_count_queries_hits_inserts_evictions_and_release_locks(model):
    ids, other = seq(1, 10), seq(2, 6)
    trie = KVCacheTrie.for_model(model, capacity_tokens=12, eviction="lru")
    trie.insert(ids, prefill(model, ids))
    held = trie.match([*ids, 77])
    with trie.match([*ids[:4], 5]) as hit:
        assert (held.length, hit.length) == (10, 4)
        assert trie.stats()["locked_tokens"] == 10
        assert trie.insert(other, prefill(model, other)) == 2
    held.release()
    held.release()
    with trie.match(seq(3, 5)) as miss:
        assert miss.length == 0
    expected = {
        "queries": 3,
        "queried_tokens": 11 + 5 + 5,
        "hit_tokens": 10 + 4,
        "inserted_tokens": 12,
        "insert_dropped_tokens": 4,
        "evicted_tokens": 0,
        "resident_tokens": 12,
        "resident_bytes": 12 * trie.token_bytes,
        "capacity_tokens": 12,
        "capacity_bytes": 12 * trie.token_bytes,
        "pinned_tokens": 0,
        "locked_tokens": 0,
        "nodes": 2,
    }
    stats = trie.stats()
    assert {k: stats[k] for k in expected} == expected
    assert trie.token_bytes == 2 * 2 * 2 * 16 * 8, "2 layers x K,V x 2 heads x head_dim 16 x fp64"
    assert trie.evict(3) == 3
    assert trie.stats()["evicted_tokens"] == 3
    assert trie.stats()["resident_tokens"] == 9
    assert trie.cached_length(ids) == 7, "ids was used before other was inserted"


def test_continuation_is_what_followed_a_fully_resident_prefix(model):
    ids = seq(1, 10)
    trie = KVCacheTrie.for_model(model, capacity_tokens=32)
    trie.insert(ids, prefill(model, ids))
    assert trie.continuation(ids[:3], 4) == ids[3:7]
    assert trie.continuation(ids[:3], 100) == ids[3:]
    assert trie.continuation(ids[:3], 0) == []
    assert trie.continuation([*ids[:3], 0], 4) == [], "not all of the prompt is resident"
    assert trie.continuation(ids[:3], 4, salt="other") == []


def test_released_hit_refuses_to_build_a_cache(model):
    ids = seq(1, 6)
    trie = KVCacheTrie.for_model(model, capacity_tokens=16)
    trie.insert(ids, prefill(model, ids))
    hit = trie.match(ids)
    assert isinstance(hit, Hit)
    hit.release()
    with pytest.raises(RuntimeError, match="released"):
        hit.to_hf_cache()


def test_for_model_sizes_the_pool_from_capacity_bytes(model):
    probe = KVCacheTrie.for_model(model, capacity_tokens=1)
    trie = KVCacheTrie.for_model(model, capacity_bytes=10 * probe.token_bytes + 1)
    assert trie.stats()["capacity_tokens"] == 10
    assert trie.max_pinned_tokens == 5
    with pytest.raises(ValueError, match="not both"):
        KVCacheTrie.for_model(model, capacity_tokens=4, capacity_bytes=1024)


def test_token_ids_may_be_a_list_an_array_or_a_one_row_tensor(model):
    ids = seq(1, 6)
    trie = KVCacheTrie.for_model(model, capacity_tokens=16)
    trie.insert(torch.tensor([ids]), prefill(model, ids))
    assert (
        trie.cached_length(ids)
        == trie.cached_length(np.array(ids))
        == trie.cached_length(torch.tensor(ids))
        == 6
    )
    with pytest.raises(ValueError, match="one sequence"):
        trie.cached_length(torch.tensor([ids, ids]))


# ---- state machine against a reference model --------------------------------------------------------

SALTS = ("", "tenant")
CAPACITY, MAX_PINNED = 10, 5
token_lists = st.lists(st.integers(0, 2), max_size=6)
salts = st.sampled_from(SALTS)

Key = tuple[str, tuple[int, ...]]


def keys(salt: str, ids) -> list[Key]:
    ids = [int(t) for t in ids]
    return [(salt, tuple(ids[: i + 1])) for i in range(len(ids))]


class TrieMachine(RuleBasedStateMachine):
    """The reference is the set of resident (salt, prefix) keys plus what must stay resident."""

    inserted = Bundle("inserted")

    def __init__(self) -> None:
        super().__init__()
        self.trie = synthetic_trie(CAPACITY, MAX_PINNED)
        self.resident: set[Key] = set()
        self.hits: list[tuple[str, list[int], Hit]] = []
        self.pins: list[tuple[str, list[int]]] = []

    def ref_length(self, salt: str, ids) -> int:
        n = 0
        for key in keys(salt, ids):
            if key not in self.resident:
                break
            n += 1
        return n

    def protected(self) -> set[Key]:
        out: set[Key] = set()
        for salt, ids, hit in self.hits:
            out.update(keys(salt, ids[: hit.length]))
        for salt, prefix in self.pins:
            out.update(keys(salt, prefix))
        return out

    def absorb(self, evicted_before: int, added: set[Key]) -> set[Key]:
        """Learn what the last call evicted; check that only unprotected tokens went."""
        now = set(resident_prefixes(self.trie, SALTS))
        removed = self.resident - now
        assert not removed & self.protected(), "a locked or pinned token was evicted"
        assert now - self.resident == added, "tokens appeared that were never inserted"
        assert self.trie.stats()["evicted_tokens"] - evicted_before == len(removed)
        self.resident = now
        return removed

    def all_locked_or_pinned(self) -> bool:
        return all(n.lock_ref > 0 or n.pin_ref > 0 for n in self.trie._tree.iter_nodes())

    @rule(target=inserted, salt=salts, ids=token_lists)
    def insert(self, salt, ids):
        start = self.ref_length(salt, ids)
        before = self.trie.stats()
        stored = self.trie.insert(ids, synthetic_past(ids, salt), salt=salt)
        after = self.trie.stats()
        dropped = after["insert_dropped_tokens"] - before["insert_dropped_tokens"]
        assert stored + dropped == len(ids) - start
        assert after["inserted_tokens"] - before["inserted_tokens"] == stored
        if dropped:
            assert after["resident_tokens"] == CAPACITY
        self.absorb(before["evicted_tokens"], set(keys(salt, ids)[start : start + stored]))
        assert self.ref_length(salt, ids) >= start + stored
        return salt, ids

    @rule(target=inserted, seq=inserted, cut=st.integers(0, 6), suffix=token_lists)
    def insert_branch(self, seq, cut, suffix):
        """Continue an inserted sequence, or branch off it, so that nodes grow and split."""
        salt, ids = seq
        return self.insert(salt, ids[:cut] + suffix)

    @rule(seq=inserted, cut=st.integers(0, 7), keep=st.booleans())
    def match_prefix(self, seq, cut, keep):
        self.match(seq[0], seq[1][:cut], keep)

    @rule(seq=inserted, cut=st.integers(0, 6))
    def pin_prefix(self, seq, cut):
        self.pin(seq[0], seq[1][:cut])

    @rule(salt=salts, ids=token_lists, keep=st.booleans())
    def match(self, salt, ids, keep):
        before = self.trie.stats()
        hit = self.trie.match(ids, salt=salt)
        assert hit.length == min(self.ref_length(salt, ids), max(len(ids) - 1, 0))
        assert_synthetic_cache(hit.to_hf_cache(), ids[: hit.length], salt)
        after = self.trie.stats()
        assert after["queries"] - before["queries"] == 1
        assert after["queried_tokens"] - before["queried_tokens"] == len(ids)
        assert after["hit_tokens"] - before["hit_tokens"] == hit.length
        if keep:
            self.hits.append((salt, ids, hit))
        else:
            hit.release()

    @precondition(lambda self: self.hits)
    @rule(data=st.data())
    def release(self, data):
        salt, ids, hit = self.hits.pop(data.draw(st.integers(0, len(self.hits) - 1)))
        assert_synthetic_cache(hit.to_hf_cache(), ids[: hit.length], salt)
        hit.release()
        if hit.length:
            with pytest.raises(RuntimeError):
                hit.to_hf_cache()

    @rule(num_tokens=st.integers(0, 12))
    def evict(self, num_tokens):
        before = self.trie.stats()["evicted_tokens"]
        freed = self.trie.evict(num_tokens)
        assert freed == len(self.absorb(before, set())) <= num_tokens
        if freed < num_tokens:
            assert self.all_locked_or_pinned(), "eviction stopped while evictable tokens remained"

    @rule(salt=salts, ids=token_lists)
    def pin(self, salt, ids):
        pinned_before = self.trie.stats()["pinned_tokens"]
        try:
            length = self.trie.pin(ids, salt=salt)
        except PinLimitError:
            assert self.trie.stats()["pinned_tokens"] == pinned_before
            return
        assert length == self.ref_length(salt, ids)
        if length:
            self.pins.append((salt, list(ids[:length])))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        salt, prefix = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        assert self.trie.unpin(prefix, salt=salt) == len(prefix)

    @invariant()
    def trie_matches_reference(self):
        resident = check_trie_invariants(self.trie, SALTS)
        assert set(resident) == self.resident
        assert self.protected() <= self.resident
        for salt, ids in [(s, list(p)) for s, p in self.resident]:
            assert self.trie.cached_length(ids, salt=salt) == len(ids)
        if not self.hits:
            assert self.trie.stats()["locked_tokens"] == 0

    def teardown(self):
        for _, _, hit in self.hits:
            hit.release()
        assert self.trie.stats()["locked_tokens"] == 0


TestTrieMachine = TrieMachine.TestCase
TestTrieMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


# ---- concurrency ------------------------------------------------------------------------------------


def test_concurrent_match_insert_release_evict_keeps_every_invariant():
    """Threads share one small trie; every hit's KV is checked while other threads evict and insert."""
    trie = synthetic_trie(48, max_pinned_tokens=8)
    salts = ("", "a", "b")
    errors: list[BaseException] = []
    deadline = time.monotonic() + 8.0
    start = threading.Barrier(4)

    def worker(seed: int) -> None:
        rnd = random.Random(seed)
        start.wait()
        try:
            for step in range(800):
                if time.monotonic() > deadline:
                    break
                salt = rnd.choice(salts)
                ids = [rnd.randrange(3) for _ in range(rnd.randrange(1, 14))]
                with trie.match(ids, salt=salt) as hit:
                    assert_synthetic_cache(hit.to_hf_cache(), ids[: hit.length], salt)
                    trie.insert(ids, synthetic_past(ids, salt), salt=salt)
                    assert_synthetic_cache(hit.to_hf_cache(), ids[: hit.length], salt)
                if step % 7 == 0:
                    trie.evict(rnd.randrange(1, 20))
                if step % 11 == 0:
                    try:
                        pinned = trie.pin(ids, salt=salt)
                    except PinLimitError:
                        continue
                    trie.insert(ids[::-1], synthetic_past(ids[::-1], salt), salt=salt)
                    assert trie.cached_length(ids, salt=salt) >= pinned
                    trie.unpin(ids[:pinned], salt=salt)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so races have a chance to show
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch_interval)
    assert not errors, errors[0]
    stats = trie.stats()
    assert stats["locked_tokens"] == 0
    assert stats["pinned_tokens"] == 0
    assert stats["queries"] > 100
    assert stats["evicted_tokens"] > 0
    check_trie_invariants(trie, salts)


def test_lookups_in_namespaces_that_hold_nothing_do_not_grow_the_tree():
    # Clients choose their cache salts: a million distinct ones must not leave a million roots.
    trie = synthetic_trie(64)
    ids = seq(1, 10)
    trie.insert(ids, synthetic_past(ids, "kept"), salt="kept")
    for i in range(200):
        salt = f"probe-{i}"
        with trie.match(ids, salt=salt) as hit:
            assert hit.length == 0
        assert trie.cached_length(ids, salt=salt) == 0
        assert trie.continuation(ids, 4, salt=salt) == []
        assert trie.pin(ids, salt=salt) == 0
    assert len(trie._tree.roots) == 1
    with trie.match(ids, salt="kept") as hit:
        assert hit.length == len(ids) - 1
