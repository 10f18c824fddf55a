"""`kvblocks stats / inspect / explain` against a running `kvblocks serve`.

The server is a real process (tiny random model, SmolLM2's tokenizer, a 160-token device pool so
that evictions are cheap to cause). The CLI runs in-process through `kvblocks.cli.commands.main` (it only
speaks HTTP, and a fresh `kvblocks` process costs seconds of imports); the unreachable-server case
runs the real console script to show the whole process prints one line and no traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import httpx
import pytest
from redis_server import free_port
from server_proc import (
    cli_env,
    kvblocks_command,
    scrape,
    start_server,
    stop_cleanly,
    tiny_model_dir,
    wait_idle,
)

from kvblocks.cli.commands import main

MODEL = "tiny"
API_KEY = "sk-inspect"
CAPACITY = 160


@pytest.fixture(scope="module")
def server():
    server = start_server(
        "--model", str(tiny_model_dir()), "--served-model-name", MODEL, "--api-key", API_KEY,
        "--capacity", str(CAPACITY), "--default-max-tokens", "4",
        api_key=API_KEY,
    )  # fmt: skip
    yield server
    stop_cleanly(server)


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    """Rich wraps to $COLUMNS; wide enough that previews are not cut mid-word."""
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("KVBLOCKS_API_KEY", raising=False)
    monkeypatch.delenv("KVBLOCKS_URL", raising=False)


@pytest.fixture
def kvblocks(server, capsys):
    """Run `kvblocks ARGS --url URL --api-key KEY` in-process: (exit status, stdout, stderr)."""

    def run(*args: str, key: str | None = API_KEY, url: str | None = None) -> tuple[int, str, str]:
        auth = ["--api-key", key] if key is not None else []
        code = main([*args, "--url", url or server.url, *auth])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def complete(http: httpx.Client, prompt, max_tokens: int = 2, salt: str | None = None) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "cache_salt": salt}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def explain_json(kvblocks, *args: str) -> dict:
    code, out, err = kvblocks("explain", *args, "--json")
    assert code == 0, err
    return json.loads(out)


# ---- stats -------------------------------------------------------------------------------------


def test_stats_prints_hit_rate_occupancy_and_engine_state(kvblocks, http):
    complete(http, "Stats warm-up: the shared opening of two requests, then one")
    complete(http, "Stats warm-up: the shared opening of two requests, then two")
    code, out, err = kvblocks("stats")
    assert code == 0, err
    cache = http.get("/v1/cache/stats").json()["cache"]
    assert "kvblocks cache (since server start)" in out
    assert f"{cache['hit_tokens'] / cache['queried_tokens']:.1%}" in out
    assert f"/ {CAPACITY} tokens" in out
    for row in ("model", "hit rate, device", "hit rate, total", "prefill tokens saved", "evicted tokens"):
        assert row in out
    assert "engine active / queued" in out and "0 / 0" in out


def test_stats_json_is_the_servers_stats(kvblocks, http):
    code, out, _ = kvblocks("stats", "--json")
    assert code == 0
    stats = json.loads(out)
    assert stats["model"] == MODEL
    assert stats["cache"]["capacity_tokens"] == CAPACITY
    engine = stats["engine"]
    assert {"active": 0, "queued": 0, "cuda_graphs": None}.items() <= engine.items()  # no graphs on a CPU
    assert engine["attention_kernel"] in (None, {"in_use": True, "reason": None})  # None: serial engine
    assert stats["counters"]["kvblocks_requests_total"] >= 2


def test_stats_plot_samples_for_the_duration_and_writes_a_png(kvblocks, http, server, tmp_path):
    out_png = tmp_path / "cache.png"

    def traffic() -> None:
        with server.client() as c:
            for i in range(4):
                complete(c, f"Plot traffic {i % 2}: a prompt that repeats so the hit rate moves")

    sender = threading.Thread(target=traffic)
    sender.start()
    code, _, err = kvblocks("stats", "--plot", str(out_png), "--duration", "3", "--interval", "1")
    sender.join()
    assert code == 0, err
    assert f"wrote {out_png}" in err
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- inspect -----------------------------------------------------------------------------------


def test_inspect_tree_shows_the_cached_prefixes_and_the_trie(kvblocks, http):
    prompt = "Zebra crossings are painted in stripes because"
    complete(http, prompt)
    complete(http, prompt)  # a hit, so it ranks among the top prefixes
    code, out, err = kvblocks("inspect", "--top", "3", "--tree")
    assert code == 0, err
    assert "top cached prefixes" in out
    assert "Zebra crossings are painted" in out
    assert "trie" in out and "tok (to " in out and "hits=" in out


# ---- explain -----------------------------------------------------------------------------------


def test_explain_reports_cached_for_a_prompt_sent_before(kvblocks, http):
    messages = [
        {"role": "system", "content": "You answer riddles."},
        {"role": "user", "content": "What has keys?"},
    ]
    http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2})
    code, out, err = kvblocks("explain", "--system", "You answer riddles.", "What has keys?")
    assert code == 0, err
    assert out.startswith("cached: every prompt token but the last is cached")
    e = explain_json(kvblocks, "--system", "You answer riddles.", "What has keys?")
    assert e["reason"] == "cached" and e["cached_tokens"] == e["prompt_tokens"] - 1


def test_explain_reports_never_seen_for_a_new_prompt(kvblocks):
    e = explain_json(kvblocks, "--raw", "Quantum chromodynamics lecture notes, week nine")
    assert e["reason"] == "never_seen"
    assert e["cached_tokens"] == 0 and e["divergence"] == 0


def test_explain_reports_namespace_mismatch_for_another_tenants_salt(kvblocks, http):
    prompt = "Tenant notes: the quarterly numbers for the northern region"
    complete(http, prompt, salt="tenant-a")
    other = explain_json(kvblocks, "--raw", prompt, "--salt", "tenant-b")
    assert other["reason"] == "namespace_mismatch" and other["cached_tokens"] == 0
    assert explain_json(kvblocks, "--raw", prompt, "--salt", "tenant-a")["reason"] == "cached"
    assert explain_json(kvblocks, "--raw", prompt)["reason"] == "namespace_mismatch"


def test_explain_reports_a_tokenization_boundary_after_a_trailing_space(kvblocks, http):
    """The prefix was cached alone, ending in the token 'Ġ'; inside the longer text BPE merges that
    space into 'ĠHelp', so the ids diverge although the text is the same."""
    complete(http, "You are a helpful assistant. ", max_tokens=4)  # its reply is cached after it
    prompt = "You are a helpful assistant. Help me fix my bike."
    e = explain_json(kvblocks, "--raw", prompt)
    assert e["reason"] == "tokenization_boundary"
    assert e["cached_tokens"] == e["divergence"] == 6
    assert e["cached_side"][0]["id"] == 216 and e["cached_side"][0]["text"] == " "
    assert e["prompt_side"][0]["text"] == " Help"
    code, out, _ = kvblocks("explain", "--raw", prompt)
    assert code == 0
    assert out.startswith("tokenization_boundary: ")
    assert "diverges at token 6" in out and "216:' '" in out


def test_explain_reports_evicted_after_the_pool_fills_up(kvblocks, http):
    victim = (
        "Evicted soon: a long prompt about lighthouses, tides, harbours, the ships they guide home "
        "through fog and storms, and the keepers who trimmed their lamps every night of the year"
    )
    complete(http, victim)
    assert explain_json(kvblocks, "--raw", victim)["reason"] == "cached"
    before = scrape(http)["kvblocks_prefix_cache_evicted_tokens_total"]
    for i in range(10):  # newer prompts push the least recently used one out of the 160-token pool
        complete(http, f"Filler {i}: unrelated text about mountains, rivers, forests and valleys {i}")
    assert scrape(http)["kvblocks_prefix_cache_evicted_tokens_total"] > before
    e = explain_json(kvblocks, "--raw", victim)
    assert e["reason"] == "evicted"
    assert e["cached_tokens"] < 16 <= int(e["detail"].split()[2])
    code, out, _ = kvblocks("explain", "--raw", victim)
    assert code == 0 and out.startswith("evicted: the first ")
    wait_idle(http)


# ---- errors ------------------------------------------------------------------------------------


def test_an_unreachable_server_is_one_line_on_stderr_and_a_nonzero_exit():
    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [*kvblocks_command(), "stats", "--url", url],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=120,
    )
    assert done.returncode != 0
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"kvblocks: error: cannot reach a kvblocks server at {url}")


@pytest.mark.parametrize(
    "args", [("stats",), ("inspect", "--tree"), ("explain", "hello")], ids=["stats", "inspect", "explain"]
)
def test_every_command_reports_an_unreachable_server_in_one_line(kvblocks, args):
    code, out, err = kvblocks(*args, url=f"http://127.0.0.1:{free_port()}")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "cannot reach a kvblocks server" in err


@pytest.mark.parametrize("key", ["wrong-key", None], ids=["wrong", "missing"])
def test_a_wrong_or_missing_api_key_is_one_clear_line(kvblocks, key):
    code, out, err = kvblocks("stats", key=key)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "rejected the API key" in err


def test_the_api_key_can_come_from_the_environment(kvblocks, monkeypatch):
    monkeypatch.setenv("KVBLOCKS_API_KEY", API_KEY)
    code, out, _ = kvblocks("stats", "--json", key=None)
    assert code == 0 and json.loads(out)["model"] == MODEL


def test_a_request_the_server_rejects_is_one_line_with_its_message(kvblocks):
    code, out, err = kvblocks("explain", "--raw", "word " * 400)
    assert code == 2 and out == ""
    assert err.count("\n") == 1
    assert "server answered 400" in err and "context" in err


def test_plot_without_matplotlib_is_one_clear_line(kvblocks, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    code, out, err = kvblocks("stats", "--plot", str(tmp_path / "cache.png"), "--duration", "0")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "--plot needs matplotlib" in err


def test_the_clis_copies_of_library_constants_match_the_library():
    # cli/args.py keeps its own copies so `--help` and the HTTP-only commands start without torch.
    from kvblocks.cli import args as cli
    from kvblocks.generate import tools
    from kvblocks.spill.redis_tier import DEFAULT_TTL_S

    assert tuple(tools.PARSERS) == cli.TOOL_PARSERS
    assert cli.DEFAULT_REDIS_TTL_S == DEFAULT_TTL_S
