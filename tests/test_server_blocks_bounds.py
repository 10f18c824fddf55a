"""KV blocks' bounds over real HTTP: blocks per request (`--max-blocks`) and their tokens
(`--max-block-tokens`) refused by name before queueing, empty blocks a 400, `prompt_blocks` without
a block a plain prompt, the render route, and one tenant's block work interleaved with another
tenant's request (the real model: a forward costs what it does in production)."""

from __future__ import annotations

import json
import statistics
import threading
import time

import httpx
import pytest
from server_proc import start_server, stop_cleanly, wait_idle

KEYS = {"attacker": "sk-attacker", "victim": "sk-victim", "ops": "sk-operator"}
MAX_BLOCK_TOKENS = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(
        json.dumps({"keys": [{"key": k, "tenant": t, "admin": t == "ops"} for t, k in KEYS.items()]})
    )
    path.chmod(0o644)
    server = start_server(
        "--served-model-name", "m", "--capacity", "8192", "--api-keys", str(path),
        "--max-block-tokens", str(MAX_BLOCK_TOKENS),
    )  # fmt: skip
    yield server
    stop_cleanly(server)


def http(server, tenant: str = "victim") -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=120)


def one_token_blocks(n: int, first: int) -> list[dict]:
    return [{"token_ids": [first + i], "block": True} for i in range(n)]


def refused(response: httpx.Response, param: str, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def test_more_blocks_than_max_blocks_is_a_400_naming_prompt_blocks_and_the_limit(server):
    body = {"model": "m", "max_tokens": 1, "kv_mode": "blend",
            "prompt_blocks": [{"text": "Notes:"}, *one_token_blocks(65, 1000)]}  # fmt: skip
    with http(server) as c:
        refused(c.post("/v1/completions", json=body), "prompt_blocks", "at most 64", "--max-blocks", "65")


def test_more_block_parts_than_max_blocks_is_a_400_naming_messages(server):
    parts = [{"type": "text", "text": f"doc {i}.", "kvblocks_block": True} for i in range(65)]
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": parts}]}
    with http(server) as c:
        refused(c.post("/v1/chat/completions", json=body), "messages", "at most 64", "--max-blocks")


def test_blocks_holding_more_than_max_block_tokens_are_a_400_naming_the_limit(server):
    blocks = [
        {"token_ids": list(range(1000, 1200)), "block": True},
        {"token_ids": list(range(2000, 2100)), "block": True},
    ]
    body = {"model": "m", "max_tokens": 1, "prompt_blocks": [{"text": "Notes:"}, *blocks]}
    with http(server) as c:
        refused(
            c.post("/v1/completions", json=body), "prompt_blocks", f"at most {MAX_BLOCK_TOKENS} tokens", "300"
        )


@pytest.mark.parametrize(
    ("block", "param", "word"),
    [
        ({"text": ""}, "prompt_blocks", "empty"),
        ({"token_ids": []}, "prompt_blocks[1].token_ids", "at least 1"),
    ],
)
def test_an_empty_block_is_a_400_naming_prompt_blocks(server, block, param, word):
    body = {"model": "m", "max_tokens": 1, "prompt_blocks": [{"text": "Notes:"}, {**block, "block": True}]}
    with http(server) as c:
        refused(c.post("/v1/completions", json=body), param, word)


def test_an_empty_block_part_is_a_400_naming_messages(server):
    parts = [{"type": "text", "text": "", "kvblocks_block": True}, {"type": "text", "text": "Hi"}]
    body = {
        "model": "m",
        "max_tokens": 1,
        "kv_mode": "blend",
        "messages": [{"role": "user", "content": parts}],
    }
    with http(server) as c:
        refused(c.post("/v1/chat/completions", json=body), "messages", "empty")


def test_prompt_blocks_without_a_block_are_a_plain_prompt(server):
    with http(server) as c:
        plain = c.post(
            "/v1/completions",
            json={"model": "m", "max_tokens": 3, "temperature": 0, "prompt": "The capital of France is"},
        )
        segments = c.post("/v1/completions", json={
            "model": "m", "max_tokens": 3, "temperature": 0, "kv_mode": "blend",
            "prompt_blocks": [{"text": "The capital of France is"}],
        })  # fmt: skip
    assert plain.status_code == segments.status_code == 200, segments.text
    assert segments.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    usage = segments.json()["usage"]
    assert usage["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
    assert "blended_tokens" not in (usage.get("prompt_tokens_details") or {})


def test_the_completions_render_route_renders_prompt_blocks_and_refuses_them_by_the_same_caps(server):
    blocks = [{"text": "Documents:\n"}, {"token_ids": [1000, 1001], "block": True}, {"text": "Question"}]
    with http(server) as c:
        rendered = c.post("/v1/completions/render", json={"model": "m", "prompt_blocks": blocks})
        head = c.post("/tokenize", json={"model": "m", "prompt": "Documents:\n"}).json()["tokens"]
        tail = c.post("/tokenize", json={"model": "m", "prompt": "Question", "add_special_tokens": False})
        over = c.post(
            "/v1/completions/render", json={"model": "m", "prompt_blocks": one_token_blocks(65, 1000)}
        )
    assert rendered.status_code == 200, rendered.text
    assert [r["token_ids"] for r in rendered.json()] == [head + [1000, 1001] + tail.json()["tokens"]]
    refused(over, "prompt_blocks", "at most 64")


def test_another_tenants_short_request_stays_fast_while_one_request_blends_64_one_token_blocks(server):
    """The attack of issue 41: as many one-token blocks as the cap allows, each a fill of its own, in
    `blend`. Their fills, probe and recompute run a forward per engine step beside the other tenant's
    steps, so its 4-token request waits about one block forward per step, not the whole block work."""

    def short(c: httpx.Client, i: int) -> float:
        started = time.monotonic()
        r = c.post(
            "/v1/completions",
            json={"model": "m", "prompt": f"Count: {i}", "max_tokens": 4, "ignore_eos": True},
        )
        assert r.status_code == 200, r.text
        return time.monotonic() - started

    with http(server) as victim, http(server, "attacker") as attacker, http(server, "ops") as ops:
        short(victim, 0)  # warm
        idle = statistics.median(short(victim, i) for i in (1, 2, 3))
        answer: dict = {}

        def attack() -> None:
            body = {"model": "m", "max_tokens": 2, "kv_mode": "blend",
                    "prompt_blocks": [{"text": "Notes:"}, *one_token_blocks(64, 3000), {"text": "Sum up."}]}  # fmt: skip
            started = time.monotonic()
            answer["response"] = attacker.post("/v1/completions", json=body)
            answer["s"] = time.monotonic() - started

        thread = threading.Thread(target=attack)
        thread.start()
        while ops.get("/v1/cache/stats").json()["engine"]["active"] == 0:  # the attack is running
            time.sleep(0.01)
        attacked = short(victim, 4)
        thread.join()
        wait_idle(ops)
    response = answer["response"]
    assert response.status_code == 200, response.text
    print(
        f"\nshort request: idle {idle:.2f} s, beside 64 blended blocks {attacked:.2f} s; the blocks {answer['s']:.2f} s"
    )
    details = response.json()["usage"]["prompt_tokens_details"]
    assert details["recomputed_tokens"] > 64  # blend rounds a one-token block's share up: all recomputed
    assert attacked < answer["s"]  # it did not wait for the block work
    assert attacked < 6 * idle, f"idle {idle:.2f} s, under attack {attacked:.2f} s"
