"""The snapshot room: where a request stops to copy its recurrent state, and what its plan takes.

No model here: the state is a byte tensor and `capture` a stand-in for the bridge's, so each test
pins down the policy alone (`tests/test_hybrid.py` proves the snapshots exact on real models).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvblocks.cache.layout import KVLayout, LayerSpec, StateLayout
from kvblocks.cache.namespace import Namespace
from kvblocks.cache.resident import Resident
from kvblocks.cache.snapshots import SnapshotPlan, Snapshots

STATE = StateLayout.packed([(0, "recurrent", 0, (4,), torch.float32)])
LAYOUT = KVLayout(torch.float32, (LayerSpec("full", 1, 2),))


def room(
    every: int = 8, min_prefill: int = 1, state: StateLayout | None = STATE, capacity: int = 64
) -> Snapshots:
    return Snapshots(state, every, min_prefill, Resident(LAYOUT, capacity, "cpu", 0, None, None))


def blob(value: float) -> torch.Tensor:
    return torch.full((4,), value, dtype=torch.float32).view(torch.uint8)


class Past:
    """A stand-in for a framework cache: the state it would hand to `capture`."""

    def __init__(self) -> None:
        self.position = 0


def capture(past: Past) -> torch.Tensor:
    return blob(float(past.position))


def test_prefill_stops_every_n_tokens_at_the_branch_point_and_before_the_last_prompt_token():
    assert room(every=8).points(0, 20, 5) == [5, 8, 16, 19, 20]


def test_points_closer_than_min_prefill_are_merged_away():
    # 2 tokens per forward at least: 15 is 1 after 14 and 1 before 16, so the stops skip it
    assert room(every=0, min_prefill=2).points(10, 16, 15) == [14, 16]


def test_a_model_without_recurrent_state_gets_an_empty_plan_that_takes_nothing():
    snapshots = room(state=None)
    assert snapshots.points(0, 100, 40) == [] and not snapshots.wants(256)
    plan = snapshots.plan(0, 100, 40, capture)
    past = Past()
    for past.position in range(1, 101):
        plan.after_forward(past.position, past)
    plan.at_end(100, past)
    assert plan.positions == [] and plan.stops(0, 100) == [100]


def test_one_call_per_forward_takes_the_state_at_points_and_every_n_decoded_tokens():
    plan = room(every=8).plan(0, 10, 0, capture)
    assert plan.stops(0, 10) == [8, 9, 10]
    past = Past()
    for past.position in [8, 9, 10, 11, 12, 16, 16, 17]:  # prefill stops, then decoding
        plan.after_forward(past.position, past)
    assert plan.positions == [8, 9, 10, 16]  # each once, though 16 was reported twice
    assert torch.equal(plan.taken[16], blob(16.0))


def test_the_request_end_is_taken_whatever_the_policy_and_only_once():
    plan = room(every=0).plan(0, 4, 0, capture)
    past = Past()
    past.position = 7
    plan.at_end(7, past)
    plan.at_end(7, past)
    assert plan.positions == [7] and list(plan.taken) == [7]


def test_hand_over_gives_every_taken_state_and_keeps_those_past_the_insert():
    plan = room(every=4).plan(0, 2, 0, capture)
    past = Past()
    for past.position in (1, 2, 4, 8):
        plan.after_forward(past.position, past)
    assert sorted(plan.hand_over(4)) == [1, 2, 4, 8]
    assert list(plan.taken) == [8] and plan.positions == [1, 2, 4, 8]


def test_a_stepwise_model_skips_points_before_its_first_exact_state():
    plan = room(every=4).plan(0, 12, 0, capture)
    plan.skip_before(6)
    assert plan.stops(0, 12) == [8, 11, 12]


def test_snapshot_is_stored_only_at_a_resident_node_and_read_back_exactly():
    snapshots = room()
    r = snapshots._resident
    ns = Namespace("m", "float32")
    ids = np.arange(1, 9, dtype=np.int64)
    with r.lock:
        assert not snapshots.store(ns, ids, blob(1.0))  # nothing resident yet
        r.store(ns, ids, lambda a, b: [torch.zeros(b - a, 2, 1, 2)])
        assert snapshots.store(ns, ids[:5], blob(5.0))
        assert not snapshots.store(ns, ids[:5], blob(6.0))  # one per node: the first stays
        assert torch.equal(snapshots.read(ns.key, ids[:5]), blob(5.0))
        assert snapshots.read(ns.key, ids[:4]) is None
    assert r.counters.total.snapshots_stored == 1


def test_negative_snapshot_every_is_rejected():
    with pytest.raises(ValueError, match="snapshot_every"):
        room(every=-1)


def test_the_empty_plan_is_the_default_of_a_request_without_a_cache():
    plan = SnapshotPlan()
    plan.after_forward(3, Past())
    assert plan.positions == [] and plan.hand_over(3) == {}
