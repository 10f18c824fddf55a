"""`kvblocks serve` with the real default model, over real HTTP, driven by the `openai` client.

One server process (SmolLM2-135M-Instruct, API key from KVBLOCKS_API_KEY) serves the whole module;
a CachedGenerator on the same model in this process gives the expected greedy outputs.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from server_proc import scrape, start_server, stop_cleanly, wait_idle

from kvblocks import CachedGenerator, KVCacheTrie
from kvblocks.server.guard import PUBLIC_PATHS

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "sk-test-from-env"
SYSTEM = (
    "You are Ada, a concise assistant for a bicycle repair shop. Answer in one short sentence, "
    "never invent prices, and suggest bringing the bike in when a repair needs tools."
)
QUESTIONS = [
    "How often should I oil my chain?",
    "What tyre pressure is right for a city bike?",
    "My brakes squeal. Why?",
    "How do I fix a flat tyre?",
    "Should I replace my cassette with the chain?",
    "What does a bike service include?",
    "Why does my gear skip under load?",
    "Is it safe to ride in the rain?",
]


def chat(question: str, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def server():
    server = start_server("--capacity", "4096", env={"KVBLOCKS_API_KEY": API_KEY}, api_key=API_KEY)
    yield server
    stop_cleanly(server)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def reference(smollm2):
    """Greedy outputs of the library on the same model, computed in this process."""
    model, tokenizer = smollm2
    gen = CachedGenerator(model, tokenizer, KVCacheTrie.for_model(model, capacity_tokens=2048))
    return lambda prompt, n: gen.generate(prompt, max_new_tokens=n, temperature=0.0)


# ---- outputs -----------------------------------------------------------------------------------


def test_chat_completion_equals_cached_generator_output(client, reference):
    want = reference(chat(QUESTIONS[0]), 10)
    r = client.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[0]), max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == want.prompt_tokens
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == want.prompt_tokens + len(want.token_ids)


def test_chat_stream_equals_cached_generator_output_and_ends_with_usage(client, reference):
    want = reference(chat(QUESTIONS[1]), 10)
    client.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[0]), max_tokens=1)  # caches SYSTEM
    stream = client.chat.completions.create(
        model=MODEL,
        messages=chat(QUESTIONS[1]),
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == len(want.token_ids)
    assert usage.prompt_tokens == want.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_completion_equals_cached_generator_output_streamed_or_not(client, reference):
    prompt = "The three primary colors of light are"
    want = reference(prompt, 8)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == want.text
    assert r.usage.prompt_tokens == want.prompt_tokens
    assert r.usage.completion_tokens == len(want.token_ids)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == want.text


def test_second_request_sharing_a_system_prompt_reports_cached_tokens(client, smollm2):
    system = "You are a librarian. Recommend exactly one classic novel and say why in a sentence."
    tokenizer = smollm2[1]
    turn = tokenizer.apply_chat_template([{"role": "system", "content": system}], tokenize=False)
    system_tokens = len(tokenizer(turn, add_special_tokens=False)["input_ids"])
    assert system_tokens > 15
    first = client.chat.completions.create(
        model=MODEL, messages=chat("I like sea stories.", system), max_tokens=2, temperature=0
    )
    second = client.chat.completions.create(
        model=MODEL, messages=chat("I like mysteries.", system), max_tokens=2, temperature=0
    )
    assert first.usage.prompt_tokens_details.cached_tokens < system_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= system_tokens


def test_eight_concurrent_streams_each_get_their_sequential_output(server, reference):
    want = [reference(chat(q), 4).text for q in QUESTIONS]
    got: list[str | None] = [None] * len(QUESTIONS)
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * len(QUESTIONS)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(QUESTIONS))

    def run(i: int) -> None:
        try:
            with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as c:
                barrier.wait()
                start = time.monotonic()
                stream = c.chat.completions.create(
                    model=MODEL, messages=chat(QUESTIONS[i]), max_tokens=4, temperature=0, stream=True
                )
                got[i] = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
                spans[i] = (start, time.monotonic())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert got == want
    assert max(s for s, _ in spans) < min(e for _, e in spans), "the streams did not overlap"


# ---- cancellation ------------------------------------------------------------------------------


def test_disconnect_mid_stream_releases_locks_and_counts_a_cancel(reference):
    """The client reads two chunks and hangs up while the server is still generating. A server of its
    own that runs one request per forward: the batched engine decodes the tiny model faster than the
    client reads two chunks and hangs up, so the reply would be finished before the disconnect (the
    batched engine's own cancellation is tested in test_batch_engine.py; the server sets the same
    flag for either engine)."""
    args = ["--capacity", "4096", "--max-batch-size", "1"]
    server = start_server(*args, env={"KVBLOCKS_API_KEY": API_KEY}, api_key=API_KEY)
    try:
        with (
            server.client() as http,
            openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as client,
        ):
            _disconnect_mid_stream(server, http, client, reference)
    finally:
        stop_cleanly(server)


def _disconnect_mid_stream(server, http, client, reference):
    prompt = "Counting up by ones: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"  # goes on for a while
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)  # cache it: the stream locks it
    before = scrape(http)["kvblocks_requests_cancelled_total"]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        # One iterator kept open: leaving a `for` over `iter_lines()` closes the generator, which
        # closes the connection at once, and the server may see the hang-up before the stats call.
        lines = response.iter_lines()
        data = []
        while len(data) < 2:
            line = next(lines)
            if line.startswith("data: "):
                data.append(json.loads(line[6:]))
        during = http.get("/v1/cache/stats").json()
    assert all(d["choices"][0]["finish_reason"] is None for d in data)
    assert during["engine"]["active"] == 1
    assert during["cache"]["locked_tokens"] > 0  # the cached prompt is locked while in use
    wait_idle(http)
    assert scrape(http)["kvblocks_requests_cancelled_total"] == before + 1
    want = reference(chat(QUESTIONS[3]), 4)
    r = client.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[3]), max_tokens=4, temperature=0)
    assert r.choices[0].message.content == want.text


# ---- tenants and keys --------------------------------------------------------------------------


def test_cache_salt_keeps_tenants_from_sharing_prefixes(client):
    prompt = "Tenant-private notes: the quarterly numbers for the northern region look"

    def complete(salt: str):
        return client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body={"cache_salt": salt}
        )

    a1, a2, b = complete("tenant-a"), complete("tenant-a"), complete("tenant-b")
    assert a1.usage.prompt_tokens_details.cached_tokens == 0
    assert a2.usage.prompt_tokens_details.cached_tokens == a2.usage.prompt_tokens - 1
    assert b.usage.prompt_tokens_details.cached_tokens == 0
    assert a1.choices[0].text == a2.choices[0].text == b.choices[0].text


def test_api_key_from_env_guards_every_endpoint_but_health(server, http):
    assert httpx.get(f"{server.url}/health").status_code == 200
    spec = http.get("/openapi.json").json()
    routes = [(method.upper(), path) for path, item in spec["paths"].items() for method in item]
    assert ("POST", "/v1/chat/completions") in routes and ("GET", "/metrics") in routes
    for method, path in [*routes, ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc")]:
        if path in PUBLIC_PATHS:  # /health and /health_generate: routers probe them without a key
            continue
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY}):
            r = httpx.request(method, f"{server.url}{path}", headers=headers, json={})
            assert r.status_code == 401, (method, path, headers, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
            assert "API key" in error["message"]


def test_openai_client_with_a_wrong_key_gets_an_authentication_error(server):
    with (
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0) as c,
        pytest.raises(openai.AuthenticationError) as info,
    ):
        c.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=1)
    assert info.value.status_code == 401


def test_models_lists_the_served_model_and_an_unknown_model_is_not_found(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=chat("hi"), max_tokens=1)
    assert info.value.body["code"] == "model_not_found"


# ---- metrics -----------------------------------------------------------------------------------


def test_metrics_counters_and_histograms_move_after_requests(http, client):
    prompt = "A haiku about prefix caches:"

    def complete():
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0).usage

    s0 = scrape(http)
    u1 = complete()
    s1 = scrape(http)
    u2 = complete()
    s2 = scrape(http)
    n, g, c1 = u1.prompt_tokens, u1.completion_tokens, u1.prompt_tokens_details.cached_tokens
    first = lambda name: s1[name] - s0[name]  # noqa: E731
    second = lambda name: s2[name] - s1[name]  # noqa: E731
    assert first("kvblocks_requests_total") == 1
    assert first("kvblocks_prompt_tokens_total") == n
    assert first("kvblocks_generation_tokens_total") == g
    assert first("kvblocks_prefix_cache_queries_total") == 1
    assert first('kvblocks_prefix_cache_queried_tokens_total{tier="device"}') == n
    assert first('kvblocks_prefix_cache_hit_tokens_total{tier="device"}') == c1
    assert first("kvblocks_prefix_cache_inserted_tokens_total") == n + g - 1 - c1  # last token: no KV
    assert first("kvblocks_time_to_first_token_seconds_count") == 1
    assert first("kvblocks_inter_token_seconds_count") == g - 1
    assert first("kvblocks_time_to_first_token_seconds_sum") > 0
    # the same prompt again: all but its last token hit, and nothing new is stored
    assert second("kvblocks_cached_prompt_tokens_total") == u2.prompt_tokens_details.cached_tokens == n - 1
    assert second('kvblocks_prefix_cache_hit_tokens_total{tier="device"}') == n - 1
    assert second("kvblocks_prefix_cache_inserted_tokens_total") == 0
    assert "kvblocks_prefix_cache_evicted_tokens_total" in s2
    assert (
        0 < s2["kvblocks_prefix_cache_resident_tokens"] <= s2["kvblocks_prefix_cache_capacity_tokens"] == 4096
    )
    assert (
        s2["kvblocks_prefix_cache_resident_bytes"]
        == http.get("/v1/cache/stats").json()["cache"]["resident_bytes"]
    )
    assert (
        s2['kvblocks_time_to_first_token_seconds_bucket{le="+Inf"}']
        == (s2["kvblocks_time_to_first_token_seconds_count"])
    )
    text = http.get("/metrics").text
    assert "# TYPE kvblocks_requests_total counter" in text
    assert "# TYPE kvblocks_inter_token_seconds histogram" in text
    assert "# TYPE kvblocks_prefix_cache_resident_tokens gauge" in text
