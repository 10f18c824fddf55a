"""Bad input to `kvblocks serve`: every bad request gets a 4xx with an OpenAI-style error body, the
server never answers 5xx, stays up and leaks no trie locks.

A tiny random model with SmolLM2's tokenizer (context 256) keeps each request to milliseconds,
so hypothesis can post hundreds of random and mutated bodies.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_proc import TINY_CONTEXT, start_server, stop_cleanly, tiny_model_dir, wait_idle

MODEL = "tiny"
API_KEY = "sk-fuzz-key"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EXPLAIN = "/v1/cache/explain"
VALID = {
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 3},
    COMPLETIONS: {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3},
    EXPLAIN: {"prompt": "Once upon a time"},
}


@pytest.fixture(scope="module")
def server():
    server = start_server(
        "--model", str(tiny_model_dir()), "--served-model-name", MODEL, "--api-key", API_KEY,
        "--capacity", "2048", "--default-max-tokens", "4",
        api_key=API_KEY,
    )  # fmt: skip
    yield server
    stop_cleanly(server)


@pytest.fixture(scope="module")
def http(server):
    with server.client(timeout=60) as c:
        yield c


def assert_openai_error(response: httpx.Response, status: int | None = None) -> dict:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    if status is not None:
        assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert {"param", "code"} <= error.keys()
    return error


def assert_served(response: httpx.Response) -> None:
    """200 with a well-formed body (JSON, or SSE ending in [DONE] without an error event), or a 4xx."""
    if response.status_code != 200:
        assert_openai_error(response)
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", response.text
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        response.json()


@pytest.fixture(autouse=True)
def server_stays_healthy(server, http):
    yield
    assert server.alive(), server.stderr()
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    wait_idle(http)


# ---- bad input, case by case ---------------------------------------------------------------------

LONG_TEXT = "lorem ipsum " * TINY_CONTEXT
BAD_BODIES = {
    "chat missing messages": (CHAT, {"model": MODEL}, 400, "messages"),
    "chat empty messages": (CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    "chat messages not a list": (CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages"),
    "chat unknown role": (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    "chat content a number": (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, None),
    "chat n over the limit": (CHAT, {**VALID[CHAT], "n": 17}, 400, "n"),
    "chat max_tokens 0": (CHAT, {**VALID[CHAT], "max_tokens": 0}, 400, "max_tokens"),
    "chat max_completion_tokens -1": (CHAT, {**VALID[CHAT], "max_completion_tokens": -1}, 400, None),
    "chat max_tokens past the context": (CHAT, {**VALID[CHAT], "max_tokens": TINY_CONTEXT}, 400, "max_tokens"),
    "chat max_tokens huge": (CHAT, {**VALID[CHAT], "max_tokens": 2**70}, 400, "max_tokens"),
    "chat prompt longer than the context": (
        CHAT, {"model": MODEL, "messages": [{"role": "user", "content": LONG_TEXT}]}, 400, "messages"),
    "chat unknown model": (CHAT, {**VALID[CHAT], "model": "gpt-4o"}, 404, "model"),
    "chat temperature a string": (CHAT, {**VALID[CHAT], "temperature": "hot"}, 400, "temperature"),
    "chat temperature above 2": (CHAT, {**VALID[CHAT], "temperature": 2.5}, 400, "temperature"),
    "chat top_p 0": (CHAT, {**VALID[CHAT], "top_p": 0}, 400, "top_p"),
    "chat top_k below -1": (CHAT, {**VALID[CHAT], "top_k": -2}, 400, "top_k"),
    "chat 17 stop strings": (CHAT, {**VALID[CHAT], "stop": ["x"] * 17}, 400, "stop"),
    "chat seed beyond 64 bits": (CHAT, {**VALID[CHAT], "seed": 2**64, "temperature": 1}, 400, "seed"),
    "chat stream not a bool": (CHAT, {**VALID[CHAT], "stream": [1]}, 400, "stream"),
    "completion missing prompt": (COMPLETIONS, {"model": MODEL}, 400, "prompt"),
    "completion empty prompt": (COMPLETIONS, {"model": MODEL, "prompt": ""}, 400, "prompt"),
    "completion empty id list": (COMPLETIONS, {"model": MODEL, "prompt": []}, 400, None),
    "completion prompt a dict": (COMPLETIONS, {"model": MODEL, "prompt": {"a": 1}}, 400, None),
    "completion prompt longer than the context": (COMPLETIONS, {"model": MODEL, "prompt": LONG_TEXT}, 400, "prompt"),
    "completion id list longer than the context": (
        COMPLETIONS, {"model": MODEL, "prompt": [42] * TINY_CONTEXT}, 400, "prompt"),
    "completion id outside the vocabulary": (COMPLETIONS, {"model": MODEL, "prompt": [1, 49152]}, 400, "prompt"),
    "completion id beyond 64 bits": (COMPLETIONS, {"model": MODEL, "prompt": [2**70]}, 400, "prompt"),
    "completion negative id": (COMPLETIONS, {"model": MODEL, "prompt": [-1]}, 400, None),
    "completion max_tokens -1": (COMPLETIONS, {**VALID[COMPLETIONS], "max_tokens": -1}, 400, "max_tokens"),
    "completion max_tokens zero": (COMPLETIONS, {**VALID[COMPLETIONS], "max_tokens": 0}, 400, "max_tokens"),
    "completion unknown model": (COMPLETIONS, {**VALID[COMPLETIONS], "model": "nope"}, 404, "model"),
    "completion best_of below n": (COMPLETIONS, {**VALID[COMPLETIONS], "n": 3, "best_of": 2}, 400, "best_of"),
    "explain both prompt and messages": (
        EXPLAIN, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    "explain neither prompt nor messages": (EXPLAIN, {}, 400, "prompt"),
    "explain negative id": (EXPLAIN, {"prompt": [5, -3]}, 400, "prompt"),
    "explain id beyond int32": (EXPLAIN, {"prompt": [2**40, 5]}, 400, "prompt"),
    "explain id outside the vocabulary": (EXPLAIN, {"prompt": [10**6, 5, 6]}, 400, "prompt"),
    "explain empty messages": (EXPLAIN, {"messages": []}, 400, "prompt"),
}  # fmt: skip


@pytest.mark.parametrize("path, body, status, param", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_body_gets_an_openai_style_4xx(http, path, body, status, param):
    error = assert_openai_error(http.post(path, json=body), status)
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, EXPLAIN])
def test_malformed_json_gets_an_openai_style_400(http, path):
    response = http.post(
        path, content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"}
    )
    assert assert_openai_error(response, 400)["message"].startswith("the request body is not valid JSON")


@pytest.mark.parametrize(
    "content, content_type",
    [(b"[1, 2]", "application/json"), (b"", "application/json"), (b'"\xff\xfe"', "application/json"),
     (json.dumps(VALID[COMPLETIONS]).encode(), "text/plain"), (b"model=tiny", "application/x-www-form-urlencoded")],
)  # fmt: skip
def test_a_body_that_is_not_a_json_object_gets_an_openai_style_400(http, content, content_type):
    assert_openai_error(http.post(COMPLETIONS, content=content, headers={"content-type": content_type}), 400)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_a_missing_or_wrong_api_key_gets_an_openai_style_401(server, headers):
    response = httpx.post(f"{server.url}{COMPLETIONS}", json=VALID[COMPLETIONS], headers=headers)
    assert assert_openai_error(response, 401)["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    "method, path, status",
    [("GET", "/v1/nothing-here", 404), ("GET", CHAT, 405), ("GET", "/v1/cache/prefixes?limit=0", 400),
     ("GET", "/v1/cache/prefixes?limit=many", 400), ("GET", "/v1/cache/prefixes?tree=maybe", 400)],
)  # fmt: skip
def test_unknown_routes_and_bad_query_parameters_get_an_openai_style_error(http, method, path, status):
    assert_openai_error(http.request(method, path), status)


@pytest.mark.parametrize(
    "extra",
    [{"temperature": 5e-324}, {"temperature": 1e-40, "seed": 3}, {"temperature": 1, "top_p": 1e-300},
     {"temperature": 1, "top_k": 10**12}, {"temperature": 1, "seed": 2**64 - 1}, {"seed": -(2**63)},
     {"stop": ["", "\x00"]}, {"cache_salt": ""}],
)  # fmt: skip
def test_edge_sampling_values_are_served(http, extra):
    response = http.post(COMPLETIONS, json={**VALID[COMPLETIONS], **extra})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_the_same_request_works_after_all_the_bad_ones(http):
    for path, body in VALID.items():
        assert http.post(path, json=body).status_code == 200


# ---- fuzzing -----------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
INTS = st.integers() | st.sampled_from([0, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1])
FLOATS = (
    st.floats(0.0, 2.0)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e-40, 1e-6, 1e-5, 0.5, 1.0, 2.0])
)
TOKEN_IDS = st.lists(st.integers(0, 49151) | INTS | st.sampled_from([49151, 49152]), max_size=6)
TEXT = st.text(max_size=40) | st.sampled_from(["", " ", "\x00", "<|im_end|>", "é" * 5, "Hello world"])
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", ""]), "text": TEXT})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard", ""])},
    optional={"content": st.none() | TEXT | st.lists(PART, max_size=3) | JSON, "name": TEXT},
)
SMALL_BUDGET = st.integers(-2, 8) | st.sampled_from([TINY_CONTEXT - 1, TINY_CONTEXT, 2**64])
FIELD_VALUES = {
    "model": st.sampled_from([MODEL, "", "tiny ", "gpt-4o"]),
    "messages": st.lists(MESSAGE, max_size=4),
    "prompt": TEXT | TOKEN_IDS,
    "max_tokens": SMALL_BUDGET,
    "max_completion_tokens": SMALL_BUDGET,
    "temperature": FLOATS,
    "top_p": FLOATS,
    "top_k": INTS,
    "stop": TEXT | st.lists(TEXT, max_size=18),
    "seed": INTS,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.integers(-1, 3),
    "cache_salt": st.none() | TEXT | st.text(min_size=250, max_size=260),
}


@st.composite
def mutated(draw, base: dict) -> dict:
    """A valid body with up to three fields dropped, added or set to a value of their type
    (boundaries included) or to random JSON."""
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(list(FIELD_VALUES)), max_size=3, unique=True)):
        how = draw(st.sampled_from(["drop", "typed", "typed", "json"]))
        if how == "drop":
            body.pop(name, None)
        else:
            body[name] = draw(FIELD_VALUES[name] if how == "typed" else JSON)
    return body


SLOW_OK = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=SLOW_OK)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, EXPLAIN])
@FUZZ
@given(data=st.data())
def test_mutated_valid_bodies_never_get_a_5xx(http, path, data):
    body = data.draw(mutated(VALID[path]))
    assert_served(http.post(path, json=body))


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, EXPLAIN])
@settings(max_examples=40, deadline=None, suppress_health_check=SLOW_OK)
@given(body=st.dictionaries(st.sampled_from(list(FIELD_VALUES)) | st.text(max_size=8), JSON, max_size=6))
def test_random_json_objects_never_get_a_5xx(http, path, body):
    assert_served(http.post(path, json=body))


@settings(max_examples=40, deadline=None, suppress_health_check=SLOW_OK)
@given(body=JSON | st.binary(max_size=64))
def test_random_json_values_and_bytes_never_get_a_5xx(http, body):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    assert_served(http.post(COMPLETIONS, content=content, headers={"content-type": "application/json"}))


@settings(max_examples=40, deadline=None, suppress_health_check=SLOW_OK)
@given(
    params=st.dictionaries(
        st.sampled_from(["limit", "tree", "max_nodes"]), st.text(max_size=6) | INTS.map(str), max_size=3
    )
)
def test_random_prefix_queries_never_get_a_5xx(http, params):
    assert_served(http.get("/v1/cache/prefixes", params=params))
