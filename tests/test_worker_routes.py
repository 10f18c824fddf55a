"""The worker endpoints routers read, over real HTTP against a real `kvblocks serve` (tiny model)
with API keys and a real Redis spill tier.

Render and tokenize must give exactly the ids the chat and completion routes prefill: checked
through the cache itself, by sending those ids back as a completion prompt and seeing every token
but the last one hit. `/flush_cache` empties the device tier only, unless asked for the spill tier
too, and the per-tier metrics say which tier served a restored prefix.
"""

from __future__ import annotations

import json
import secrets
import threading
import time

import httpx
import openai
import pytest
from redis_server import RedisServer
from server_proc import scrape, start_server, stop_cleanly, tiny_model_dir

MODEL = "tiny"
CONTEXT = 1024
KEYS = {"acme": "sk-acme-worker-0001", "ops": "sk-ops-worker-admin-0002", "lb": "sk-lb-worker-router-0003"}
SYSTEM = "You are the dispatcher of Acme Freight. Route every parcel by its zone, weight and priority. " * 6
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "track_parcel",
            "description": "Where a parcel is now.",
            "parameters": {
                "type": "object",
                "properties": {"parcel_id": {"type": "string"}},
                "required": ["parcel_id"],
            },
        },
    }
]
WORKER_GETS = ["/server_info", "/get_server_info", "/model_info", "/get_model_info", "/get_load"]
WORKER_POSTS = [
    "/tokenize",
    "/detokenize",
    "/v1/completions/render",
    "/v1/chat/completions/render",
    "/flush_cache",
]


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")).start() as server:
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory, redis):
    folder = tmp_path_factory.mktemp("worker")
    keys = folder / "keys.json"
    keys.write_text(
        json.dumps(
            {
                "keys": [
                    {"key": KEYS["acme"], "tenant": "acme"},
                    {"key": KEYS["ops"], "tenant": "ops", "admin": True},
                    {"key": KEYS["lb"], "tenant": "lb", "role": "router"},
                ]
            }
        )
    )
    secret = folder / "redis.secret"
    secret.write_text(secrets.token_hex(32))
    server = start_server(
        "--model", str(tiny_model_dir(context=CONTEXT)), "--served-model-name", MODEL, "--api-keys", str(keys),
        "--redis", redis.url, "--redis-secret-file", str(secret), "--redis-chunk-tokens", "16",
    )  # fmt: skip
    yield server
    stop_cleanly(server)


def http(server, who: str | None = "acme") -> httpx.Client:
    headers = {"Authorization": f"Bearer {KEYS[who]}"} if who else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=120.0)


def ok(response: httpx.Response) -> dict | list:
    assert response.status_code == 200, response.text
    return response.json()


def messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def cached_when_sent_as_ids(c: httpx.Client, ids: list[int]) -> int:
    """Cached tokens of a completion whose prompt is exactly `ids`."""
    out = ok(
        c.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0})
    )
    assert out["usage"]["prompt_tokens"] == len(ids)
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_idle(admin: httpx.Client) -> None:
    """Until nothing runs and every queued Redis write has landed."""
    deadline = time.monotonic() + 30.0
    while True:
        stats = ok(admin.get("/v1/cache/stats"))
        busy = stats["engine"]["active"] + stats["engine"]["queued"] + stats["cache"]["redis_queue_depth"]
        if busy == 0:
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)


# ---- registration ------------------------------------------------------------------------------


def test_server_and_model_info_name_the_served_model_its_weights_and_its_tokenizer(server):
    path = str(tiny_model_dir(context=CONTEXT))
    with http(server, "lb") as c:
        infos = [ok(c.get(p)) for p in ("/server_info", "/get_server_info", "/model_info", "/get_model_info")]
    for info in infos:
        assert (info["served_model_name"], info["model_path"], info["tokenizer_path"]) == (MODEL, path, path)
    server_info, model_info = infos[0], infos[2]
    assert infos[1] == server_info and infos[3] == model_info
    assert server_info["dp_size"] == 1 and server_info["context_length"] == CONTEXT
    assert server_info["max_total_tokens"] == server_info["prefix_cache"]["capacity_tokens"] > 0
    assert server_info["prefix_cache"]["spill_tier"] == {"chunk_tokens": 16}
    assert (
        "model" not in server_info and "model_id" not in server_info
    )  # sglang-router reads one as the other
    assert model_info["model_type"] == "llama" and model_info["architectures"] == ["LlamaForCausalLM"]
    assert model_info["is_generation"] is True and model_info["max_model_len"] == CONTEXT


def test_worker_endpoints_take_the_same_keys_as_every_other_endpoint(server):
    with http(server, None) as anonymous:
        for path in WORKER_GETS:
            assert anonymous.get(path).status_code == 401, path
        for path in WORKER_POSTS:
            assert anonymous.post(path, json={}).status_code == 401, path
    with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer sk-wrong"}) as wrong:
        assert wrong.get("/server_info").status_code == 401
    with http(server) as tenant:
        for path in ("/get_load", "/server_info", "/get_server_info", "/metrics"):
            hidden = tenant.get(path)
            assert hidden.status_code == 403 and hidden.json()["error"]["code"] == "router_or_admin_only", (
                path
            )
        assert tenant.get("/model_info").status_code == 200
        refused = tenant.post("/flush_cache")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_only"
    with http(server, "lb") as router:
        assert all(router.get(path).status_code == 200 for path in WORKER_GETS)
        assert router.post("/flush_cache").status_code == 403


def test_requests_without_a_model_are_served_by_the_served_model(server):
    with http(server) as c:
        for model in (None, "unknown"):  # sglang-router forwards "unknown" when the client named none
            body = {"messages": messages("Which zone is Lyon in?"), "max_tokens": 2}
            out = ok(c.post("/v1/chat/completions", json=body if model is None else body | {"model": model}))
            assert out["model"] == MODEL
        wrong = c.post(
            "/v1/chat/completions", json={"model": "gpt-4o", "messages": messages("x"), "max_tokens": 2}
        )
    assert wrong.status_code == 404


# ---- token ids ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["plain", "with tools"])
def test_chat_render_gives_exactly_the_ids_the_chat_route_prefills(server, tools):
    question = f"Where is parcel {secrets.token_hex(4)}?"
    body = {"model": MODEL, "messages": messages(question), "max_tokens": 3, "temperature": 0}
    if tools:
        body["tools"] = tools
    with http(server) as c:
        rendered = ok(c.post("/v1/chat/completions/render", json=body))
        ids = rendered["token_ids"]
        chat = ok(c.post("/v1/chat/completions", json=body))
        assert chat["usage"]["prompt_tokens"] == len(ids)
        assert cached_when_sent_as_ids(c, ids) == len(ids) - 1  # the chat route cached exactly these ids
        tokenized = ok(
            c.post("/tokenize", json={"model": MODEL, "messages": body["messages"], "tools": tools})
        )
        plain = ok(c.post("/tokenize", json={"messages": body["messages"]}))["tokens"]
    assert tokenized["tokens"] == ids and tokenized["count"] == len(ids)
    assert tokenized["max_model_len"] == CONTEXT and tokenized["token_strs"] is None
    assert rendered["model"] == MODEL and rendered["features"] is None and rendered["priority"] == 0
    assert rendered["sampling_params"]["max_tokens"] == 3 and rendered["sampling_params"]["temperature"] == 0
    assert (len(ids) > len(plain)) if tools else (ids == plain)


def test_completion_render_gives_one_entry_per_prompt_with_the_ids_the_route_prefills(server):
    prompts = [f"Parcel {secrets.token_hex(3)} left the depot at", "Zone 4 covers"]
    with http(server) as c:
        rendered = ok(
            c.post("/v1/completions/render", json={"prompt": prompts, "max_tokens": 2, "cache_salt": "s1"})
        )
        assert [r["cache_salt"] for r in rendered] == ["s1", "s1"]
        out = ok(c.post("/v1/completions", json={"model": MODEL, "prompt": prompts[0], "max_tokens": 2}))
        ids = rendered[0]["token_ids"]
        assert out["usage"]["prompt_tokens"] == len(ids)
        assert cached_when_sent_as_ids(c, ids) == len(ids) - 1
        tokenized = ok(c.post("/tokenize", json={"prompt": prompts[1], "return_token_strs": True}))
    assert tokenized["tokens"] == rendered[1]["token_ids"]
    assert "".join(tokenized["token_strs"]).replace("Ġ", " ") == prompts[1]


def test_detokenize_gives_back_the_rendered_text(server):
    with http(server) as c:
        ids = ok(c.post("/tokenize", json={"messages": messages("Is Brest in zone 2?")}))["tokens"]
        text = ok(c.post("/detokenize", json={"model": MODEL, "tokens": ids}))["prompt"]
        assert text.startswith("<|im_start|>system\n" + SYSTEM) and text.endswith("<|im_start|>assistant\n")
        again = ok(c.post("/tokenize", json={"prompt": text, "add_special_tokens": False}))["tokens"]
    assert again == ids


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        (
            "/tokenize",
            {"messages": messages("x"), "add_generation_prompt": False},
            400,
            "add_generation_prompt",
        ),
        (
            "/tokenize",
            {"messages": messages("x"), "continue_final_message": True},
            400,
            "continue_final_message",
        ),
        ("/tokenize", {"messages": messages("x"), "chat_template": "{{ 1 }}"}, 400, "chat_template"),
        ("/tokenize", {"messages": messages("x"), "add_special_tokens": True}, 400, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "messages": messages("x")}, 400, None),
        ("/tokenize", {}, 400, None),
        ("/tokenize", {"prompt": "a", "model": "gpt-4o"}, 404, "model"),
        ("/tokenize", {"prompt": "lorem ipsum " * CONTEXT}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "mystery": 1}, 400, "mystery"),
        ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, None),
        (
            "/v1/chat/completions/render",
            {"messages": messages("x"), "max_tokens": CONTEXT},
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions/render",
            {"messages": messages("x"), "tool_choice": "auto"},
            400,
            "tool_choice",
        ),
        ("/v1/completions/render", {"prompt": [1, 49152]}, 400, "prompt"),
    ],
)
def test_what_the_routes_would_refuse_is_refused_with_the_same_kind_of_error(
    server, path, body, status, param
):
    with http(server) as c:
        response = c.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and (param is None or error["param"] == param), error


# ---- load --------------------------------------------------------------------------------------


def test_get_load_reports_running_requests_and_the_tokens_they_hold(server):
    with http(server) as c, http(server, "lb") as router:
        idle = ok(router.get("/get_load"))
        assert idle == [
            {"dp_rank": 0, "num_reqs": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
        ]
        prompt = ok(c.post("/tokenize", json={"prompt": SYSTEM}))["count"]
    started, release = threading.Barrier(4), threading.Event()

    def stream() -> None:
        body = {
            "model": MODEL,
            "prompt": SYSTEM,
            "max_tokens": CONTEXT - prompt - 1,
            "ignore_eos": True,
            "stream": True,
        }
        with http(server) as client, client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            started.wait()
            release.wait()  # leave the stream open (and generating) while the load is read

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()
    started.wait()
    with http(server, "lb") as router:
        busy = ok(router.get("/get_load"))[0]
    release.set()
    for t in threads:
        t.join()
    assert busy["num_reqs"] == busy["num_running_reqs"] + busy["num_waiting_reqs"] == 3, busy
    assert busy["num_tokens"] > 3 * prompt, busy  # the prompts plus what has been generated so far


# ---- flushing ----------------------------------------------------------------------------------


def test_flush_cache_empties_the_device_tier_and_the_spill_tier_restores_it(server, redis):
    body = {"model": MODEL, "messages": messages(f"Zone of parcel {secrets.token_hex(4)}?"), "max_tokens": 2}
    with http(server) as c:
        prompt = ok(c.post("/v1/chat/completions", json=body))["usage"]["prompt_tokens"]
    with http(server, "ops") as admin:
        wait_idle(admin)  # the prompt's chunks are written through to Redis in the background
        flushed = ok(admin.post("/flush_cache"))
        assert flushed["flushed_tokens"] >= prompt and flushed["kept_tokens"] == 0
        assert flushed["spill_deleted_records"] is None
        assert ok(admin.get("/v1/cache/stats"))["cache"]["resident_tokens"] == 0
        before = scrape(admin)
        with http(server) as c:
            usage = ok(c.post("/v1/chat/completions", json=body))["usage"]
        after = scrape(admin)
        restored = usage["prompt_tokens_details"]["cached_tokens"]
        assert restored == (prompt - 1) // 16 * 16 > 0  # the prompt's whole 16-token chunks, from Redis
        redis_hits = 'kvblocks_prefix_cache_hit_tokens_total{tier="redis"}'
        device_hits = 'kvblocks_prefix_cache_hit_tokens_total{tier="device"}'
        assert after[redis_hits] - before[redis_hits] == restored
        assert after[device_hits] == before[device_hits]

        wait_idle(admin)
        emptied = ok(admin.post("/flush_cache", params={"spill": "true"}))
    assert emptied["flushed_tokens"] > 0 and emptied["spill_deleted_records"] > 0
    assert not list(redis.client().scan_iter(match="kvblocks:*"))
    with http(server) as c:
        cold = ok(c.post("/v1/chat/completions", json=body))["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]
    assert cold == 0


def test_openai_sdk_lists_the_served_model(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS["acme"], max_retries=0) as client:
        assert [m.id for m in client.models.list()] == [MODEL]
