"""A served model with two spill tiers, host memory and a real Redis, over real HTTP.

Per-tier counters and sizes in `/metrics` and `/v1/cache/stats`, `explain` naming the tier a prefix
would come from, `/flush_cache?tier=NAME` dropping one tier's records (admin only, a tenant's key
refused), and `--host-cache-size` refused on a CPU-only server. The host tier runs on the CPU here
only through the test-only KVBLOCKS_TEST_HOST_TIER_ON_CPU.
"""

from __future__ import annotations

import json
import secrets
import time

import httpx
import pytest
from server_proc import scrape, start_server, stop_cleanly, tiny_model_dir

from kvblocks.cli.commands import main
from kvblocks.cli.tiers import HOST_TIER_ON_CPU_ENV

MODEL = "tiny-tiers"
CHUNK = 16
KEYS = {"acme": "sk-acme-" + "a" * 24, "ops": "sk-ops-" + "o" * 24}
PROMPT = " ".join(f"w{i}" for i in range(40))


@pytest.fixture(scope="module")
def redis(module_redis_server):
    return module_redis_server


@pytest.fixture(scope="module")
def server(tmp_path_factory, redis):
    keys = tmp_path_factory.mktemp("tiers") / "keys.json"
    keys.write_text(
        json.dumps(
            {
                "keys": [
                    {"key": KEYS["acme"], "tenant": "acme"},
                    {"key": KEYS["ops"], "tenant": "ops", "admin": True},
                ]
            }
        )
    )
    server = start_server(
        "--model", str(tiny_model_dir()), "--served-model-name", MODEL, "--api-keys", str(keys),
        "--host-cache-size", "64MiB", "--redis", redis.url, "--redis-chunk-tokens", str(CHUNK),
        env={HOST_TIER_ON_CPU_ENV: "1", "KVBLOCKS_REDIS_SECRET": secrets.token_hex(32)},
    )  # fmt: skip
    yield server
    stop_cleanly(server)


def http(server, who: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEYS[who]}"}, timeout=120.0)


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def complete(server, prompt: str) -> int:
    """Cached tokens of a one-token completion of `prompt`."""
    with http(server, "acme") as c:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        return ok(c.post("/v1/completions", json=body))["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_written(admin: httpx.Client) -> dict:
    deadline = time.monotonic() + 30.0
    while True:
        stats = ok(admin.get("/v1/cache/stats"))
        if stats["cache"]["host_queue_depth"] == 0 or time.monotonic() > deadline:
            time.sleep(0.2)  # the job taken off the queue lands
            return ok(admin.get("/v1/cache/stats"))
        time.sleep(0.05)


def explain(server, prompt: str) -> list[dict]:
    """Where the tenant's prompt would come from (its own namespace: the tenant asks)."""
    with http(server, "acme") as tenant:
        return ok(tenant.post("/v1/cache/explain", json={"prompt": prompt}))["tiers"]


def test_tiers_in_stats_metrics_and_explain_and_one_tier_flushed_by_an_admin(server, redis):
    prompt = PROMPT + " " + secrets.token_hex(4)
    complete(server, prompt)
    with http(server, "ops") as admin:
        stats = wait_written(admin)
        tiers = {row["name"]: row for row in stats["spill_tiers"]}
        assert list(tiers) == ["host", "redis"]
        assert tiers["host"]["records"] > 0 and tiers["host"]["capacity_bytes"] == 64 << 20
        assert tiers["redis"]["records"] == tiers["host"]["records"] and tiers["redis"]["health"] == "ok"
        written = stats["cache"]["host_written_chunks"]
        assert written == stats["cache"]["redis_written_chunks"] > 0

        metrics = scrape(admin)
        assert metrics['kvblocks_spill_tier_written_chunks_total{tier="host"}'] == written
        assert metrics['kvblocks_spill_tier_records{tier="redis"}'] == tiers["redis"]["records"]
        assert metrics['kvblocks_spill_tier_up{tier="host"}'] == 1
        assert metrics["kvblocks_redis_written_chunks_total"] == written  # Redis' own family, as before

        assert ok(admin.post("/flush_cache"))["spill_deleted_records"] is None  # the device only
        held = explain(server, prompt)
        assert [t["tier"] for t in held] == ["host"] and held[0]["tokens"] > 0
        dropped = ok(admin.post("/flush_cache", params={"tier": "host"}))
        assert (
            dropped["spill_deleted_records"] == tiers["host"]["records"] and dropped["spill_tier"] == "host"
        )
        assert [t["tier"] for t in explain(server, prompt)] == ["redis"]

        before = scrape(admin)
        restored = complete(server, prompt)
        after = scrape(admin)
        assert restored == held[0]["tokens"] > 0
        hits = 'kvblocks_spill_tier_restored_tokens_total{tier="redis"}'
        assert after[hits] - before[hits] == restored
        assert (
            after['kvblocks_prefix_cache_hit_tokens_total{tier="redis"}']
            > before['kvblocks_prefix_cache_hit_tokens_total{tier="redis"}']
        )
        stats = wait_written(admin)
        assert stats["cache"]["host_promoted_chunks"] == restored // CHUNK  # promoted up again

        refused = admin.post("/flush_cache", params={"tier": "disk"})
        assert refused.status_code == 400 and "host, redis" in refused.json()["error"]["message"]
    assert redis.client().dbsize() > 0  # Redis kept its records through the host tier's flush


def test_a_tenant_key_cannot_flush_a_tier_or_see_the_tiers(server):
    with http(server, "acme") as tenant:
        refused = tenant.post("/flush_cache", params={"tier": "host"})
        assert refused.status_code == 403
        assert "spill_tiers" not in ok(tenant.get("/v1/cache/stats"))


def test_host_cache_size_is_refused_on_a_cpu_server_and_a_bad_size_by_name(capsys, monkeypatch):
    monkeypatch.delenv(HOST_TIER_ON_CPU_ENV, raising=False)
    assert main(["serve", "--host-cache-size", "1GiB", "--device", "cpu"]) == 2
    assert "--host-cache-size: the device is the CPU" in capsys.readouterr().err
    assert main(["serve", "--host-cache-size", "lots", "--device", "cuda:0"]) == 2
    assert "--host-cache-size must be a positive size" in capsys.readouterr().err


def test_kvblocks_stats_and_explain_show_the_tiers(server, capsys):
    prompt = PROMPT + " cli " + secrets.token_hex(4)
    complete(server, prompt)
    with http(server, "ops") as admin:
        wait_written(admin)
        ok(admin.post("/flush_cache"))  # the device forgets; the host tier and Redis keep it
    assert main(["stats", "--url", server.url, "--api-key", KEYS["ops"]]) == 0
    out = capsys.readouterr().out
    assert "spill tier host" in out and "spill tier redis" in out and "records" in out
    assert main(["explain", prompt, "--raw", "--url", server.url, "--api-key", KEYS["acme"]]) == 0
    out = capsys.readouterr().out
    assert "from host (" in out
