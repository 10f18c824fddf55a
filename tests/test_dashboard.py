"""The shipped Grafana dashboard: every query parses as PromQL and names only metrics a real server exports."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import promql_parser
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from redis_server import RedisServer, free_port
from server_proc import start_server, stop_cleanly, tiny_model_dir, wait_idle
from tiny_models import HYBRID_ARCHITECTURES, tiny_model

from kvblocks import KVCacheTrie
from kvblocks.telemetry.metrics import CacheCollector, Metrics

DASHBOARD = Path(__file__).resolve().parent.parent / "dashboards" / "kvblocks.json"
# Grafana's variables, as Grafana substitutes them before the query reaches Prometheus
ADMIN, TENANT = "admin-key-0123", "tenant-key-0123"
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s"}


def queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(found) >= 12
    return found


def substituted(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def selectors(node: object) -> Iterator[str]:
    """Names of every vector and matrix selector in a parsed PromQL expression."""
    if isinstance(node, promql_parser.VectorSelector):
        yield node.name
        return
    for attribute in ("expr", "lhs", "rhs", "param", "vector_selector"):
        child = getattr(node, attribute, None)
        if child is not None:
            yield from selectors(child)
    for arg in getattr(node, "args", None) or ():
        yield from selectors(arg)


def exported(text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def server_names(tmp_path_factory) -> set[str]:
    """Sample names of a tiny server with Redis and KV events on, after requests of two tenants,
    plus those a recurrent model's cache adds (snapshots)."""
    redis = RedisServer(tmp_path_factory.mktemp("redis") / "redis").start()
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(
        json.dumps(
            {"keys": [{"key": ADMIN, "tenant": "acme", "admin": True}, {"key": TENANT, "tenant": "beta"}]}
        )
    )
    keys.chmod(0o600)
    args = ["--model", str(tiny_model_dir()), "--served-model-name", "tiny", "--api-keys", str(keys)]
    args += ["--redis", redis.url, "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}"]
    server = start_server(*args, api_key=ADMIN)
    try:
        with server.client() as client:
            for key in (ADMIN, TENANT):
                body = {"model": "tiny", "prompt": "Shared words of a prompt", "max_tokens": 2}
                response = client.post(
                    "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                )
                assert response.status_code == 200, response.text
            wait_idle(client)
            text = client.get("/metrics").text
    finally:
        stop_cleanly(server)
        redis.stop()
    trie = KVCacheTrie.for_model(tiny_model(HYBRID_ARCHITECTURES[0], torch.float32), capacity_tokens=256)
    metrics = Metrics()
    metrics.register(CacheCollector(trie))
    return exported(text) | exported(metrics.render().decode())


@pytest.mark.parametrize("expr", queries())
def test_every_dashboard_query_parses_and_names_exported_metrics(expr, server_names):
    parsed = promql_parser.parse(substituted(expr))
    names = set(selectors(parsed))
    assert names, expr
    assert names <= server_names, f"{sorted(names - server_names)} not exported; query: {expr}"


def test_the_walker_finds_selectors_inside_functions_and_binary_operators():
    parsed = promql_parser.parse("histogram_quantile(0.9, sum by (le) (rate(a_bucket[1m]))) / on() b + c")
    assert set(selectors(parsed)) == {"a_bucket", "b", "c"}
