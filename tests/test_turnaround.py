"""Turnarounds: a lighter tenant's quick next request is waited for (up to a share of a step), a slow
one is not, and what the engine learns is the tenant's own turnaround. Virtual clock, no model."""

from __future__ import annotations

from kvblocks.engine.turnaround import WAIT_SHARE, WAIT_SLACK_S, Turnarounds


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def learnt(gap: float, step_s: float = 0.24) -> tuple[Turnarounds, Clock]:
    """Turnarounds that saw `victim` come back `gap` seconds after a reply, then end another reply now."""
    clock = Clock()
    turns = Turnarounds(clock)
    turns.stepped(step_s)
    turns.reply_ended("victim")
    turns.arrived("victim", clock.now + gap)
    clock.now += 1.0
    turns.reply_ended("victim")
    return turns, clock


def test_a_tenant_that_came_back_quickly_is_waited_for_one_and_a_half_turnarounds():
    turns, clock = learnt(0.02)
    clock.now += 0.01
    tenants, seconds = turns.due(["victim"])
    assert tenants == {"victim"}
    assert abs(seconds - (1.5 * 0.02 + WAIT_SLACK_S - 0.01)) < 1e-9


def test_the_wait_is_at_most_a_share_of_a_step():
    turns, _ = learnt(0.05, step_s=0.24)  # 1.5x it is more than the share
    tenants, seconds = turns.due(["victim"])
    assert tenants == {"victim"} and abs(seconds - WAIT_SHARE * 0.24) < 1e-9


def test_once_the_window_passed_nobody_is_waited_for_and_the_slower_turnaround_is_learnt():
    turns, clock = learnt(0.02)
    clock.now += 0.1
    assert turns.due(["victim"]) == (set(), 0.0)
    clock.now += 0.3  # past a step: the reply end is forgotten, the turnaround is at least that
    turns.due([])
    assert "victim" not in turns.ended and turns.gaps["victim"] > 0.3
    turns.reply_ended("victim")
    assert turns.due(["victim"]) == (set(), 0.0)  # too slow to wait for now


def test_a_tenant_never_seen_coming_back_or_not_a_candidate_is_not_waited_for():
    clock = Clock()
    turns = Turnarounds(clock)
    turns.stepped(0.24)
    turns.reply_ended("new")
    assert turns.due(["new"]) == (set(), 0.0)  # no turnaround learnt yet
    turns, _ = learnt(0.02)
    assert turns.due([]) == (set(), 0.0)  # the scheduler did not name it (not lighter)


def test_nothing_is_waited_for_before_a_step_was_timed():
    clock = Clock()
    turns = Turnarounds(clock)
    turns.reply_ended("victim")
    turns.arrived("victim", clock.now + 0.01)
    turns.reply_ended("victim")
    assert turns.due(["victim"]) == (set(), 0.0)


def test_a_request_sent_before_the_reply_ended_teaches_no_turnaround():
    clock = Clock()
    turns = Turnarounds(clock)
    turns.reply_ended("victim")
    turns.arrived("victim", clock.now - 1.0)
    assert "victim" not in turns.gaps and "victim" not in turns.ended
