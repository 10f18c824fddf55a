"""The tokenising gate (`bounds.FairGate`): bounded, shared fairly by tenant and weight, and never
left short of a place by a waiter that went away."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from server_proc import tiny_model_dir
from transformers import AutoTokenizer

from kvblocks.engine.ledger import TenantLedger
from kvblocks.server.bounds import FairGate, char_limit, tokenizing
from kvblocks.server.state import Served, ServerConfig


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def hold(gate: FairGate, tenant: str, order: list[str], release: asyncio.Event) -> None:
    async with gate.place(tenant):
        order.append(tenant)
        await release.wait()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class Clock:
    """Virtual seconds for the gate: a hold lasts exactly what the test says, however loaded the
    machine is (a real sleep of 20 ms took 50 ms under CI load and reordered the turns)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def hold(self, seconds: float) -> None:
        await settle()
        self.now += seconds


def test_places_go_round_robin_across_waiting_tenants_not_in_arrival_order():
    async def scenario() -> list[str]:
        clock = Clock()
        gate, order = FairGate(1, clock=clock), []

        async def job(tenant: str, seconds: float, after: asyncio.Event | None = None) -> None:
            async with gate.place(tenant):
                order.append(tenant)
                if after is not None:
                    await after.wait()
                await clock.hold(seconds)

        queued = asyncio.Event()
        first = asyncio.create_task(job("a", 0.02, queued))
        await settle()
        later = [asyncio.create_task(job("a", 0.02)) for _ in range(4)]
        later += [asyncio.create_task(job("b", 0.03)) for _ in range(2)]
        await settle()
        assert gate.waiting("a") == 4 and gate.waiting("b") == 2
        queued.set()
        await asyncio.gather(first, *later)
        return order

    assert run(scenario()) == ["a", "b", "a", "b", "a", "a", "a"]


def test_a_tenant_holding_its_share_waits_while_another_tenant_waits():
    async def scenario() -> list[str]:
        gate, order = FairGate(2), []
        go_a, go_b = asyncio.Event(), asyncio.Event()
        held = [asyncio.create_task(hold(gate, "a", order, go_a)) for _ in range(2)]
        await settle()
        assert gate.holding["a"] == 2  # alone, one tenant may hold every place
        more_a = [asyncio.create_task(hold(gate, "a", order, go_a)) for _ in range(3)]
        await settle()
        b = asyncio.create_task(hold(gate, "b", order, go_b))
        await settle()
        go_a.set()  # both of a's holders end; a's three waiters and b compete for two places
        go_b.set()
        await asyncio.gather(*held, *more_a, b)
        return order

    order = run(scenario())
    assert order[2] == "b"  # b was served the first place that freed, ahead of a's older waiters


def test_weights_share_places_in_proportion():
    async def scenario() -> list[str]:
        weights = {"heavy": 3.0, "light": 1.0}
        clock = Clock()
        gate, order = FairGate(1, weights.__getitem__, clock=clock), []

        async def job(tenant: str) -> None:
            async with gate.place(tenant):
                order.append(tenant)
                await clock.hold(0.01)

        await asyncio.gather(*(job(t) for t in ["heavy"] * 12 + ["light"] * 12))
        return order

    order = run(scenario())
    first = order[:12]
    assert 7 <= first.count("heavy") <= 10, order  # 3:1 of equal-length jobs: about 9 of 12


def test_a_cancelled_waiter_leaves_the_line_and_a_cancelled_holder_frees_its_place():
    async def scenario() -> FairGate:
        gate, order, go = FairGate(1), [], asyncio.Event()
        holder = asyncio.create_task(hold(gate, "a", order, go))
        await settle()
        waiter = asyncio.create_task(hold(gate, "b", order, go))
        await settle()
        waiter.cancel()
        holder.cancel()
        await asyncio.gather(holder, waiter, return_exceptions=True)
        assert not gate.holding and not gate.waiting("b")
        go.set()
        await hold(gate, "c", order, go)  # the place is free again
        return gate

    gate = run(scenario())
    assert not gate.holding


def test_the_time_held_is_charged_to_the_tenant():
    charged: list[tuple[str, float]] = []

    async def scenario() -> None:
        gate = FairGate(2, charge=lambda tenant, seconds: charged.append((tenant, seconds)))
        async with gate.place("a"):
            await asyncio.sleep(0.05)

    run(scenario())
    assert [t for t, _ in charged] == ["a"] and charged[0][1] >= 0.04


def test_a_tenant_back_from_idle_saved_up_no_credit():
    async def scenario() -> list[str]:
        clock = Clock()
        gate, order = FairGate(1, clock=clock), []

        async def job(tenant: str, seconds: float) -> None:
            async with gate.place(tenant):
                order.append(tenant)
                await clock.hold(seconds)

        await job("idle", 0.0)
        await asyncio.gather(*(job("busy", 0.02) for _ in range(3)))  # busy's clock moves on
        order.clear()
        await asyncio.gather(*(job("busy", 0.01) for _ in range(3)), *(job("idle", 0.01) for _ in range(3)))
        return order

    order = run(scenario())
    assert "".join(t[0] for t in order) not in ("bbbiii", "biiibb", "iiibbb"), order


@pytest.mark.parametrize(
    ("token_bytes", "context", "limit"), [(81, 256, 20736), (None, 256, None), (81, None, None)]
)
def test_char_limit_is_the_context_times_the_longest_token(token_bytes, context, limit):
    assert char_limit(token_bytes, context) == limit


def test_a_tenants_time_at_the_gate_is_charged_at_the_engines_rate_of_work():
    ledger = TenantLedger()
    ledger.ran(100, 0.5)  # the engine does 200 tokens a second
    served = Served(SimpleNamespace(ledger=ledger), ServerConfig("tiny"))
    asyncio.run(tokenizing(served.tokenize_gate, "acme", time.sleep, 0.05))
    assert 9 <= ledger.work("acme") <= 40 and ledger.work("other") == 0


def test_resending_a_long_cached_prompt_costs_a_tenant_far_fewer_tokens_than_it_tokenizes():
    """A victim's every request re-tokenizes its long system prompt, of which the engine computes
    one token (a cache hit). Charged as tokens tokenized it looked busier than a flooder, and the
    fair rules then favoured the flooder (issue 41): the gate's time is the engine's time."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    text = "You are a support agent for refunds, shipping and invoices. " * 200
    ledger = TenantLedger()
    ledger.ran(80, 0.2)  # the engine does 400 tokens a second
    served = Served(SimpleNamespace(ledger=ledger), ServerConfig("tiny"))
    ids = asyncio.run(tokenizing(served.tokenize_gate, "victim", tokenizer, text))
    assert len(ids["input_ids"]) > 2000
    assert 0 < ledger.work("victim") < 0.05 * len(ids["input_ids"])
