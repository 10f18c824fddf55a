"""The waiting room: bounded per tenant and in total, refused whole, admitted in weighted fair order.

Unit properties of `WaitingRoom`, then the batched engine's admission (driven step by step), then
the server over real HTTP with the openai client: caps on prompts and branches are 400s naming the
parameter, a full queue is a 429 with Retry-After, and a flooding tenant cannot hold up another.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import openai
import pytest
import torch
from server_proc import start_server, stop_cleanly, tiny_model_dir
from tiny_models import tiny_model

from kvblocks import CachedGenerator, GenerationParams, KVCacheTrie
from kvblocks.engine.admission import QueueFullError, RoomLimits, TenantLimits, WaitingRoom
from kvblocks.engine.batch import BatchEngine
from kvblocks.engine.scheduler import RECENT_S
from kvblocks.generate.text import IdTokenizer


@dataclass(eq=False)
class Item:
    tenant: str
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)


def test_a_tenant_beyond_its_waiting_bound_is_refused_and_nothing_of_the_request_waits():
    room = WaitingRoom(RoomLimits(max_waiting=100, max_waiting_per_tenant=3))
    room.put_all("a", [Item("a"), Item("a")])
    with pytest.raises(QueueFullError) as refused:
        room.put_all("a", [Item("a"), Item("a")])
    assert "tenant" in str(refused.value) and refused.value.retry_after_s >= 1
    assert room.waiting("a") == 2 and len(room) == 2
    room.put_all("b", [Item("b")] * 3)  # another tenant has its own bound


def test_the_room_as_a_whole_is_bounded_too():
    room = WaitingRoom(RoomLimits(max_waiting=4, max_waiting_per_tenant=3))
    room.put_all("a", [Item("a")] * 3)
    with pytest.raises(QueueFullError, match="capacity"):
        room.put_all("b", [Item("b")] * 2)


def test_a_keys_file_limit_replaces_the_default_bound():
    limits = {"big": TenantLimits(max_waiting=10)}
    room = WaitingRoom(RoomLimits(max_waiting_per_tenant=2), lambda t: limits.get(t, TenantLimits()))
    room.put_all("big", [Item("big")] * 10)
    with pytest.raises(QueueFullError):
        room.put_all("small", [Item("small")] * 3)


def test_fair_order_puts_the_least_served_tenant_per_weight_first_and_skips_full_ones():
    limits = {"heavy": TenantLimits(weight=3.0), "capped": TenantLimits(max_running=1)}
    room = WaitingRoom(limits_of=lambda t: limits.get(t, TenantLimits()))
    for tenant in ("heavy", "light", "capped"):
        room.put_all(tenant, [Item(tenant)])
    assert room.fair_order({"heavy": 2, "light": 1, "capped": 0}) == ["heavy", "capped", "light"]
    assert room.fair_order({"heavy": 3, "light": 0, "capped": 1}) == ["light", "heavy"]


def test_work_charged_from_outside_the_engine_shifts_the_fair_order():
    room = WaitingRoom()
    for tenant in ("a", "b"):
        room.put_all(tenant, [Item(tenant)])
    assert room.fair_order({"a": 1, "b": 1}) == ["a", "b"]  # a's request waited longer
    room.ledger.charge("a", 1000)  # e.g. tokenizing its prompts
    assert room.fair_order({"a": 1, "b": 1}) == ["b", "a"]


def test_fair_order_counts_tokens_not_only_running_requests():
    limits = {"gold": TenantLimits(weight=2.0)}
    room = WaitingRoom(limits_of=lambda t: limits.get(t, TenantLimits()))
    for tenant in ("flood", "gold", "light"):
        room.put_all(tenant, [Item(tenant)])
    room.ledger.charge("flood", 5000)  # long prompts: a few requests, much work
    room.ledger.charge("gold", 400)
    room.ledger.charge("light", 300)
    assert room.fair_order({"flood": 1, "gold": 1, "light": 1}) == ["gold", "light", "flood"]


def test_a_tenant_starts_no_request_beyond_its_weighted_share_of_the_places_while_another_is_active():
    limits = {"gold": TenantLimits(weight=3.0)}
    room = WaitingRoom(limits_of=lambda t: limits.get(t, TenantLimits()))
    room.ledger.clock = lambda: 0.0
    room.put_all("flood", [Item("flood")] * 20)
    assert room.fair_order({"flood": 7}, places=8, recent_s=2.0) == ["flood"]  # alone: every place
    room.ledger.charge("victim", 1)  # served just now: active, with nothing waiting or running
    assert room.fair_order({"flood": 4}, places=8, recent_s=2.0) == []
    assert room.fair_order({"flood": 3}, places=8, recent_s=2.0) == ["flood"]
    assert room.fair_order({"flood": 7}) == ["flood"]  # without places: no share
    room.put_all("gold", [Item("gold")])  # weight 3 of 5: 4 of 8 places, flood and victim 1 each
    assert room.place_shares(8, {"flood": 1}, 2.0) == {"flood": 1, "victim": 1, "gold": 4}
    assert room.fair_order({"flood": 1, "gold": 3}, places=8, recent_s=2.0) == ["gold"]


def test_cancelled_requests_at_the_head_of_a_line_leave_it():
    dropped = []
    room = WaitingRoom(on_cancelled=lambda: dropped.append(1))
    items = [Item("a") for _ in range(3)]
    room.put_all("a", items)
    items[0].cancelled.set()
    items[1].cancelled.set()
    assert room.heads("a", 5) == [items[2]]
    assert len(room) == 1 and len(dropped) == 2


def test_waiting_for_a_tenants_next_request_ignores_other_tenants_and_ends_when_it_comes():
    room = WaitingRoom()

    def flooder_then_victim() -> None:
        time.sleep(0.05)
        room.put_all("flood", [Item("flood")])
        time.sleep(0.05)
        room.put_all("victim", [Item("victim")])

    putter = threading.Thread(target=flooder_then_victim)
    start = time.perf_counter()
    putter.start()
    room.wait_for({"victim"}, 30.0)
    elapsed = time.perf_counter() - start
    putter.join()
    assert room.waiting("victim") == 1 and 0.1 <= elapsed < 20
    start = time.perf_counter()
    room.wait_for({"nobody"}, 0.05)  # nobody comes: the timeout
    assert time.perf_counter() - start >= 0.05


# ---- the batched engine's admission --------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", torch.float32)


def engine_for(model, limits=None, batch: int = 4) -> BatchEngine:
    cache = KVCacheTrie.for_model(model, capacity_tokens=4096)
    lookup = (lambda t: limits.get(t, TenantLimits())) if limits else (lambda t: TenantLimits())
    room = RoomLimits(max_waiting=10_000, max_waiting_per_tenant=5_000)
    return BatchEngine(
        CachedGenerator(model, IdTokenizer(), cache), max_batch_size=batch, limits=room, limits_of=lookup
    )


def submit(engine, tenant: str, n: int, new: int = 40) -> list:
    params = GenerationParams(max_new_tokens=new)
    items = [([7, 8, 9, 10 + i, 20 + len(tenant)], lambda item: None, {"params": params}) for i in range(n)]
    return engine.submit_all(items, tenant=tenant)


def running_tenants(engine) -> list[str]:
    return sorted(s.request.tenant for s in engine._running)


def test_a_flooding_tenant_gets_its_share_and_a_newcomer_is_admitted_next(model):
    engine = engine_for(model, batch=4)
    submit(engine, "flood", 200)
    engine._admit()
    assert running_tenants(engine) == ["flood"] * 4
    submit(engine, "victim", 1)
    while len(engine._running) == 4:  # until a flood request finishes and frees its place
        engine._step_packed()
    engine._admit()
    assert "victim" in running_tenants(engine)


def test_without_max_running_a_flooder_takes_its_share_of_the_batch_while_another_tenant_is_active(model):
    engine = engine_for(model, batch=8)
    engine.ledger.clock = lambda: 0.0
    submit(engine, "flood", 40)
    engine._admit()
    assert running_tenants(engine) == ["flood"] * 8  # alone: the whole batch
    engine = engine_for(model, batch=8)
    engine.ledger.clock = lambda: 0.0
    engine.ledger.charge("victim", 1)  # its last reply just went out; its next request is coming
    submit(engine, "flood", 40)
    engine._admit()
    assert running_tenants(engine) == ["flood"] * 4
    submit(engine, "victim", 1)
    engine._admit()  # a free place at once: nobody is preempted
    assert running_tenants(engine) == ["flood"] * 4 + ["victim"] and engine.preemptions == 0


def run_until_idle(engine) -> None:
    while engine._running or len(engine.room):
        engine._admit()
        engine._step_packed()


def greedy(engine, tenant: str, prompts: list[list[int]], new: int) -> list:
    out: dict[int, list[int]] = {}
    params = GenerationParams(max_new_tokens=new, min_tokens=new)
    items = [(p, lambda piece, i=i: out.setdefault(i, []).extend(piece.token_ids), {"params": params})
             for i, p in enumerate(prompts)]  # fmt: skip
    engine.submit_all(items, tenant=tenant)
    return out


def test_a_tenant_holding_every_place_gives_one_up_to_a_newcomer_and_outputs_stay_exact(model):
    flood_prompts = [[7, 8, 9, 30 + i] * 3 for i in range(4)]
    victim_prompt = [[5, 6, 40, 41, 42]]
    engine = engine_for(model, batch=4)  # no max_running: the flooder may fill the batch
    flood = greedy(engine, "flood", flood_prompts, 24)
    engine._admit()
    while any(not s.generated for s in engine._running):  # every flood prompt computed
        engine._step_packed()
    victim = greedy(engine, "victim", victim_prompt, 6)
    engine._admit()
    assert "victim" in running_tenants(engine) and engine.preemptions == 1
    run_until_idle(engine)
    alone = engine_for(model, batch=1)
    expected_flood = greedy(alone, "flood", flood_prompts, 24)
    expected_victim = greedy(alone, "victim", victim_prompt, 6)
    run_until_idle(alone)
    assert victim == expected_victim and flood == expected_flood


def test_two_tenants_at_their_shares_take_no_places_from_each_other(model):
    engine = engine_for(model, batch=4)
    submit(engine, "a", 10, new=8)
    submit(engine, "b", 10, new=8)
    engine._admit()
    while any(not s.generated for s in engine._running):
        engine._step_packed()
        engine._admit()  # both still wait for more: neither may preempt the other
    assert running_tenants(engine) == ["a", "a", "b", "b"] and engine.preemptions == 0


def test_weights_share_the_batch_and_max_running_caps_a_tenant(model):
    limits = {"gold": TenantLimits(weight=3.0), "capped": TenantLimits(max_running=1)}
    engine = engine_for(model, limits, batch=5)
    for tenant in ("gold", "bronze", "capped"):
        submit(engine, tenant, 20)
    engine._admit()
    assert running_tenants(engine) == ["bronze", "capped", "gold", "gold", "gold"]


def test_admission_looks_at_a_few_heads_per_tenant_not_the_whole_line(model):
    """Admitting from a line of thousands costs what admitting from a short one does."""
    engine = engine_for(model, batch=1)
    submit(engine, "flood", 3000, new=1)
    looked = []
    real = engine.cache.cached_length
    engine.cache.cached_length = lambda ids, salt=None, servable=False: (
        looked.append(1) or real(ids, salt=salt)
    )
    engine._admit()
    engine._step_packed()
    engine._admit()
    assert len(looked) <= 2 * 32


# ---- over HTTP ----------------------------------------------------------------------------------

KEYS = {"flood": "sk-flood-0001", "victim": "sk-victim-0002", "greedy": "sk-greedy-0003"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    entries = [
        {"key": KEYS["flood"], "tenant": "flood", "max_waiting": 4, "max_running": 1},
        {"key": KEYS["victim"], "tenant": "victim"},
        {"key": KEYS["greedy"], "tenant": "greedy"},  # no max_running: it may take every place
    ]
    path.write_text(json.dumps({"keys": entries}))
    path.chmod(0o600)
    server = start_server(
        "--model", str(tiny_model_dir()), "--served-model-name", "tiny", "--capacity", "4096",
        "--api-keys", str(path), "--max-batch-size", "2", "--max-prompts", "6", "--max-branches", "8",
    )  # fmt: skip
    yield server
    stop_cleanly(server)


def client(server, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=120)


def test_too_many_prompts_or_branches_is_a_400_naming_the_parameter(server):
    with client(server, "victim") as c:
        with pytest.raises(openai.BadRequestError) as many:
            c.completions.create(model="tiny", prompt=["a"] * 7, max_tokens=1)
        assert many.value.body["param"] == "prompt" and "at most 6" in many.value.body["message"]
        with pytest.raises(openai.BadRequestError) as fanout:
            c.completions.create(model="tiny", prompt="a", max_tokens=1, n=3, best_of=9)
        assert fanout.value.body["param"] == "best_of"


def test_a_full_tenant_queue_is_a_429_with_retry_after_and_nothing_runs(server):
    with client(server, "flood") as c, pytest.raises(openai.RateLimitError) as full:
        c.completions.create(model="tiny", prompt=["a b", "c d", "e f", "g h", "i j"], max_tokens=1)
    assert int(full.value.response.headers["retry-after"]) >= 1
    assert full.value.body["code"] == "queue_full"


def test_a_flooding_tenant_does_not_hold_up_another(server):
    # four replies one after another (max_running 1) take seconds, so the victim's short request,
    # sent half a second in, ends long before the last of them unless it waits behind the flood
    def flood(i: int) -> float:
        with client(server, "flood") as c:
            c.completions.create(model="tiny", prompt=f"flood {i} " * 20, max_tokens=150, temperature=0)
        return time.perf_counter()

    with ThreadPoolExecutor(4) as pool:
        floods = [pool.submit(flood, i) for i in range(4)]
        time.sleep(0.5)
        with client(server, "victim") as c:
            r = c.completions.create(model="tiny", prompt="hello there", max_tokens=4, temperature=0)
        victim_done = time.perf_counter()
        ends = [f.result() for f in floods]
    assert r.choices[0].text is not None
    assert victim_done < max(ends), "the victim waited for the whole flood"


def test_a_tenant_without_max_running_holding_every_place_does_not_keep_another_waiting(server):
    """Both batch places hold the greedy tenant's long replies; the victim's short request takes a
    place from one of them (preempted, it resumes later) instead of waiting for one to end."""
    started = [threading.Event(), threading.Event()]
    # alone, a tenant may take every place; a tenant served within RECENT_S (the flood of the test
    # before) is still active, and the greedy one would then get only its share of the places
    time.sleep(RECENT_S + 0.5)

    def greedy(i: int) -> float:
        with client(server, "greedy") as c:
            stream = c.completions.create(
                model="tiny", prompt=f"greedy {i} " * 5, max_tokens=200, temperature=0, stream=True,
                extra_body={"min_tokens": 200},
            )  # fmt: skip
            for _ in stream:
                started[i].set()
        return time.perf_counter()

    with ThreadPoolExecutor(2) as pool:
        long = [pool.submit(greedy, i) for i in range(2)]
        assert all(event.wait(60) for event in started)  # both places taken, both prompts computed
        with client(server, "victim") as c:
            r = c.completions.create(model="tiny", prompt="hello there", max_tokens=4, temperature=0)
        victim_done = time.perf_counter()
        ends = [f.result() for f in long]
    assert r.choices[0].text is not None
    assert victim_done < min(ends), "the victim waited for a place until the greedy tenant's reply ended"
