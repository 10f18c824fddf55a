"""Per-tenant budgets of what a server keeps between requests, against real servers (tiny model)
with a keys file of several tenants: stored responses (bytes per tenant and in total, expiry by a
timer), `metadata` within OpenAI's limits, and each tenant's share of the pin cap.

Sizes are read back from /metrics (a router key), so nothing here assumes how large an entry is.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from server_proc import scrape, start_server, stop_cleanly, tiny_model_dir

TENANTS = ("a", "b", "c")
KEYS = {t: f"sk-{t}-budget-0001" for t in TENANTS} | {"lb": "sk-lb-router-0001"}
PER_TENANT = 40_000
# 16 keys of 512 characters: the largest metadata OpenAI allows, about 8.6 kB of an entry
BIG_METADATA = {f"k{i:02}": "m" * 512 for i in range(16)}


def keys_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    entries = [{"key": KEYS[t], "tenant": t} for t in TENANTS]
    entries.append({"key": KEYS["lb"], "tenant": "lb", "role": "router"})
    path.write_text(json.dumps({"keys": entries}))
    path.chmod(0o600)
    return str(path)


def serve(tmp_path_factory, *flags: str):
    return start_server(
        "--model", str(tiny_model_dir()), "--served-model-name", "tiny", "--api-keys",
        keys_file(tmp_path_factory), "--store-max-bytes-per-tenant", str(PER_TENANT), *flags,
    )  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = serve(tmp_path_factory, "--capacity", "1024")  # 512 pinned tokens at most, 128 a tenant
    yield server
    stop_cleanly(server)


def http(server, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=60)


def respond(server, tenant: str, prompt: str = "Hi.", **extra) -> httpx.Response:
    with http(server, tenant) as c:
        return c.post("/v1/responses", json={"input": prompt, "max_output_tokens": 2} | extra)


def store(server, tenant: str, count: int) -> list[str]:
    """`count` stored responses of about 10 kB each (the largest metadata); their ids, oldest first."""
    out = []
    for i in range(count):
        r = respond(server, tenant, f"Entry {i}.", metadata=BIG_METADATA)
        assert r.status_code == 200, r.text
        assert r.json()["store"] is True
        out.append(r.json()["id"])
    return out


def kept(server, tenant: str, ids: list[str]) -> list[bool]:
    with http(server, tenant) as c:
        return [c.get(f"/v1/responses/{i}").status_code == 200 for i in ids]


def stored_bytes(server) -> dict[str, float]:
    with http(server, "lb") as c:
        samples = scrape(c)
    prefix = 'kvblocks_tenant_stored_response_bytes{tenant="'
    return {name[len(prefix) : -2]: v for name, v in samples.items() if name.startswith(prefix)}


def metric(server, name: str) -> float:
    with http(server, "lb") as c:
        return scrape(c).get(name, 0.0)


# ---- metadata ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "metadata",
    [
        {f"k{i}": "v" for i in range(17)},
        {"k" * 65: "v"},
        {"k": "v" * 513},
        {"k": 1},
    ],
    ids=["17-keys", "65-character-key", "513-character-value", "value-not-a-string"],
)
def test_metadata_past_openais_limits_is_a_400_naming_metadata(server, metadata):
    r = respond(server, "a", metadata=metadata)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == "metadata"


def test_metadata_at_openais_limits_is_stored_and_returned_as_given(server):
    metadata = {"k" * 64 if i == 0 else f"k{i}": "v" * 512 for i in range(16)}
    r = respond(server, "a", metadata=metadata)
    assert r.status_code == 200, r.text
    with http(server, "a") as c:
        assert c.get(f"/v1/responses/{r.json()['id']}").json()["metadata"] == metadata


def test_chat_completions_refuse_metadata_by_name(server):
    with http(server, "a") as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 1, "metadata": {"k": "v"}})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"


# ---- stored responses: bytes per tenant ------------------------------------------------------------


def test_a_tenant_storing_past_its_budget_loses_only_its_own_oldest_entries(server):
    others = store(server, "b", 2)
    before = stored_bytes(server)["b"]
    mine = store(server, "c", 8)
    survived = kept(server, "c", mine)
    assert survived[-1] and not survived[0], survived
    assert survived == sorted(survived), "the oldest went first"
    assert stored_bytes(server)["c"] <= PER_TENANT
    assert kept(server, "b", others) == [True, True]
    assert stored_bytes(server)["b"] == before
    assert metric(server, 'kvblocks_stored_responses_evicted_total{reason="own_budget"}') >= 1


def test_a_conversation_over_the_budget_before_any_output_is_a_400_naming_store(server):
    schema = {"type": "object", "description": "d" * PER_TENANT}
    fmt = {"format": {"type": "json_schema", "name": "big", "schema": schema}}
    r = respond(server, "a", text=fmt)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "store", r.text
    assert respond(server, "a", text=fmt, store=False).status_code == 200


def test_an_entry_that_grows_over_the_budget_with_its_output_says_store_false(server):
    # The input alone fits (with room for ENTRY_OVERHEAD); the response object echoing it does not.
    schema = {"type": "object", "description": "d" * (PER_TENANT - 1200)}  # 38,800 of 40,000
    fmt = {"format": {"type": "json_schema", "name": "big", "schema": schema}}
    refused = metric(server, "kvblocks_stored_responses_refused_total")
    r = respond(server, "a", text=fmt)
    assert r.status_code == 200, r.text
    assert r.json()["store"] is False
    assert kept(server, "a", [r.json()["id"]]) == [False]
    assert metric(server, "kvblocks_stored_responses_refused_total") == refused + 1


# ---- pins: each tenant's share of the cap --------------------------------------------------------


def pin(server, tenant: str, system: str) -> None:
    part = {"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    body = {"messages": [{"role": "system", "content": [part]}, {"role": "user", "content": "Hi."}],
            "max_tokens": 1}  # fmt: skip
    with http(server, tenant) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


def pinned(server, tenant: str) -> float:
    return metric(server, f'kvblocks_tenant_pinned_tokens{{tenant="{tenant}"}}')


def test_a_tenant_pinning_all_it_can_does_not_stop_another_from_pinning(server):
    # The cap is 512 tokens, 128 for each of the four tenants (a, b, c, lb); each system prompt
    # is about 100 tokens, so 8 of them would fill the cap four times over.
    for i in range(8):
        pin(server, "a", f"You are assistant number {i}. " + "Answer tersely and kindly. " * 14)
    assert 0 < pinned(server, "a") <= 128
    assert metric(server, 'kvblocks_tenant_pins_refused_total{tenant="a"}') >= 6
    pin(server, "b", "You are the other tenant's assistant. " + "Answer tersely and kindly. " * 14)
    assert pinned(server, "b") > 0
    assert metric(server, 'kvblocks_tenant_pins_refused_total{tenant="b"}') == 0


# ---- stored responses: the total, and expiry -------------------------------------------------------


def test_over_the_total_the_tenant_most_over_its_share_loses_its_oldest(tmp_path_factory):
    server = serve(tmp_path_factory, "--store-max-bytes", str(PER_TENANT))
    try:
        a_ids = store(server, "a", 3)  # about 30 kB
        b_ids = store(server, "b", 1)
        c_ids = store(server, "c", 1)
        held = stored_bytes(server)
        assert sum(held.values()) <= PER_TENANT, held
        assert kept(server, "b", b_ids) == [True] and kept(server, "c", c_ids) == [True]
        assert kept(server, "a", a_ids)[0] is False and kept(server, "a", a_ids)[-1] is True
        assert metric(server, 'kvblocks_stored_responses_evicted_total{reason="server_budget"}') >= 1
    finally:
        stop_cleanly(server)


def test_expired_entries_are_swept_by_a_timer_while_their_tenant_stays_away(tmp_path_factory):
    server = serve(tmp_path_factory, "--store-ttl", "1")
    try:
        ids = store(server, "a", 2)
        assert stored_bytes(server)["a"] > 0
        deadline = time.monotonic() + 10
        while "a" in stored_bytes(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "a" not in stored_bytes(server), "nothing from tenant a came, yet its entries went"
        assert metric(server, 'kvblocks_stored_responses_evicted_total{reason="expired"}') == 2
        assert kept(server, "a", ids) == [False, False]
    finally:
        stop_cleanly(server)
