"""The scheduler decides from token counts alone: budget order, the head-of-line rule, invariant
cuts, tenants' prefill shares and the preemption victim, with no model and no forward."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from kvblocks import GenerationParams, KVCacheTrie
from kvblocks.engine.admission import TenantLimits, WaitingRoom
from kvblocks.engine.ledger import TenantLedger
from kvblocks.engine.request import Options, Request
from kvblocks.engine.scheduler import CHUNK, FULL_BATCH_TOKENS, NEAR, RECENT_S, BatchLimits, Scheduler
from kvblocks.engine.sequence import Sequence
from kvblocks.engine.slots import SlotManager
from kvblocks.engine.turnaround import Turnarounds
from kvblocks.generate.decoding import Decoding
from kvblocks.generate.text import IdTokenizer, StopTextAssembler


def scheduler(room: WaitingRoom | None = None, **limits) -> Scheduler:
    """A scheduler over a pool large enough that every step's slots are reserved without preemption."""
    model = tiny_model("llama", torch.float32)
    slots = SlotManager(KVCacheTrie.for_model(model, capacity_tokens=4096))
    room = room if room is not None else WaitingRoom()
    return Scheduler(room, slots, BatchLimits(**limits), sequences=lambda request: request.sequence)


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def sequence(
    prompt: int, computed: int = 0, generated: int = 0, admitted_at: int = 0, tenant: str = ""
) -> Sequence:
    params = GenerationParams()
    out = Decoding(
        list(range(prompt)), params, 64, StopTextAssembler(IdTokenizer()), None, None, frozenset(), 0.0
    )
    out.generated.extend([1] * generated)
    request = Request(out.prompt_ids, Options(params), lambda item: None, tenant=tenant)
    s = Sequence(request, out, None, out.prompt_ids + out.generated)
    s.computed, s.admitted_at = computed, admitted_at
    return s


def test_decodes_come_first_then_the_shortest_prefill_under_the_budget():
    sched = scheduler(max_batch_tokens=10, chunk=64)
    decode, short, long = sequence(8, 8, generated=1), sequence(6), sequence(40)
    sched.running = [long, short, decode]
    assert sched.schedule().batch == [(decode, 1), (short, 6), (long, 3)]


def test_a_first_token_one_short_step_away_holds_long_prefills_back_a_bounded_number_of_steps():
    sched = scheduler(max_batch_tokens=100, chunk=4, max_wait_steps=2)
    near, long = sequence(3), sequence(NEAR + 20)
    sched.running = [long, near]
    assert sched.schedule().batch == [(near, 3)]
    near.computed = 0  # still one short step away: the long prefill sits out its second step
    assert sched.schedule().batch == [(near, 3)]
    assert (long, NEAR + 20) in sched.schedule().batch  # its third step it runs anyway


def test_a_full_batch_with_nobody_waiting_takes_the_full_batch_budget():
    sched = scheduler(max_batch_size=2, max_batch_tokens=10, full_batch_tokens=30, chunk=64)
    decode, long = sequence(8, 8, generated=1), sequence(40)
    sched.running = [long, decode]
    assert sched.schedule().batch == [(decode, 1), (long, 29)]
    sched.running = [long]  # a free place: a request may arrive and want its first token soon
    assert sched.budget() == 10
    sched.running = [long, decode]
    sched.room.put_all("", [sequence(5).request])  # one waits for a place
    assert sched.budget() == 10
    small = scheduler(max_batch_size=1, max_batch_tokens=10, full_batch_tokens=4)
    small.running = [sequence(5)]
    assert small.budget() == 10  # never below max_batch_tokens


def test_the_server_default_full_batch_budget_is_the_schedulers():
    from kvblocks.cli.commands import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.full_batch_tokens == FULL_BATCH_TOKENS > args.max_batch_tokens


def test_invariant_mode_takes_up_to_the_last_cut_the_budget_reaches():
    sched = scheduler(max_batch_tokens=70, chunk=16, invariant=True)
    s = sequence(100, computed=10)
    assert sched.take_tokens(s, 40) == 38  # cuts at 16, 32, 48: 48 - 10
    assert sched.take_tokens(s, 5) == 0  # the next cut (16) is 6 away


def test_the_victim_is_the_youngest_running_request_outside_the_batch():
    sched = scheduler()
    old, young, youngest, me = (sequence(4, admitted_at=i) for i in range(4))
    sched.running = [old, young, youngest, me]
    assert sched.victim(me, batch=[(youngest, 1)]) is young
    assert sched.victim(me, batch=[(old, 1), (young, 1), (youngest, 1)]) is None


# ---- tenants' shares of a step ------------------------------------------------------------------


def test_a_flooders_prefill_is_bounded_by_its_share_while_another_tenant_waits():
    sched = scheduler(max_batch_tokens=80, chunk=8)
    flood = [sequence(200, tenant="flood", admitted_at=i) for i in range(2)]
    decode = sequence(8, 8, generated=1, tenant="flood")
    sched.running = [*flood, decode]
    sched.room.put_all("victim", [sequence(20, tenant="victim").request])
    batch = sched.schedule().batch
    assert batch == [(decode, 1), (flood[0], 39)]  # half of what the decode leaves
    assert sum(n for s, n in batch if s.request.tenant == "flood" and s.left > 1) <= 79 // 2


def test_a_flooder_alone_takes_the_whole_budget():
    sched = scheduler(max_batch_tokens=80, chunk=8)
    flood = [sequence(200, tenant="flood", admitted_at=i) for i in range(2)]
    sched.running = list(flood)
    sched.room.put_all("flood", [sequence(20, tenant="flood").request])  # its own line is no one else
    assert sched.schedule().batch == [(flood[0], 80)]


def test_a_victims_prefill_runs_beside_the_flooders_share():
    sched = scheduler(max_batch_tokens=80, chunk=8)
    flood, victim = sequence(200, tenant="flood"), sequence(300, tenant="victim", admitted_at=1)
    sched.running = [flood, victim]
    assert sorted(sched.schedule().batch, key=lambda b: b[0].request.tenant) == [
        (flood, 40),
        (victim, 40),
    ]


def test_weights_set_the_prefill_shares():
    limits = {"gold": TenantLimits(weight=3.0)}
    room = WaitingRoom(limits_of=lambda t: limits.get(t, TenantLimits()))
    sched = scheduler(room, max_batch_tokens=80, chunk=8)
    gold, bronze = sequence(200, tenant="gold"), sequence(200, tenant="bronze")
    sched.running = [gold, bronze]
    assert sched.prefill_shares(80) == {"gold": 60, "bronze": 20}
    assert sorted(n for _, n in sched.schedule().batch) == [20, 60]


def test_a_tenant_served_moments_ago_still_bounds_the_flooder_and_later_does_not():
    clock = Clock()
    room = WaitingRoom(ledger=TenantLedger(clock=clock))
    sched = scheduler(room, max_batch_tokens=80, chunk=8)
    flood = sequence(400, tenant="flood")
    sched.running = [flood]
    room.ledger.charge("victim", 5)  # its reply just ended; its next request is moments away
    assert sched.schedule().batch == [(flood, 40)]
    clock.now += RECENT_S + 0.1
    assert sched.schedule().batch == [(flood, 80)]


def test_each_step_charges_its_tokens_to_the_tenant_they_were_for():
    sched = scheduler(
        WaitingRoom(ledger=TenantLedger(clock=Clock())), max_batch_tokens=80, chunk=8
    )  # no decay
    sched.running = [sequence(30, tenant="a"), sequence(8, 8, generated=1, tenant="b")]
    sched.schedule()
    assert sched.room.ledger.work("a") == pytest.approx(30, rel=1e-3)
    assert sched.room.ledger.work("b") == pytest.approx(1, rel=1e-3)


def test_the_pool_preemption_victim_is_the_busiest_tenants_youngest():
    sched = scheduler()
    flood_old, flood_young = (
        sequence(4, tenant="flood", admitted_at=1),
        sequence(4, tenant="flood", admitted_at=2),
    )
    newcomer, me = sequence(4, tenant="victim", admitted_at=3), sequence(4, tenant="flood", admitted_at=4)
    sched.running = [flood_old, flood_young, newcomer, me]
    sched.room.ledger.charge("flood", 5000)
    assert sched.victim(me, batch=[]) is flood_young


def test_a_victims_first_token_does_not_wait_behind_a_flooders_short_prompts():
    sched = scheduler(max_batch_tokens=80, chunk=64)
    decode = sequence(8, 8, generated=1, tenant="flood")
    short = sequence(40, computed=10, tenant="flood", admitted_at=1)  # 30 left: a first token near too
    victim = sequence(300, computed=299, tenant="victim", admitted_at=2)  # its prompt cached but one
    sched.running = [short, victim, decode]
    sched.room.ledger.charge("flood", 5000)
    assert sched.schedule().batch == [(decode, 1), (victim, 1)]
    victim.out.generated.append(1)  # its first token came: the flooder's prompt goes on
    assert (short, 30) in sched.schedule().batch


# ---- the step in flight while a lighter tenant waits on it (issue 41's fairness target) ---------------


def server_defaults(room: WaitingRoom | None = None) -> Scheduler:
    """The server's CPU scheduler: batch-invariant cuts, 80 tokens a step, one cut while contended."""
    return scheduler(room, max_batch_tokens=80, invariant=True, chunk=CHUNK, contended_prefill=CHUNK)


def prefill_of(batch, tenant: str) -> int:
    return sum(n for s, n in batch if s.request.tenant == tenant and n > 1)


def test_the_invariant_cut_is_the_kernel_width_and_far_below_a_step():
    from kvblocks.engine import kernel

    assert CHUNK == kernel.MAX_WIDTH  # every prompt row is attended by one kernel where it builds
    assert CHUNK <= 80 // 4  # one cut is a small part of the server's default step


def test_a_flooders_step_is_one_cut_while_a_lighter_tenant_waits_on_it_and_its_first_token_is_the_next():
    """The victim's request arrives during the step in flight and waits for it: with the flooder's
    long prompts running, that step holds one cut of the flooder's prefill (not its half of the
    step, 64 tokens before), and the victim's first token comes in the very next step."""
    sched = server_defaults()
    flood = [sequence(90, tenant="flood", admitted_at=i) for i in range(4)]
    sched.running = list(flood)
    sched.room.ledger.charge("flood", 5000)
    sched.room.ledger.charge("victim", 20)  # its last reply just ended; the next request is moments away
    for _ in range(3):  # the flooder's steps while the victim is between requests
        batch = sched.schedule().batch
        assert 0 < prefill_of(batch, "flood") <= CHUNK
        for s, n in batch:
            s.computed += n
    victim = sequence(300, computed=299, tenant="victim", admitted_at=9)  # a cached prompt but one token
    sched.running.append(victim)
    batch = sched.schedule().batch
    assert (victim, 1) in batch and prefill_of(batch, "flood") == 0  # its first token: the next step


def test_a_flooder_alone_or_beside_an_equal_one_keeps_its_whole_share():
    sched = server_defaults()
    flood = sequence(400, tenant="flood")
    sched.running = [flood]
    assert sched.schedule().batch == [(flood, 80)]  # nobody else: the whole budget
    other = sequence(400, tenant="other", admitted_at=1)
    sched.running = [flood, other]
    sched.room.ledger.charge("other", sched.room.ledger.work("flood"))
    assert [n for _, n in sched.schedule().batch] == [32, 32]  # both prefilling: half each, in cuts


def test_the_lighter_tenant_keeps_its_share_beside_a_heavier_ones_decodes():
    sched = server_defaults()
    decode = sequence(8, 8, generated=1, tenant="flood")
    victim = sequence(300, tenant="victim", admitted_at=1)  # a long new prompt, not a first token near
    sched.running = [decode, victim]
    sched.room.ledger.charge("flood", 5000)
    assert sched.schedule().batch == [(decode, 1), (victim, 32)]  # its half, in cuts: not one cut


def test_the_cpu_engine_bounds_a_contended_step_to_one_cut_and_the_limits_default_does_not():
    from kvblocks import CachedGenerator
    from kvblocks.engine.batch import BatchEngine

    model = tiny_model("llama", torch.float32)
    engine = BatchEngine(
        CachedGenerator(model, IdTokenizer(), KVCacheTrie.for_model(model, 256)), invariant=True
    )
    assert engine.scheduler.limits.contended_prefill == engine.scheduler.limits.chunk == CHUNK
    assert BatchLimits().contended_prefill == 0  # off the CPU: shares only


def test_a_request_alone_without_room_waits_while_the_serial_runner_holds_the_pool():
    """The serial runner's requests hold locked prefixes until they end: a packed request alone that
    finds no room waits for them (it failed as 'the pool is full of pinned prefixes' in the soak's
    attack phase); with nothing running anywhere, it fails."""
    model = tiny_model("llama", torch.float32)
    for serial_active, fails in ((1, False), (0, True)):
        slots = SlotManager(KVCacheTrie.for_model(model, capacity_tokens=32))
        sched = Scheduler(
            WaitingRoom(), slots, BatchLimits(), lambda r: r.sequence, None, lambda n=serial_active: n
        )
        s = sequence(100)
        sched.running = [s]
        step = sched.schedule()
        assert step.batch == [] and bool(step.failed) is fails and (s in sched.running) is not fails


def test_the_step_after_a_lighter_tenants_reply_ends_holds_no_busier_prefill():
    """The victim's next request arrives during the step after its reply: that step is decodes only
    for the flooder, so the step in flight is short; the step after is the flooder's cut again."""
    sched = server_defaults()
    flood = [sequence(90, tenant="flood", admitted_at=i) for i in range(2)]
    decode = sequence(8, 8, generated=1, tenant="flood", admitted_at=2)
    victim = sequence(10, 10, generated=3, tenant="victim", admitted_at=3)
    sched.running = [*flood, decode, victim]
    sched.room.ledger.charge("flood", 5000)
    sched.room.ledger.charge("victim", 20)
    sched.finished(victim)  # its last token came in the step before
    batch = sched.schedule().batch
    assert prefill_of(batch, "flood") == 0 and (decode, 1) in batch
    assert 0 < prefill_of(sched.schedule().batch, "flood") <= CHUNK


def test_a_tenant_as_busy_as_the_one_whose_reply_ended_keeps_its_prefill():
    sched = server_defaults()
    other = sequence(90, tenant="other")
    ended = sequence(10, 10, generated=3, tenant="agent", admitted_at=1)
    sched.running = [other, ended]
    sched.room.ledger.charge("other", 300)
    sched.room.ledger.charge("agent", 200)
    sched.finished(ended)
    assert prefill_of(sched.schedule().batch, "other") > 0


def flooded_with_a_quick_victim(clock: Clock) -> Scheduler:
    """The server's scheduler with a flooder's prefills and decodes running and a victim whose reply
    just ended, having come back 20 ms after its previous one; steps take 240 ms."""
    sched = server_defaults()
    sched.turns = Turnarounds(clock)
    sched.turns.stepped(0.24)
    flood = [sequence(90, tenant="flood", admitted_at=i) for i in range(2)]
    flood += [sequence(8, 8, generated=1, tenant="flood", admitted_at=2 + i) for i in range(4)]
    sched.room.ledger.charge("flood", 5000)
    sched.room.ledger.charge("victim", 20)
    for turn in range(2):
        victim = sequence(10, 10, generated=3, tenant="victim", admitted_at=9 + turn)
        victim.request.submitted = clock.now + 0.02 if turn else clock.now
        sched.running = [*flood, victim]
        if turn:
            sched.turns.arrived("victim", victim.request.submitted)  # its request was admitted
            clock.now += 1.0
        sched.finished(victim)
    return sched


def test_the_step_after_a_quick_lighter_tenants_reply_waits_for_its_next_request_a_share_of_a_step():
    """A step is mostly fixed cost on the CPU (every weight read once): the victim's next request,
    moments after its reply, would wait for nearly a whole flooder step however few tokens it held.
    The engine holds the step for 1.5x the victim's last turnaround instead, at most a quarter step."""
    clock = Clock()
    sched = flooded_with_a_quick_victim(clock)
    clock.now += 0.005
    tenants, seconds = sched.hold()
    assert tenants == {"victim"} and 0 < seconds <= 0.25 * 0.24
    assert abs(seconds - (1.5 * 0.02 + 0.005 - 0.005)) < 1e-9
    clock.now += seconds
    assert sched.hold() == (set(), 0.0)  # it did not come in time: the flooder's step goes ahead


def test_no_hold_for_a_tenant_as_busy_as_those_with_work_or_with_nobody_working_or_off_the_cpu():
    clock = Clock()
    sched = flooded_with_a_quick_victim(clock)
    sched.room.ledger.charge("victim", 5000)  # as busy as the flooder: no one yields to it
    assert sched.hold() == (set(), 0.0)
    sched = flooded_with_a_quick_victim(clock)
    sched.running = []
    assert sched.hold() == (set(), 0.0)  # an idle engine starts a step as soon as the request comes
    assert sched.hold(["flood"])[0] == {"victim"}  # the serial runner's work counts as work
    sched = flooded_with_a_quick_victim(clock)
    sched.limits = BatchLimits(contended_prefill=0)
    assert sched.hold() == (set(), 0.0)


def test_a_tenant_with_another_request_running_is_not_waited_for():
    clock = Clock()
    sched = flooded_with_a_quick_victim(clock)
    other = sequence(10, 10, generated=1, tenant="victim", admitted_at=20)
    sched.running.append(other)
    assert sched.hold() == (set(), 0.0)


def test_a_lighter_tenants_first_token_step_holds_no_busier_decodes_and_the_next_step_has_them():
    """Rows cost little beside a step's fixed cost, but eight decodes still made the victim's own
    step about 1.3x its step alone; a tenant alone keeps every decode (work-conserving)."""
    sched = server_defaults()
    decodes = [sequence(8, 8, generated=1, tenant="flood", admitted_at=i) for i in range(8)]
    victim = sequence(300, computed=299, tenant="victim", admitted_at=9)
    sched.running = [*decodes, victim]
    sched.room.ledger.charge("flood", 5000)
    sched.room.ledger.charge("victim", 20)
    assert sched.schedule().batch == [(victim, 1)]
    victim.computed = 300  # its first token came: it decodes beside the flooder's decodes again
    victim.out.generated.append(1)
    victim.sequence.append(1)
    assert len(sched.schedule().batch) == 9
    alone = server_defaults()
    near = sequence(40, tenant="flood", admitted_at=9)
    alone.running = [*decodes, near]
    alone.room.ledger.charge("flood", 5000)
    assert len(alone.schedule().batch) == 9
