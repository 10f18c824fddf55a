"""KV blocks seen from outside over real HTTP: `POST /v1/cache/explain` and `kvblocks explain` on
block-marked prompts (chat parts, `prompt_blocks`) under each `kv_mode`, and `/metrics` counting
reused block tokens by the tier their KV came from."""

from __future__ import annotations

import time

import httpx
import pytest
from server_proc import scrape, start_server, stop_cleanly, tiny_model_dir, wait_idle

from kvblocks.cli.commands import main

API_KEY = "sk-explain-blocks"
DOCS = [
    "Supplier register, page 1. The code of Vendor Q7 is 4821. Vendor Q7 is based in Oslo.\n\n",
    "Supplier register, page 2. The code of Vendor K2 is 1934. Vendor K2 is based in Lyon.\n\n",
]
QUESTION = "What is the code of Vendor K2?"
REUSED = "kvblocks_block_reused_tokens_total"


@pytest.fixture(scope="module")
def server():
    server = start_server(
        "--model", str(tiny_model_dir(context=1024)), "--served-model-name", "m", "--capacity", "4096",
        "--api-key", API_KEY,
        api_key=API_KEY,
    )  # fmt: skip
    yield server
    stop_cleanly(server)


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


def messages(order: list[int], question: str = QUESTION) -> list[dict]:
    parts = [{"type": "text", "text": DOCS[i], "kvblocks_block": True} for i in order]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def post(http: httpx.Client, path: str, body: dict) -> dict:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def chat(http: httpx.Client, order: list[int], question: str = QUESTION, **extra) -> dict:
    body = {"model": "m", "messages": messages(order, question), "max_tokens": 2, "temperature": 0}
    return post(http, "/v1/chat/completions", body | extra)


def tiers(http: httpx.Client) -> dict[str, float]:
    wait_idle(http)
    samples = scrape(http)
    return {t: samples[f'{REUSED}{{tier="{t}"}}'] for t in ("device", "redis", "fill")}


def test_explain_names_each_block_its_offset_and_whether_the_store_holds_it(http):
    question = "Which vendor is in Oslo?"
    before = post(http, "/v1/cache/explain", {"messages": messages([1, 0], question), "kv_mode": "concat"})
    assert before["kv_mode"] == "concat" and before["reason"] == "never_seen"  # the exact explanation too
    assert [b["held"] for b in before["blocks"]] == [False, False]
    chat(http, [0, 1], question, kv_mode="concat")  # stores both blocks, at other offsets
    after = post(http, "/v1/cache/explain", {"messages": messages([1, 0], question), "kv_mode": "concat"})
    first, second = after["blocks"]
    assert first["held"] and second["held"] and second["offset"] == first["offset"] + first["length"]
    assert first["device_tokens"] == first["length"] and first["redis_tokens"] == 0
    assert [b["reused_tokens"] for b in after["blocks"]] == [b["length"] for b in after["blocks"]]
    r = chat(http, [1, 0], question, kv_mode="concat")
    assert r["usage"]["prompt_tokens_details"]["blended_tokens"] == first["length"] + second["length"]
    assert r["usage"]["prompt_tokens"] == after["prompt_tokens"]


def test_explain_takes_prompt_blocks_and_the_reuse_follows_kv_mode(http):
    blocks = [{"text": "Documents:\n"}, *({"text": d, "block": True} for d in DOCS), {"text": QUESTION}]
    answers = {
        mode: post(
            http, "/v1/cache/explain", {"prompt_blocks": blocks, "kv_mode": mode, "blend_recompute": 0.5}
        )
        for mode in ("exact", "blend", "concat")
    }
    lengths = [b["length"] for b in answers["concat"]["blocks"]]
    assert [b["reused_tokens"] for b in answers["exact"]["blocks"]] == [0, 0]
    assert [b["reused_tokens"] for b in answers["concat"]["blocks"]] == lengths
    assert [b["reused_tokens"] for b in answers["blend"]["blocks"]] == [n - -(-n // 2) for n in lengths]
    assert answers["blend"]["blend_recompute"] == 0.5
    assert answers["exact"]["prompt_tokens"] == answers["concat"]["prompt_tokens"]


def test_explain_refuses_a_prompt_given_twice_by_name(http):
    response = http.post("/v1/cache/explain", json={"prompt": "x", "prompt_blocks": [{"text": "y"}]})
    assert response.status_code == 400
    assert "exactly one of 'prompt', 'messages' or 'prompt_blocks'" in response.json()["error"]["message"]


def test_kvblocks_explain_prints_the_blocks(server, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    args = ["explain", "What is the code?", "--block", DOCS[0], "--block", DOCS[1], "--kv-mode", "blend"]
    code = main([*args, "--url", server.url, "--api-key", API_KEY])
    out = capsys.readouterr().out
    assert code == 0
    assert "kv_mode blend (blend_recompute 0.15):" in out
    assert "block 0: " in out and "block 1: " in out and "would be reused" in out


def test_metrics_count_reused_block_tokens_by_the_tier_they_came_from(http):
    question = "Where is Vendor Q7 based?"
    start = tiers(http)
    first = chat(http, [0], question + " ", kv_mode="concat")
    filled = tiers(http)
    blended = first["usage"]["prompt_tokens_details"]["blended_tokens"]
    fill_delta = filled["fill"] - start["fill"]
    assert fill_delta + filled["device"] - start["device"] == blended  # each reused token counted once
    again = chat(http, [0], question + "  ", kv_mode="concat")
    end = tiers(http)
    assert end["device"] - filled["device"] == again["usage"]["prompt_tokens_details"]["blended_tokens"] > 0
    assert end["fill"] == filled["fill"] and end["redis"] == start["redis"] == 0


def test_a_block_marked_in_an_exact_request_is_promoted_once_the_batched_engine_is_idle(http):
    """The default server batches: an exact chat with a block part runs in the packed batch, and its
    block reaches the block store after the reply, where explain and a concat request find it."""
    doc = "Supplier register, page 3. The code of Vendor M5 is 7710. Vendor M5 is based in Porto.\n\n"
    question = "What is the code of Vendor M5?"
    body = [{"role": "user", "content": [{"type": "text", "text": doc, "kvblocks_block": True},
                                         {"type": "text", "text": question}]}]  # fmt: skip
    explain = {"messages": body, "kv_mode": "concat"}
    assert [b["held"] for b in post(http, "/v1/cache/explain", explain)["blocks"]] == [False]
    exact = post(
        http, "/v1/chat/completions", {"model": "m", "messages": body, "max_tokens": 2, "temperature": 0}
    )
    assert "blended_tokens" not in exact["usage"]["prompt_tokens_details"]
    deadline = time.monotonic() + 30
    while not post(http, "/v1/cache/explain", explain)["blocks"][0]["held"]:
        assert time.monotonic() < deadline, "the marked block was never promoted"
        time.sleep(0.1)
    moved = [
        {"role": "user", "content": [{"type": "text", "text": "Read this first.\n\n"}, *body[0]["content"]]}
    ]
    before = tiers(http)
    concat = {"model": "m", "messages": moved, "max_tokens": 2, "kv_mode": "concat"}
    blended = post(http, "/v1/chat/completions", concat)["usage"]["prompt_tokens_details"]["blended_tokens"]
    after = tiers(http)
    assert blended > 0 and after["device"] - before["device"] == blended  # the promoted KV, at a new offset
    assert after["fill"] == before["fill"]  # nothing computed for it now
    assert scrape(http)['kvblocks_block_promotions_total{outcome="done"}'] >= 1
