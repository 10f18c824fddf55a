"""KVPool: slot accounting against a reference set, and exact scatter/gather round trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks.cache.layout import KVLayout
from kvblocks.cache.pool import KVPool

SHAPES = ((2, 4), (0, 0), (1, 3))  # layer 1 caches nothing


def make_pool(capacity: int = 8, dtype: torch.dtype = torch.float64) -> KVPool:
    return KVPool(KVLayout.from_shapes(dtype, SHAPES), capacity, "cpu")


def test_capacity_below_one_token_is_rejected():
    with pytest.raises(ValueError, match="at least one token"):
        make_pool(0)


def test_layers_without_kv_get_no_tensor_and_cost_no_bytes():
    pool = make_pool(5, torch.float32)
    assert pool.layers[1] is None
    assert pool.layers[0].shape == (5, 2, 2, 4)
    assert pool.layers[2].shape == (5, 2, 1, 3)
    assert pool.token_bytes == 2 * (2 * 4 + 1 * 3) * 4


def test_bytes_per_token_scales_with_dtype_size():
    def token_bytes(dtype: torch.dtype) -> int:
        return KVLayout.from_shapes(dtype, SHAPES).token_bytes()

    assert token_bytes(torch.float64) == 2 * token_bytes(torch.float32) == 4 * token_bytes(torch.bfloat16)


def test_alloc_hands_out_every_slot_exactly_once():
    pool = make_pool(6)
    slots = np.concatenate([pool.alloc(2), pool.alloc(0), pool.alloc(4)])
    assert sorted(slots.tolist()) == list(range(6))
    assert pool.num_free == 0
    pool.release(slots[:3])
    assert pool.num_free == 3
    assert sorted(pool.alloc(3).tolist()) == sorted(slots[:3].tolist())


def test_scatter_then_gather_returns_the_same_bits():
    pool = make_pool(8)
    gen = torch.Generator().manual_seed(0)
    slots = np.array([5, 0, 3], dtype=np.int32)
    index = pool.index(slots)
    assert index.dtype == torch.int64
    keys = torch.randn(3, 2, 4, generator=gen, dtype=torch.float64)
    values = torch.randn(3, 2, 4, generator=gen, dtype=torch.float64)
    pool.scatter(0, index, keys, values)
    got = pool.gather(0, index)
    assert torch.equal(got[:, 0], keys) and torch.equal(got[:, 1], values)
    reordered = pool.gather(0, pool.index(np.array([3, 5], dtype=np.int32)))
    assert torch.equal(reordered[:, 0], keys[[2, 0]])


def test_scatter_casts_to_the_pool_dtype():
    pool = make_pool(4, torch.float32)
    index = pool.index(np.array([1], dtype=np.int32))
    keys = torch.full((1, 1, 3), 1.5, dtype=torch.float64)
    pool.scatter(2, index, keys, -keys)
    got = pool.gather(2, index)
    assert got.dtype == torch.float32
    assert got[0, 0].tolist() == [[1.5] * 3] and got[0, 1].tolist() == [[-1.5] * 3]


def test_scatter_leaves_other_slots_untouched():
    pool = make_pool(4)
    everything = pool.index(np.arange(4, dtype=np.int32))
    ones = torch.ones(4, 2, 4, dtype=torch.float64)
    pool.scatter(0, everything, ones, ones)
    pool.scatter(0, pool.index(np.array([2], dtype=np.int32)), ones[:1] * 7, ones[:1] * 7)
    got = pool.gather(0, everything)
    assert got[:, 0, 0, 0].tolist() == [1.0, 1.0, 7.0, 1.0]


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 12),
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 12), st.randoms(use_true_random=False)), max_size=30
    ),
)
def test_live_and_free_slots_always_partition_the_pool(capacity, ops):
    pool = KVPool(KVLayout.from_shapes(torch.float32, [(1, 1)]), capacity, "cpu")
    live: set[int] = set()
    for is_alloc, n, rnd in ops:
        if is_alloc:
            n = min(n, pool.num_free)
            slots = pool.alloc(n).tolist()
            assert len(slots) == n == len(set(slots))
            assert not live & set(slots), "a live slot was handed out again"
            assert all(0 <= s < capacity for s in slots)
            live.update(slots)
        elif live:
            back = rnd.sample(sorted(live), min(n, len(live)))
            pool.release(np.array(back, dtype=np.int32))
            live.difference_update(back)
        assert pool.num_free == capacity - len(live)
    rest = pool.alloc(pool.num_free).tolist()
    assert sorted(rest + sorted(live)) == list(range(capacity))


@pytest.mark.parametrize("shapes", [((2, 4), (0, 0), (2, 4), (2, 4)), SHAPES], ids=["stacked", "mixed"])
def test_gather_all_equals_one_gather_per_layer(shapes):
    pool = KVPool(KVLayout.from_shapes(torch.float32, shapes), 16, "cpu")
    assert pool.stacked == (len({s for s in shapes if s[0]}) == 1)
    for t in pool.layers:
        if t is not None:
            t.normal_()
    index = pool.index(np.array([7, 0, 15, 3, 3]))
    every = pool.gather_all(index, fused=True)
    assert [t is None for t in every] == [t is None for t in pool.layers]
    for layer, t in enumerate(pool.layers):
        if t is not None:
            assert torch.equal(every[layer], pool.gather(layer, index))


def test_stacked_layers_are_separate_memory():
    pool = KVPool(KVLayout.from_shapes(torch.float32, ((2, 4), (2, 4))), 4, "cpu")
    pool.layers[0].fill_(1.0)
    pool.layers[1].fill_(2.0)
    assert pool.layers[0].is_contiguous() and float(pool.layers[0].sum()) == 4 * 2 * 2 * 4
