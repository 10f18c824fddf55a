"""RadixTree: examples of its rules, then a state machine against a plain reference model.

The reference is a dict of resident keys `(namespace, token prefix) -> slot`. It learns what
eviction removed from the slots `evict` returns, and checks that choice: only unprotected tokens,
exactly as many as asked (or all that are evictable), never a gap in a resident prefix, leaves in
the order of the tree's eviction policy (LRU, then GDSF in a second machine).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from kvblocks.cache.eviction import LRU, EvictionPolicy, GreedyDualFrequency
from kvblocks.cache.radix import Node, RadixTree, common_prefix_len

NS = "ns"


def arr(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


def insert(tree: RadixTree, namespace: str, ids: np.ndarray, first_slot: int) -> Node | None:
    """Store the uncached tail of `ids` with consecutive slots from `first_slot`."""
    m = tree.match(namespace, ids)
    new = ids[m.length :]
    if len(new) == 0:
        return None
    return tree.extend(m, new, np.arange(first_slot, first_slot + len(new), dtype=np.int32))


def test_common_prefix_len_is_token_granular():
    assert common_prefix_len(arr(1, 2, 3), arr(1, 2, 4)) == 2
    assert common_prefix_len(arr(1, 2), arr(1, 2, 3)) == 2
    assert common_prefix_len(arr(5), arr(1)) == 0
    assert common_prefix_len(arr(), arr(1)) == 0


def test_match_stops_inside_a_node_at_the_first_differing_token():
    tree = RadixTree()
    insert(tree, NS, arr(1, 2, 3, 4, 5), 0)
    m = tree.match(NS, arr(1, 2, 3, 9))
    assert m.length == 3
    assert m.node_offset == 3
    assert m.slots().tolist() == [0, 1, 2]
    assert tree.num_nodes == 1, "a lookup must not split nodes"


def test_insert_shares_the_common_prefix_and_stores_only_new_tokens():
    tree = RadixTree()
    insert(tree, NS, arr(1, 2, 3, 4), 0)
    insert(tree, NS, arr(1, 2, 7), 10)
    assert tree.resident_tokens == 5
    assert tree.num_nodes == 3
    assert tree.match(NS, arr(1, 2, 7)).slots().tolist() == [0, 1, 10]
    assert tree.match(NS, arr(1, 2, 3, 4)).slots().tolist() == [0, 1, 2, 3]


def test_extending_a_leaf_appends_to_it_in_place():
    tree = RadixTree()
    insert(tree, NS, arr(1, 2), 0)
    insert(tree, NS, arr(1, 2, 3), 2)
    assert tree.num_nodes == 1
    assert tree.match(NS, arr(1, 2, 3)).slots().tolist() == [0, 1, 2]


def test_namespaces_never_share_tokens():
    tree = RadixTree()
    insert(tree, "a", arr(1, 2, 3), 0)
    assert tree.match("b", arr(1, 2, 3)).length == 0
    insert(tree, "b", arr(1, 2, 3), 3)
    assert tree.match("a", arr(1, 2, 3)).slots().tolist() == [0, 1, 2]
    assert tree.match("b", arr(1, 2, 3)).slots().tolist() == [3, 4, 5]
    assert tree.resident_tokens == 6


def test_namespace_of_any_node_is_the_namespace_it_was_inserted_under():
    tree = RadixTree()
    a = insert(tree, "a", arr(1, 2, 3), 0)
    b = insert(tree, ("b", 1), arr(1, 2, 3), 3)
    upper = tree.split(a, 1)
    assert [tree.namespace_of(n) for n in (a, upper, b)] == ["a", "a", ("b", 1)]


def test_continuation_follows_the_most_recently_used_branch():
    tree = RadixTree()
    insert(tree, NS, arr(1, 2, 3, 4), 0)
    insert(tree, NS, arr(1, 2, 5, 6, 7), 4)
    assert tree.continuation(tree.match(NS, arr(1)), 10).tolist() == [2, 5, 6, 7]
    tree.match(NS, arr(1, 2, 3))
    assert tree.continuation(tree.match(NS, arr(1)), 10).tolist() == [2, 3, 4]
    assert tree.continuation(tree.match(NS, arr(1)), 2).tolist() == [2, 3]
    assert tree.continuation(tree.match(NS, arr(1, 2, 5, 9)), 10).tolist() == [6, 7]
    assert tree.continuation(tree.match(NS, arr(1, 2, 3, 4)), 10).tolist() == []
    tree.match(NS, arr(1, 2, 5))
    assert tree.continuation(tree.match(NS, arr()), 3).tolist() == [1, 2, 5]
    assert tree.continuation(tree.match("empty", arr(1)), 3).tolist() == []


def test_split_keeps_lock_and_pin_counts_on_both_halves():
    tree = RadixTree()
    node = insert(tree, NS, arr(1, 2, 3, 4), 0)
    tree.lock(node, +1)
    tree.pin(node, +1)
    upper = tree.split(node, 2)
    assert upper.tokens.tolist() == [1, 2] and node.tokens.tolist() == [3, 4]
    assert (upper.lock_ref, upper.pin_ref, node.lock_ref, node.pin_ref) == (1, 1, 1, 1)
    assert tree.pinned_tokens == 4
    tree.lock(node, -1)
    tree.pin(node, -1)
    assert (upper.lock_ref, upper.pin_ref) == (0, 0)
    assert tree.pinned_tokens == 0


def test_pinned_leaf_gets_a_child_instead_of_growing_so_pinned_tokens_stay_exact():
    tree = RadixTree()
    node = insert(tree, NS, arr(1, 2), 0)
    tree.pin(node, +1)
    child = insert(tree, NS, arr(1, 2, 3, 4), 2)
    assert child is not node
    assert tree.pinned_tokens == 2
    assert tree.evict(10).tolist() == [2, 3]
    assert tree.resident_tokens == 2


def test_evict_trims_a_leaf_from_its_tail_one_token_at_a_time():
    tree = RadixTree()
    insert(tree, NS, arr(1, 2, 3, 4), 0)
    assert tree.evict(1).tolist() == [3]
    assert tree.match(NS, arr(1, 2, 3, 4)).length == 3
    assert sorted(tree.evict(2).tolist()) == [1, 2]
    assert tree.match(NS, arr(1, 2, 3, 4)).length == 1
    assert tree.num_nodes == 1


def test_evict_takes_least_recently_matched_leaf_first():
    tree = RadixTree()
    insert(tree, NS, arr(1, 1), 0)
    insert(tree, NS, arr(2, 2), 2)
    insert(tree, NS, arr(3, 3), 4)
    tree.match(NS, arr(1, 1))
    assert sorted(tree.evict(2).tolist()) == [2, 3]
    assert tree.match(NS, arr(2, 2)).length == 0
    assert tree.match(NS, arr(1, 1)).length == 2
    assert tree.match(NS, arr(3, 3)).length == 2


def test_match_without_touch_leaves_lru_order_alone():
    tree = RadixTree()
    insert(tree, NS, arr(1), 0)
    insert(tree, NS, arr(2), 1)
    tree.match(NS, arr(1), touch=False)
    assert tree.evict(1).tolist() == [0]


def test_evict_continues_into_a_parent_once_its_children_are_gone():
    tree = RadixTree()
    insert(tree, NS, arr(1, 2, 3), 0)
    insert(tree, NS, arr(1, 2, 4), 3)
    assert sorted(tree.evict(4).tolist()) == [0, 1, 2, 3]
    assert tree.resident_tokens == 0
    assert tree.num_nodes == 0


def test_locked_path_is_never_evicted_and_eviction_stops_short():
    tree = RadixTree()
    node = insert(tree, NS, arr(1, 2, 3), 0)
    insert(tree, NS, arr(1, 9, 9), 3)
    tree.lock(tree.match(NS, arr(1, 2, 3)).node, +1)
    assert sorted(tree.evict(10).tolist()) == [3, 4]
    assert tree.match(NS, arr(1, 2, 3)).length == 3
    tree.lock(node, -1)
    assert len(tree.evict(10)) == 3


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    touches=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 4)), max_size=10),
    num_tokens=st.integers(0, 20),
)
def test_evict_order_is_exactly_least_recently_used_across_unrelated_leaves(lengths, touches, num_tokens):
    """Sequences with distinct first tokens are one leaf each, so LRU order is fully predictable."""
    tree = RadixTree()
    seqs, last_use, first_slot = [], [], 0
    for i, n in enumerate(lengths):
        seqs.append(np.array([i] * n, dtype=np.int32))
        insert(tree, NS, seqs[-1], first_slot)
        first_slot += n
        last_use.append(i)
    for step, (i, n) in enumerate(touches):
        if i < len(seqs):
            tree.match(NS, seqs[i][:n])
            last_use[i] = len(seqs) + step
    remaining = list(lengths)
    budget = num_tokens
    for i in sorted(range(len(seqs)), key=last_use.__getitem__):
        take = min(budget, remaining[i])
        remaining[i] -= take
        budget -= take
    assert len(tree.evict(num_tokens)) == num_tokens - budget
    assert [tree.match(NS, s, touch=False).length for s in seqs] == remaining


# ---- state machine against a reference model ---------------------------------------------------

tokens = st.lists(st.integers(0, 2), max_size=6).map(lambda xs: np.array(xs, dtype=np.int32))
namespaces = st.sampled_from(["a", "b", "c"])


def prefixes(namespace: str, ids) -> list[tuple[str, tuple[int, ...]]]:
    ids = [int(t) for t in ids]
    return [(namespace, tuple(ids[: i + 1])) for i in range(len(ids))]


class RadixMachine(RuleBasedStateMachine):
    inserted = Bundle("inserted")

    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree(self.make_policy())
        self.resident: dict[tuple[str, tuple[int, ...]], int] = {}
        self.free_slots: list[int] = []
        self.next_slot = 0
        self.locks: list[tuple[str, Node]] = []
        self.pins: list[tuple[str, Node]] = []

    def make_policy(self) -> EvictionPolicy:
        return LRU()

    # ---- reference helpers ----

    def key(self, node: Node):
        """Where the tree's eviction policy puts `node`: lower keys go first."""
        return self.tree.policy.key(node, self.tree.depth(node))

    def ref_match_length(self, namespace: str, ids: np.ndarray) -> int:
        n = 0
        for key in prefixes(namespace, ids):
            if key not in self.resident:
                break
            n += 1
        return n

    def alloc(self, n: int) -> np.ndarray:
        slots = []
        for _ in range(n):
            if self.free_slots:
                slots.append(self.free_slots.pop())
            else:
                slots.append(self.next_slot)
                self.next_slot += 1
        return np.array(slots, dtype=np.int32)

    def protected(self) -> set[tuple[str, tuple[int, ...]]]:
        """Tokens on the path to a locked or pinned node (a lock covers its whole node)."""
        out: set[tuple[str, tuple[int, ...]]] = set()
        for namespace, node in self.locks + self.pins:
            out.update(prefixes(namespace, self.tree.path(node)[0]))
        return out

    def walk(self) -> list[tuple[str, tuple[int, ...], Node]]:
        """Every non-root node with its namespace and full token path, checking the structure."""
        out = []
        for namespace, root in self.tree.roots.items():
            stack = [(root, ())]
            while stack:
                node, path = stack.pop()
                for first, child in node.children.items():
                    assert child.parent is node
                    assert len(child.tokens) == len(child.slots) > 0
                    assert int(child.tokens[0]) == first
                    child_path = path + tuple(int(t) for t in child.tokens)
                    out.append((namespace, child_path, child))
                    stack.append((child, child_path))
        return out

    # ---- rules ----

    @rule(target=inserted, namespace=namespaces, ids=tokens)
    def insert(self, namespace, ids):
        m = self.tree.match(namespace, ids)
        assert m.length == self.ref_match_length(namespace, ids)
        new = ids[m.length :]
        if len(new):
            slots = self.alloc(len(new))
            self.tree.extend(m, new, slots)
            for key, slot in zip(prefixes(namespace, ids)[m.length :], slots.tolist()):
                self.resident[key] = slot
        return namespace, ids

    @rule(target=inserted, seq=inserted, cut=st.integers(0, 6), suffix=tokens)
    def insert_branch(self, seq, cut, suffix):
        """Continue an inserted sequence, or branch off it, so that nodes grow and split."""
        namespace, ids = seq
        return self.insert(namespace, np.concatenate([ids[:cut], suffix]))

    @rule(seq=inserted, cut=st.integers(0, 6))
    def lock_prefix(self, seq, cut):
        self.lock(seq[0], seq[1][:cut])

    @rule(seq=inserted, cut=st.integers(0, 6))
    def pin_prefix(self, seq, cut):
        self.pin(seq[0], seq[1][:cut])

    @rule(namespace=namespaces, ids=tokens, touch=st.booleans())
    def match(self, namespace, ids, touch):
        m = self.tree.match(namespace, ids, touch=touch)
        assert m.length == self.ref_match_length(namespace, ids)
        expected = [self.resident[key] for key in prefixes(namespace, ids)[: m.length]]
        assert m.slots().tolist() == expected
        assert m.node.is_root == (m.length == 0)

    @rule(namespace=namespaces, ids=tokens, max_tokens=st.integers(0, 8))
    def continuation(self, namespace, ids, max_tokens):
        m = self.tree.match(namespace, ids, touch=False)
        path = tuple(int(t) for t in ids[: m.length])
        cont = tuple(self.tree.continuation(m, max_tokens).tolist())
        assert len(cont) <= max_tokens
        assert prefixes(namespace, path + cont) == [
            k for k in prefixes(namespace, path + cont) if k in self.resident
        ]
        if len(cont) < max_tokens:
            end = (namespace, path + cont)
            assert not any(k[0] == namespace and k[1][:-1] == end[1] for k in self.resident), "stopped early"

    @rule(namespace=namespaces, ids=tokens)
    def lock(self, namespace, ids):
        m = self.tree.match(namespace, ids)
        if m.length:
            self.tree.lock(m.node, +1)
            self.locks.append((namespace, m.node))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def release(self, data):
        _, node = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.tree.lock(node, -1)

    @rule(namespace=namespaces, ids=tokens)
    def pin(self, namespace, ids):
        m = self.tree.match(namespace, ids)
        if m.length:
            node = self.tree.split(m.node, m.node_offset)
            assert self.tree.path(node)[0].tolist() == [int(t) for t in ids[: m.length]]
            self.tree.pin(node, +1)
            self.pins.append((namespace, node))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        _, node = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.tree.pin(node, -1)

    @rule(num_tokens=st.integers(0, 8))
    def evict(self, num_tokens):
        protected = self.protected()
        evictable_leaves = {id(node): self.key(node) for _, _, node in self.walk() if node.evictable()}
        slot_owner = {slot: key for key, slot in self.resident.items()}
        slot_node = {int(s): node for _, _, node in self.walk() for s in node.slots}
        freed = self.tree.evict(num_tokens).tolist()

        assert len(freed) == len(set(freed))
        assert len(freed) == min(num_tokens, len(self.resident) - len(protected))
        evicted_nodes = {id(slot_node[s]): evictable_leaves.get(id(slot_node[s])) for s in freed}
        untouched = [t for i, t in evictable_leaves.items() if i not in evicted_nodes]
        first = [k for k in evicted_nodes.values() if k is not None]  # leaves before this eviction
        if first and untouched:
            assert max(first) <= min(untouched), "a leaf the policy ranks higher went first"
        for slot in freed:
            key = slot_owner[slot]
            assert key not in protected, f"evicted locked or pinned token {key}"
            del self.resident[key]
            self.free_slots.append(slot)
        for namespace, path in self.resident:
            assert len(path) == 1 or (namespace, path[:-1]) in self.resident, "hole in a prefix"

    # ---- invariants ----

    @invariant()
    def tree_equals_reference(self):
        nodes = self.walk()
        walked = {}
        for namespace, path, node in nodes:
            start = len(path) - len(node.tokens)
            for i, slot in enumerate(node.slots.tolist()):
                walked[(namespace, path[: start + i + 1])] = slot
            assert self.tree.namespace_of(node) == namespace
        assert walked == self.resident
        assert len(set(walked.values())) == len(walked), "two resident tokens share a slot"
        assert not set(walked.values()) & set(self.free_slots), "a resident token's slot is free"

    @invariant()
    def counters_match_a_full_walk(self):
        nodes = [node for _, _, node in self.walk()]
        assert self.tree.num_nodes == len(nodes)
        assert self.tree.resident_tokens == sum(len(n.tokens) for n in nodes)
        assert self.tree.pinned_tokens == sum(len(n.tokens) for n in nodes if n.pin_ref > 0)

    @invariant()
    def lock_and_pin_counts_equal_live_handles_below_each_node(self):
        expected_lock: dict[int, int] = {}
        expected_pin: dict[int, int] = {}
        for handles, counts in ((self.locks, expected_lock), (self.pins, expected_pin)):
            for _, node in handles:
                while not node.is_root:
                    counts[id(node)] = counts.get(id(node), 0) + 1
                    node = node.parent
        for _, _, node in self.walk():
            assert node.lock_ref == expected_lock.get(id(node), 0)
            assert node.pin_ref == expected_pin.get(id(node), 0)

    @invariant()
    def locked_and_pinned_tokens_stay_resident(self):
        assert self.protected() <= self.resident.keys()


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class GreedyDualRadixMachine(RadixMachine):
    """The same rules under GDSF; a short attention scale makes depth change the order."""

    def make_policy(self) -> EvictionPolicy:
        return GreedyDualFrequency(attention_tokens=4)


TestGreedyDualRadixMachine = GreedyDualRadixMachine.TestCase
TestGreedyDualRadixMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
