"""/v1/cache/history over real HTTP: a bounded ring of samples, per tenant for tenant keys, and
`kvblocks stats --since` printing and plotting it."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from server_proc import start_server, stop_cleanly, tiny_model_dir, wait_idle

from kvblocks.launch.service import cli_env, kvblocks_command
from kvblocks.telemetry.history import History

ADMIN, TENANT = "admin-key-0123", "tenant-key-0123"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": ADMIN, "tenant": "ops", "admin": True},
                                         {"key": TENANT, "tenant": "acme"}]}))  # fmt: skip
    keys.chmod(0o600)
    args = ["--model", str(tiny_model_dir()), "--served-model-name", "tiny", "--api-keys", str(keys)]
    server = start_server(*args, "--history-interval", "0.2", api_key=ADMIN)
    try:
        yield server
    finally:
        stop_cleanly(server)


def test_history_samples_follow_traffic_and_a_tenant_sees_only_its_own(server):
    with server.client() as admin:
        body = {"model": "tiny", "prompt": "Words of a shared prompt", "max_tokens": 2}
        for _ in range(2):
            r = admin.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {TENANT}"})
            assert r.status_code == 200, r.text
        wait_idle(admin)
        time.sleep(0.5)
        everything = admin.get("/v1/cache/history", params={"since": 60}).json()
        own = admin.get(
            "/v1/cache/history", params={"since": 60}, headers={"Authorization": f"Bearer {TENANT}"}
        )
        stats = admin.get("/v1/cache/stats", headers={"Authorization": f"Bearer {TENANT}"}).json()["cache"]
    samples = everything["samples"]
    assert everything["interval_s"] == 0.2 and len(samples) >= 3
    assert [s["t"] for s in samples] == sorted(s["t"] for s in samples)
    last = samples[-1]
    assert last["engine"]["kvblocks_requests_total"] >= 2
    assert last["tenants"]["acme"]["hit_tokens"] > 0
    mine = own.json()["samples"]
    assert all(set(s) == {"t", "tenant", "cache"} and s["tenant"] == "acme" for s in mine)
    assert mine[-1]["cache"]["hit_tokens"] == stats["hit_tokens"]
    assert mine[-1]["cache"]["queried_tokens"] == stats["queried_tokens"]


def test_stats_since_prints_the_past_and_plots_it(server, tmp_path):
    png = tmp_path / "history.png"
    command = [*kvblocks_command(), "stats", "--url", server.url, "--since", "1m", "--plot", str(png)]
    done = subprocess.run(command, capture_output=True, text=True, env=cli_env(KVBLOCKS_API_KEY=ADMIN))
    assert done.returncode == 0, done.stderr
    assert "hit rate" in done.stdout and png.stat().st_size > 1000


def test_the_ring_keeps_only_its_window():
    n = iter(range(100))
    history = History(lambda: {"t": float(next(n))}, interval_s=1.0, window_s=5.0)
    for _ in range(20):
        history.record()
    assert [s["t"] for s in history.since(0)] == [14.0, 15.0, 16.0, 17.0, 18.0, 19.0]
