"""Three `kvblocks serve` replicas (tiny model) behind the real routers, on 127.0.0.1.

Three tenants, each with its own ~800-token system prompt and `cache_salt`, send 8 chat requests
each, shuffled: each tenant's first request, then the rest 8 at a time. The ideal hit rate is
what any routing can reach at best: every request but a tenant's first hits the prefix all of
that tenant's prompts share.

- sglang-router and vllm-router `cache_aware` reach >= 0.95 of the ideal and keep one copy of each
  tenant's prompt; `round_robin` misses and copies every prompt to every replica;
- both routers report the real model id and forward requests that name no model;
- with a shared Redis Cluster, one secret and one keys file (tenants bound to API keys, which
  both routers forward), `round_robin` hits >= 0.95 of the ideal counting Redis restores;
- a replica killed mid-run loses only the requests it was serving, and once restarted serves
  its tenants' prefixes from Redis.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from fleet import MODEL, Outcome, drive, fleet_model, make_jobs, make_tenants, start_fleet, tokenize_jobs
from transformers import AutoTokenizer

TENANTS, PER_TENANT, SYSTEM_TOKENS = 3, 8, 800
SERVE = ["--capacity", "20000"]
KEYS = [f"sk-fleet-tenant-{t}" for t in range(TENANTS)]
ADMIN = "sk-fleet-ops-admin"


@pytest.fixture(scope="module")
def tenants():
    """Tenants by `cache_salt`, for replicas without keys."""
    return make_tenants(AutoTokenizer.from_pretrained(fleet_model()), TENANTS, SYSTEM_TOKENS)


@pytest.fixture(scope="module")
def keyed_tenants():
    """Tenants bound to API keys by the replicas' keys file."""
    tokenizer = AutoTokenizer.from_pretrained(fleet_model())
    return make_tenants(tokenizer, TENANTS, SYSTEM_TOKENS, keys=KEYS, salted=False, seed=1)


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """Replicas without a shared tier: every hit is a device hit on the replica the router chose."""
    fleet = start_fleet(tmp_path_factory.mktemp("fleet"), 3, SERVE)
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Replicas sharing one 3-node Redis Cluster, one secret and one keys file."""
    folder = tmp_path_factory.mktemp("fleet-redis")
    keys = [{"key": k, "tenant": f"tenant-{t}"} for t, k in enumerate(KEYS)]
    (folder / "keys.json").write_text(
        json.dumps({"keys": [*keys, {"key": ADMIN, "tenant": "ops", "admin": True}]})
    )
    fleet = start_fleet(
        folder, 3, [*SERVE, "--api-keys", str(folder / "keys.json")], redis="cluster",
        headers={"Authorization": f"Bearer {ADMIN}"},
    )  # fmt: skip
    yield fleet
    fleet.stop()


def run(fleet, tenants, jobs, **kwargs) -> Outcome:
    if not jobs[0].ids:
        tokenize_jobs(fleet.replicas[0], jobs)
    sent = drive(fleet.url, jobs, tenants, settle=fleet.settle, **kwargs)
    fleet.settle()
    outcome = Outcome.of(sent)
    assert outcome.prompt_tokens == sum(len(j.ids) for j in jobs)  # usage counts what /tokenize gave
    return outcome


def flush_through_router(fleet) -> None:
    """The router fans `/flush_cache` out to every replica, in the format each router reads."""
    assert httpx.post(f"{fleet.url}/flush_cache", timeout=30.0).status_code == 200
    assert [s["resident_tokens"] for s in fleet.stats()] == [0, 0, 0]


def render_inputs(router) -> dict[str, float]:
    """vllm-router's count of the per-worker token-id inputs it prepared, by result."""
    prefix = 'vllm_router_kv_routing_inputs_total{transport="http",result="'
    return {
        line[len(prefix) :].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in router.metrics().splitlines()
        if line.startswith(prefix)
    }


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_cache_aware_routing_reaches_the_ideal_hit_rate_and_keeps_one_copy_per_tenant(alone, tenants, kind):
    jobs = make_jobs(tenants, PER_TENANT)
    outcomes, resident = {}, {}
    for policy in ("cache_aware", "round_robin"):
        router = alone.start_router(kind, policy)
        flush_through_router(alone)
        started = time.monotonic()
        outcomes[policy] = run(alone, tenants, jobs)
        resident[policy] = [s["resident_tokens"] for s in alone.stats()]
        o = outcomes[policy]
        print(
            f"{kind}-router {policy}: hit rate {o.hit_rate:.3f}, ideal {o.ideal_rate:.3f} ({o.of_ideal:.3f} of it), "
            f"resident tokens per replica {resident[policy]}, {time.monotonic() - started:.1f} s"
        )
        assert not o.errors, o.errors[0].error
        if kind == "vllm" and policy == "cache_aware":  # it hashed the ids our render route gave, per worker
            assert render_inputs(router) == {"render": 3 * len(jobs)}
    assert outcomes["cache_aware"].of_ideal >= 0.95
    assert outcomes["round_robin"].of_ideal < outcomes["cache_aware"].of_ideal
    # round robin copies every tenant's prompt to every replica; cache-aware keeps each on one
    assert sum(resident["round_robin"]) > 2 * sum(resident["cache_aware"])


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_router_reports_the_model_id_and_forwards_requests_that_name_none(alone, kind):
    alone.start_router(kind, "cache_aware")
    with openai.OpenAI(base_url=f"{alone.url}/v1", api_key="unused", max_retries=0) as client:
        assert [m.id for m in client.models.list()] == [MODEL]
    body = {"messages": [{"role": "user", "content": "Which tier served this?"}], "max_tokens": 2}
    response = httpx.post(f"{alone.url}/v1/chat/completions", json=body, timeout=60.0)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == MODEL
    if kind == "sglang":  # it registered every worker under the id /server_info and /model_info give
        workers = httpx.get(f"{alone.url}/workers").json()["workers"]
        assert {w["model_id"] for w in workers} == {MODEL}
        assert {w["metadata"]["model_path"] for w in workers} == {str(fleet_model())}


def test_sglang_router_power_of_two_reads_every_replicas_load(alone):
    alone.start_router("sglang", "power_of_two")
    loads = httpx.get(f"{alone.url}/get_loads", timeout=10.0).json()["workers"]
    assert sorted(w["worker"] for w in loads) == sorted(r.url for r in alone.replicas)
    assert all(w["load"] == 0 for w in loads), loads  # idle replicas; -1 would mean unreadable


def test_round_robin_with_a_shared_redis_reaches_the_ideal_hit_rate(shared, keyed_tenants):
    tenants = keyed_tenants
    jobs = make_jobs(tenants, PER_TENANT, seed=1)
    shared.start_router("vllm", "round_robin", ["--api-key", ADMIN])
    shared.flush(spill=True)
    before = [r.metrics() for r in shared.replicas]
    o = run(shared, tenants, jobs)
    after = [r.metrics() for r in shared.replicas]
    stats = shared.stats()
    restored = sum(s["spill_hit_tokens"] for s in stats)
    print(
        f"vllm-router round_robin + Redis Cluster: hit rate {o.hit_rate:.3f}, ideal {o.ideal_rate:.3f} "
        f"({o.of_ideal:.3f} of it), {restored} tokens restored from Redis, resident "
        f"{[s['resident_tokens'] for s in stats]}"
    )
    assert not o.errors, o.errors[0].error
    assert o.of_ideal >= 0.95
    tier = 'kvblocks_prefix_cache_hit_tokens_total{tier="%s"}'
    from_redis = sum(a[tier % "redis"] - b[tier % "redis"] for a, b in zip(after, before))
    from_device = sum(a[tier % "device"] - b[tier % "device"] for a, b in zip(after, before))
    assert from_redis > 0 and from_redis + from_device == o.cached_tokens  # the tiers add up to `usage`
    # the routers forwarded each client's key: every resident token is in one of the three tenants' caches
    for replica, total in zip(shared.replicas, stats):
        own = [
            httpx.get(f"{replica.url}/v1/cache/stats", headers={"Authorization": f"Bearer {t.key}"}).json()
            for t in tenants
        ]
        assert [o["tenant"] for o in own] == [f"tenant-{t}" for t in range(TENANTS)]
        assert sum(o["cache"]["resident_tokens"] for o in own) == total["resident_tokens"] > 0


def test_a_killed_replica_loses_only_its_requests_in_flight_and_comes_back_from_redis(shared, keyed_tenants):
    tenants = keyed_tenants
    shared.start_router("sglang", "round_robin")
    victim = shared.replicas[1]
    events: dict[str, float] = {}

    def kill_then_restart(i: int) -> None:
        if i == 4:
            events["killed"] = time.perf_counter()
            victim.kill()
        elif i == 8:
            victim.spawn()  # boots while the load goes on

    jobs = make_jobs(tenants, PER_TENANT, seed=2)
    tokenize_jobs(shared.replicas[0], jobs)
    sent = drive(shared.url, jobs, tenants, settle=shared.settle, concurrency=4, during=kill_then_restart)
    lost = [s for s in sent if s.error is not None]
    print(f"killed mid-run: {len(lost)} of {len(jobs)} requests lost: {[s.error[:80] for s in lost]}")
    assert all(s.submitted <= events["killed"] <= s.done for s in lost)  # only those it was serving

    victim.wait()
    shared.settle()
    deadline = time.monotonic() + 30.0
    while not shared.router.ready():  # the router saw it come back
        assert time.monotonic() < deadline, "the router never marked the restarted replica healthy"
        time.sleep(0.2)
    after = run(shared, tenants, make_jobs(tenants, 4, seed=3))
    assert not after.errors, after.errors[0].error
    fresh = victim.stats()["cache"]  # the restarted process: everything it hit came from Redis first
    print(
        f"after the restart: hit rate {after.hit_rate:.3f}, replica 1 served {fresh['queries']} requests, "
        f"restored {fresh['spill_hit_tokens']} tokens from Redis"
    )
    assert victim.starts == 2 and fresh["queries"] > 0
    assert fresh["spill_hit_tokens"] >= 0.9 * SYSTEM_TOKENS
    assert after.of_ideal >= 0.95
