"""ResponseStore: stored responses bounded per tenant and in total, in bytes, count and time."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvblocks.server.errors import APIError
from kvblocks.server.response_store import ENTRY_OVERHEAD, ResponseStore


def conversation(nbytes: int) -> list[dict]:
    return [{"role": "user", "content": "x" * nbytes}]


def entry_bytes(messages: list[dict], response: dict) -> int:
    compact = {"separators": (",", ":")}
    return len(json.dumps(messages, **compact)) + len(json.dumps(response, **compact)) + ENTRY_OVERHEAD


def ids(store: ResponseStore, tenant: str) -> list[str]:
    found = []
    for i in range(100):
        try:
            store.get(tenant, f"{tenant}{i}")
        except APIError:
            continue
        found.append(f"{tenant}{i}")
    return found


def run(coroutine):
    return asyncio.run(coroutine)


def test_an_entry_is_charged_its_json_bytes_and_reads_back_as_a_fresh_copy():
    async def main():
        store = ResponseStore(per_tenant_bytes=1 << 20, total_bytes=1 << 20)
        messages, response = conversation(1000), {"id": "r", "metadata": {"k": "v"}}
        assert store.put("a", "r", messages, response)
        assert store.bytes_by_tenant() == {"a": entry_bytes(messages, response)}
        got = store.get("a", "r")
        got.messages.append({"role": "user", "content": "mutated"})
        assert store.get("a", "r").messages == messages
        assert store.get("a", "r").response == response

    run(main())


def test_a_tenant_over_its_budget_loses_its_own_oldest_entries_and_no_other_tenants():
    async def main():
        store = ResponseStore(per_tenant_bytes=10_000, total_bytes=100_000)
        for i in range(3):
            store.put("b", f"b{i}", conversation(2000), {})
        for i in range(10):
            store.put("a", f"a{i}", conversation(2000), {})
        fit = 10_000 // entry_bytes(conversation(2000), {})
        assert fit == 3
        assert ids(store, "b") == ["b0", "b1", "b2"]
        assert ids(store, "a") == ["a7", "a8", "a9"]
        assert store.evicted["own_budget"] == 7

    run(main())


def test_over_the_total_the_tenant_most_over_its_weighted_share_loses_its_oldest():
    async def main():
        weights = {"a": 1.0, "b": 1.0, "heavy": 3.0}
        store = ResponseStore(per_tenant_bytes=20_000, total_bytes=30_000, weight=weights.__getitem__)
        for i in range(5):
            store.put("heavy", f"heavy{i}", conversation(2500), {})  # 5 x ~3 kB, within its weight
        for i in range(5):
            store.put("a", f"a{i}", conversation(2500), {})
        store.put("b", "b0", conversation(2500), {})
        assert sum(store.bytes_by_tenant().values()) <= 30_000
        assert ids(store, "heavy") == [f"heavy{i}" for i in range(5)], "3 x a's share: kept whole"
        assert ids(store, "b") == ["b0"], "the smallest holder lost nothing"
        assert ids(store, "a") == ["a2", "a3", "a4"]
        assert store.evicted["server_budget"] == 2

    run(main())


def test_an_entry_larger_than_the_tenant_budget_is_refused_and_nothing_is_dropped():
    async def main():
        store = ResponseStore(per_tenant_bytes=5_000, total_bytes=5_000)
        assert store.put("a", "a0", conversation(1000), {})
        assert not store.put("a", "a1", conversation(6000), {})
        assert ids(store, "a") == ["a0"] and store.refused == 1
        with pytest.raises(APIError) as refused:
            store.check_fits(6000)
        assert refused.value.status == 400 and refused.value.param == "store"
        store.check_fits(1000)

    run(main())


def test_the_count_per_tenant_still_holds():
    async def main():
        store = ResponseStore(per_tenant=3)
        for i in range(5):
            store.put("a", f"a{i}", conversation(10), {})
        assert ids(store, "a") == ["a2", "a3", "a4"] and store.evicted["count_cap"] == 2

    run(main())


def test_expired_entries_are_swept_by_the_timer_without_the_tenant_coming_back():
    async def main():
        store = ResponseStore(ttl_s=0.2)
        store.put("a", "a0", conversation(100), {})
        store.put("b", "b0", conversation(100), {})
        assert set(store.bytes_by_tenant()) == {"a", "b"}
        await asyncio.sleep(0.4)
        assert store.bytes_by_tenant() == {} and store.entries_by_tenant() == {}
        assert store.evicted["expired"] == 2
        store.put("a", "a1", conversation(100), {})  # the timer re-arms for later entries
        await asyncio.sleep(0.4)
        assert store.entries_by_tenant() == {}
        store.close()

    run(main())


def test_delete_returns_the_bytes_and_a_missing_id_is_a_404():
    async def main():
        store = ResponseStore()
        store.put("a", "a0", conversation(100), {})
        store.delete("a", "a0")
        assert store.bytes_by_tenant() == {}
        with pytest.raises(APIError) as missing:
            store.delete("a", "a0")
        assert missing.value.status == 404
        store.close()

    run(main())
