"""The scheduler decides from token counts alone: budget order, the head-of-line rule, invariant
cuts and the preemption victim, with no model and no forward."""

from __future__ import annotations

import torch
from tiny_models import tiny_model

from kvblocks import GenerationParams, KVCacheTrie
from kvblocks.engine.admission import WaitingRoom
from kvblocks.engine.request import Options, Request
from kvblocks.engine.scheduler import FULL_BATCH_TOKENS, BatchLimits, Scheduler
from kvblocks.engine.sequence import Sequence
from kvblocks.engine.slots import SlotManager
from kvblocks.generate.decoding import Decoding
from kvblocks.generate.text import IdTokenizer, StopTextAssembler


def scheduler(**limits) -> Scheduler:
    model = tiny_model("llama", torch.float32)
    slots = SlotManager(KVCacheTrie.for_model(model, capacity_tokens=256))
    failed = []
    return Scheduler(WaitingRoom(), slots, BatchLimits(**limits), lambda s, exc, phase: failed.append(exc))


def sequence(prompt: int, computed: int = 0, generated: int = 0, admitted_at: int = 0) -> Sequence:
    params = GenerationParams()
    out = Decoding(
        list(range(prompt)), params, 64, StopTextAssembler(IdTokenizer()), None, None, frozenset(), 0.0
    )
    out.generated.extend([1] * generated)
    s = Sequence(
        Request(out.prompt_ids, Options(params), lambda item: None), out, None, out.prompt_ids + out.generated
    )
    s.computed, s.admitted_at = computed, admitted_at
    return s


def everything(s, take, budget, batch) -> int:
    return take


def test_decodes_come_first_then_the_shortest_prefill_under_the_budget():
    sched = scheduler(max_batch_tokens=10, chunk=64)
    decode, short, long = sequence(8, 8, generated=1), sequence(6), sequence(40)
    sched.running = [long, short, decode]
    assert sched.schedule(everything) == [(decode, 1), (short, 6), (long, 3)]


def test_a_first_token_one_short_step_away_holds_long_prefills_back_a_bounded_number_of_steps():
    sched = scheduler(max_batch_tokens=100, chunk=4, max_wait_steps=2)
    near, long = sequence(3), sequence(40)
    sched.running = [long, near]
    assert sched.schedule(everything) == [(near, 3)]
    near.computed = 0  # still one short step away: the long prefill sits out its second step
    assert sched.schedule(everything) == [(near, 3)]
    assert (long, 40) in sched.schedule(everything)  # its third step it runs anyway


def test_a_full_batch_with_nobody_waiting_takes_the_full_batch_budget():
    sched = scheduler(max_batch_size=2, max_batch_tokens=10, full_batch_tokens=30, chunk=64)
    decode, long = sequence(8, 8, generated=1), sequence(40)
    sched.running = [long, decode]
    assert sched.schedule(everything) == [(decode, 1), (long, 29)]
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
