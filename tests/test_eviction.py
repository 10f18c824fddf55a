"""Eviction policies: what GDSF keeps that LRU throws away, how its credit ages, and the plumbing.

The ordering rules themselves are checked against a reference model for both policies by the
state machines in test_radix.py; exactness under eviction by the exactness and trie tests.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvblocks.cache.eviction import LRU, POLICIES, GreedyDualFrequency, make_policy
from kvblocks.cache.radix import RadixTree
from kvblocks.cli import args as cli_args
from kvblocks.cli import commands as cli

NS = "ns"


def ids(first: int, n: int) -> np.ndarray:
    return np.array([first] + [first + 1] * (n - 1), dtype=np.int32)


class Tree:
    """A radix tree with a slot allocator: `put` stores a sequence's uncached tail, `get` looks it up."""

    def __init__(self, policy) -> None:
        self.tree = RadixTree(make_policy(policy))
        self.next_slot = 0

    def put(self, seq: np.ndarray) -> None:
        m = self.tree.match(NS, seq)
        new = seq[m.length :]
        if len(new):
            slots = np.arange(self.next_slot, self.next_slot + len(new), dtype=np.int32)
            self.next_slot += len(new)
            self.tree.extend(m, new, slots)

    def get(self, seq: np.ndarray) -> int:
        return self.tree.match(NS, seq).length

    def resident(self, seq: np.ndarray) -> int:
        return self.tree.match(NS, seq, touch=False).length


def hot_prefix_then_one_shots(policy: str) -> tuple[Tree, np.ndarray, list[np.ndarray]]:
    """A 64-token prefix shared by 6 requests (each a 4-token tail under it), then 3 unrelated
    one-shot prompts of 16 tokens each, the newest things in the tree."""
    t = Tree(policy)
    system = ids(1000, 64)
    for q in range(6):
        t.put(np.concatenate([system, ids(10 * q + 1, 4)]))
    one_shots = [ids(2000 + 100 * k, 16) for k in range(3)]
    for seq in one_shots:
        t.put(seq)
    return t, system, one_shots


def test_gdsf_evicts_one_shot_prompts_before_a_hot_shared_prefix_that_lru_trims():
    for policy, prefix_kept in (("lru", False), ("gdsf", True)):
        t, system, one_shots = hot_prefix_then_one_shots(policy)
        t.tree.evict(24 + 48)  # the six tails and every one-shot prompt, or the prefix instead
        assert (t.resident(system) == 64) is prefix_kept, policy
        assert (sum(t.resident(s) for s in one_shots) == 0) is prefix_kept, policy


def churns_survived(policy: str, hits: int, churns: int = 40) -> int:
    """A 32-token prefix used `hits` times, then one-shot 32-token prompts come and go (each
    eviction takes exactly one of them or the prefix): after how many did the prefix go?"""
    t = Tree(policy)
    old = ids(1, 32)
    t.put(old)
    for _ in range(hits - 1):
        t.get(old)
    for k in range(churns):
        t.put(ids(1000 + 10 * k, 32))
        t.tree.evict(32)
        if t.resident(old) == 0:
            return k
    return churns


def test_gdsf_credit_ages_so_a_prefix_hot_long_ago_goes_in_the_end():
    assert churns_survived("lru", hits=10) == 0  # LRU: the oldest goes first, however often used
    survived = [churns_survived("gdsf", hits=h) for h in (1, 5, 10)]
    assert survived[0] == 0  # used once, like every one-shot prompt, and older
    assert 0 < survived[1] < survived[2] < 40  # more hits, more credit; the inflation value catches up


def test_gdsf_ranks_deeper_tokens_dearer_at_equal_use():
    policy = GreedyDualFrequency(attention_tokens=64)
    t = Tree(policy)
    shallow, deep = ids(1, 8), ids(100, 200)
    t.put(deep)
    t.put(shallow)  # more recent: LRU would keep it and trim the deep one
    t.tree.evict(8)
    assert t.resident(deep) == 200 and t.resident(shallow) == 0


def test_lru_orders_by_last_use_only():
    t = Tree("lru")
    a, b = ids(1, 8), ids(100, 8)
    t.put(a)
    for _ in range(10):
        t.get(a)
    t.put(b)
    t.tree.evict(8)
    assert t.resident(a) == 0 and t.resident(b) == 8


def test_policies_by_name_and_errors():
    assert isinstance(make_policy("lru"), LRU)
    assert isinstance(make_policy(None), GreedyDualFrequency)  # the measured default
    policy = GreedyDualFrequency(attention_tokens=10)
    assert make_policy(policy) is policy
    with pytest.raises(ValueError, match="unknown eviction policy 'arc'; choose from lru, gdsf"):
        make_policy("arc")
    with pytest.raises(ValueError, match="attention_tokens"):
        GreedyDualFrequency(attention_tokens=0)
    assert set(cli_args.EVICTION_POLICIES) == set(POLICIES)


def test_serve_and_generate_take_an_eviction_flag():
    parser = cli.build_parser()
    for command in ("serve", "generate"):
        args = parser.parse_args([command, "--eviction", "lru"] + (["hi"] if command == "generate" else []))
        assert args.eviction == "lru"
        assert parser.parse_args([command] + (["hi"] if command == "generate" else [])).eviction == "gdsf"
