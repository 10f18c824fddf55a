"""Tenants bound to API keys, over real HTTP with the real openai client (tiny model).

Two tenants and an admin share one server. A tenant never gets another tenant's KV, and no
endpoint gives it another tenant's text, token ids or namespace keys; `explain` answers a tenant
exactly as if the other tenants did not exist. The admin sees everything.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_proc import cli_env, kvblocks_command, scrape, start_server, stop_cleanly, tiny_model_dir

MODEL = "tiny"
KEYS = {
    "acme": "sk-acme-0001",
    "globex": "sk-globex-0002",
    "ops": "sk-ops-admin-0003",
    "lb": "sk-lb-router-0004",
}
SECRET_PROMPT = (
    "You are the ACME payroll bot. The launch code for project Nightjar is 7-4-1-9. "
    "Never reveal salaries of the board. "
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    entries = [
        {"key": KEYS["acme"], "tenant": "acme"},
        {"key": KEYS["globex"], "tenant": "globex"},
        {"key": KEYS["ops"], "tenant": "ops", "admin": True},
        {"key": KEYS["lb"], "tenant": "lb", "role": "router"},
    ]
    path.write_text(json.dumps({"keys": entries}))
    path.chmod(0o644)
    server = start_server(
        "--model", str(tiny_model_dir()), "--served-model-name", MODEL, "--capacity", "4096",
        "--api-keys", str(path),
    )  # fmt: skip
    yield server
    stop_cleanly(server)


def http(server, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=60)


def complete(server, tenant: str, prompt: str, **extra) -> openai.types.Completion:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS[tenant], max_retries=0) as client:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, **extra)


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def explain(server, tenant: str, prompt: str, salt: str | None = None) -> dict:
    with http(server, tenant) as c:
        response = c.post("/v1/cache/explain", json={"prompt": prompt, "cache_salt": salt})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_tenant_never_gets_another_tenants_kv_not_even_through_cache_salt(server):
    prompt = SECRET_PROMPT + "Q: payday?"
    assert cached(complete(server, "acme", prompt)) == 0
    assert cached(complete(server, "acme", prompt)) > 0
    assert cached(complete(server, "globex", prompt)) == 0
    for salt in ("acme", "tenant:acme", '"acme", ""'):  # one salt names another namespace per tenant
        salted = f"{SECRET_PROMPT} Q: {salt}?"
        complete(server, "acme", salted, extra_body={"cache_salt": salt})
        assert cached(complete(server, "globex", salted, extra_body={"cache_salt": salt})) == 0


def test_explain_answers_a_tenant_as_if_other_tenants_did_not_exist(server):
    secret = "You are the ACME vault bot. The vault PIN is 5-5-0-2 and the backup PIN is 9-9-3-1. "
    guess, wrong = secret[:50], secret[:40] + "PIN is 1-2"
    before = [explain(server, "globex", p) for p in (guess, wrong)]
    complete(server, "acme", secret + "Q: bonus?")
    after = [explain(server, "globex", p) for p in (guess, wrong)]
    assert after == before
    assert {e["reason"] for e in after} == {"never_seen"}
    # Inside its own tenant the oracle still works as designed: another cache_salt is named.
    assert explain(server, "acme", SECRET_PROMPT + "Q: x", salt="other")["reason"] == "namespace_mismatch"
    # The admin sees across tenants.
    assert explain(server, "ops", SECRET_PROMPT + "Q: y")["reason"] == "namespace_mismatch"


def test_inspection_shows_a_tenant_nothing_of_another_tenant(server):
    secret = "You are the ACME merger bot. Project Kestrel buys Initech on March 3. "
    complete(server, "acme", secret + "Q: holidays?", extra_body={"cache_salt": "team-1"})
    with http(server, "acme") as c:
        acme_keys = {
            p["namespace"] for p in c.get("/v1/cache/prefixes", params={"limit": 1000}).json()["prefixes"]
        }
    assert acme_keys
    with http(server, "globex") as c:
        complete(server, "globex", "Globex logistics: where is container 42?")
        listing = c.get("/v1/cache/prefixes", params={"limit": 1000, "tree": True, "max_nodes": 5000}).text
        stats = c.get("/v1/cache/stats").json()
    assert "Kestrel" not in listing
    assert "Initech" not in listing
    assert "Globex" in listing
    assert not any(key in listing for key in acme_keys)
    assert stats["tenant"] == "globex"
    assert "engine" not in stats and "counters" not in stats
    assert not any(key in json.dumps(stats) for key in acme_keys)
    assert stats["cache"]["queries"] <= 20  # its own requests only, not acme's
    with http(server, "ops") as c:
        everything = c.get("/v1/cache/prefixes", params={"limit": 1000}).text
        admin_stats = c.get("/v1/cache/stats").json()
    assert "Kestrel" in everything and "Globex" in everything
    assert admin_stats["cache"]["queries"] > stats["cache"]["queries"]


def test_metrics_need_a_router_key_and_show_totals_only(server):
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    with http(server, "lb") as c:
        samples = scrape(c)
    assert samples["kvblocks_prefix_cache_queries_total"] > 0
    # totals, and per-tenant counters (the dashboard's hit rate per tenant) for the operator's
    # router key only: no namespace keys, and nothing per tenant outside the kvblocks_tenant_ families
    assert not any("namespace" in name for name in samples)
    assert all(name.startswith("kvblocks_tenant_") for name in samples if "tenant" in name)


@pytest.mark.parametrize("path", ["/get_load", "/server_info", "/get_server_info", "/metrics"])
def test_tenant_key_gets_403_where_every_tenants_traffic_shows(server, path):
    with http(server, "globex") as c:
        response = c.get(path)
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "router_or_admin_only"
    with http(server, "ops") as c:
        assert c.get(path).status_code == 200


def test_router_key_reads_load_but_no_tenants_prefixes_or_requests(server):
    complete(server, "acme", SECRET_PROMPT + "Q: router check?")
    with http(server, "lb") as c:
        assert c.get("/get_load").status_code == 200
        listing = c.get("/v1/cache/prefixes", params={"limit": 1000, "tree": True}).text
        stats = c.get("/v1/cache/stats").json()
        flush = c.post("/flush_cache")
    assert "Nightjar" not in listing
    assert stats["tenant"] == "lb" and "counters" not in stats
    assert flush.status_code == 403
    assert explain(server, "lb", SECRET_PROMPT + "Q: router check?")["cached_tokens"] == 0


def test_a_keys_file_readable_by_others_is_warned_about_in_one_line(server):
    warnings = [line for line in server.stderr().splitlines() if "readable by other users" in line]
    assert len(warnings) == 1 and "chmod 600" in warnings[0]


def test_a_wrong_key_is_refused_on_every_endpoint_but_health(server):
    for path in ("/v1/models", "/v1/cache/stats", "/v1/cache/prefixes", "/metrics"):
        response = httpx.get(f"{server.url}{path}", headers={"Authorization": "Bearer sk-nobody-000"})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "not valid JSON"),
        ('{"keys": []}', "non-empty"),
        ('{"keys": [{"key": "short", "tenant": "a"}]}', "at least 8 characters"),
        ('{"keys": [{"key": "long-enough-key", "tenant": ""}]}', "tenant"),
        ('{"keys": [{"key": "long-enough-key", "tenant": "a", "admin": "yes"}]}', "admin"),
        ('{"keys": [{"key": "long-enough-key", "tenant": "a", "colour": "x"}]}', "must be an object"),
        ('{"keys": [{"key": "long-enough-key", "tenant": "a", "role": "x"}]}', '"role" must be one of'),
        (
            '{"keys": [{"key": "long-enough-key", "tenant": "a", "role": "router", "admin": true}]}',
            "contradicts",
        ),
        (r'{"keys": [{"key": "long-enough-k\u00e9y", "tenant": "a"}]}', "printable ASCII"),
        (r'{"keys": [{"key": "long-enough-key", "tenant": "a\ud800"}]}', "printable text"),
        (r'{"keys": [{"key": "long-enough-key", "tenant": "a\u0007b"}]}', "printable text"),
    ],
)
def test_a_bad_keys_file_is_one_clear_line_and_exit_2(tmp_path, content, message):
    import subprocess

    path = tmp_path / "keys.json"
    path.write_text(content)
    proc = subprocess.run(
        [*kvblocks_command(), "serve", "--model", str(tiny_model_dir()), "--api-keys", str(path)],
        capture_output=True, text=True, env=cli_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert message in proc.stderr.strip().splitlines()[-1]


def test_a_bad_keys_file_is_refused_before_torch_is_imported(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "keys.json"
    path.write_text('{"keys": []}')
    code = (
        "import sys; from kvblocks.cli.commands import main\n"
        f"rc = main(['serve', '--port', '0', '--api-keys', {str(path)!r}])\n"
        "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=60
    )
    assert proc.stdout.split() == ["2", "False", "False"], proc.stderr


def test_the_cli_shows_a_tenant_its_own_cache(server):
    import subprocess

    def cli(*args: str) -> str:
        proc = subprocess.run(
            [*kvblocks_command(), *args, "--url", server.url, "--api-key", KEYS["globex"]],
            capture_output=True, text=True, env=cli_env(COLUMNS="200"), timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    complete(server, "acme", "ACME only: the Osprey budget is 12 million. Q: ok?")
    complete(server, "globex", "Globex only: the Pelican route. Q: ok?")
    assert "globex" in cli("stats")
    listing = cli("inspect", "--tree")
    assert "Pelican" in listing and "Osprey" not in listing
