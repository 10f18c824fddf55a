"""What agent frameworks need from `kvblocks serve` (issue 26), over real HTTP: the Responses API
(openai SDK, OpenAI Agents SDK), echoed messages, cache_control, truthful finishes, streamed tool
arguments, continuous usage stats, and a busy port refused before the model loads.

Assertions are on the protocol (shapes, finish reasons, events, usage), never on the model's wisdom.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time

import openai
import pytest
from server_proc import smollm2_dir, start_server, stop_cleanly
from transformers import AutoTokenizer

from kvblocks.generate import tools
from kvblocks.launch.service import cli_env, kvblocks_command

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
MODEL = "SmolLM2-135M-Instruct"
RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}


@pytest.fixture(scope="module")
def server():
    server = start_server("--capacity", "8192")
    yield server
    stop_cleanly(server)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


def sse_chunks(http, body: dict) -> list[dict]:
    with http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---- lenient where OpenAI is lenient -----------------------------------------------------------


def test_echoed_assistant_message_with_null_fields_is_accepted(client):
    messages = [{"role": "user", "content": "Say hi."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    echoed = first.choices[0].message.model_dump()
    assert {"annotations", "audio", "function_call"} <= set(echoed)
    messages += [echoed, {"role": "user", "content": "Again."}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert second.choices[0].finish_reason in ("stop", "length")


def test_unknown_nested_key_is_refused_by_its_path(http):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "colour": 1}]}]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert (
        r.json()["error"]["message"]
        == "Unrecognized request argument supplied: messages[0].content[0].colour"
    )


def test_echoed_field_with_a_value_is_still_refused(http):
    body = {"messages": [{"role": "user", "content": "hi", "audio": {"id": "a1"}}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "messages[0].audio" in r.json()["error"]["message"]


def test_part_type_that_is_not_a_string_is_a_400(http):
    body = {"messages": [{"role": "user", "content": [{"type": ["text"], "text": "hi"}]}]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].type"


def test_cache_control_pins_the_marked_prefix_for_the_tenant(http):
    before = http.get("/v1/cache/stats").json()["cache"]["pinned_tokens"]
    system = {
        "type": "text",
        "text": "You are a terse assistant. " * 8,
        "cache_control": {"type": "ephemeral"},
    }
    body = {
        "messages": [{"role": "system", "content": [system]}, {"role": "user", "content": "Hi."}],
        "max_tokens": 2,
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert http.get("/v1/cache/stats").json()["cache"]["pinned_tokens"] > before


# ---- truthful finishes, streamed tool arguments, usage -------------------------------------------


def test_forced_call_cut_by_max_tokens_says_length_and_leaks_no_markup(http):
    body = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_tokens": 6,
    }
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert "tool_calls" not in choice["message"] and not choice["message"]["content"]
    chunks = sse_chunks(http, body)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length"
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "<tool_call>" not in content


def test_streamed_tool_arguments_arrive_in_fragments_in_openai_shape(http):
    body = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 60,
    }
    chunks = sse_chunks(http, body)
    deltas = [d for c in chunks if c["choices"] for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "get_weather"
    fragments = [d["function"]["arguments"] for d in deltas[1:]]
    assert deltas[0]["function"]["arguments"] == "" and "city" in json.loads("".join(fragments))
    assert len(fragments) > 1, "the arguments stream as they are generated, not whole at the end"
    opened = next(
        k for k, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get("tool_calls")
    )
    assert opened < len(chunks) - 1, "the call opens before the stream ends, not all at once"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    assert "".join(fragments) == whole["message"]["tool_calls"][0]["function"]["arguments"]


SEARCH = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the product manual",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}
WEATHER_UNIT = {  # arguments longer than the shortest call's `{}`: a call that can be cut inside them
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
THREE_CITIES = {
    "messages": [{"role": "user", "content": "What's the weather in Rome, Paris and Berlin?"}],
    "tools": [WEATHER_UNIT],
    "tool_choice": "required",
    "temperature": 0,
    "max_tokens": 40,  # room for one call, not for two
}

RESPONSES_WEATHER_UNIT = {"type": "function", **WEATHER_UNIT["function"]}


@pytest.fixture(scope="module")
def cut_in_second_call(http) -> int:
    """A max_tokens that cuts THREE_CITIES inside its second call: the first call's tokens and just
    the shortest next call's (`next_call_tokens`), which leaves the budget open after the first
    call; the second's arguments are longer than the shortest call's `{}`."""
    body = THREE_CITIES | {"max_tokens": 120, "logprobs": True}
    tokens = [
        t["token"]
        for t in http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    ]
    first = next(k for k in range(len(tokens)) if "</tool_call>" in "".join(tokens[: k + 1])) + 1
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    return first + tools.next_call_tokens(tok, tools.HermesParser(), [WEATHER_UNIT])


def streamed_calls(chunks: list[dict]) -> list[dict]:
    """The calls a client assembles from a chat stream's tool_calls deltas."""
    calls: dict[int, dict] = {}
    for c in (c for c in chunks if c["choices"]):
        for d in c["choices"][0]["delta"].get("tool_calls") or []:
            call = calls.setdefault(d["index"], {"name": "", "arguments": "", "fragments": 0})
            call["name"] += d["function"].get("name", "")
            call["arguments"] += d["function"].get("arguments", "")
            call["fragments"] += bool(d["function"].get("arguments"))
    return [calls[k] for k in sorted(calls)]


def test_parallel_calls_close_at_the_last_call_the_budget_holds(http, cut_in_second_call):
    for max_tokens in (40, cut_in_second_call - 1):  # one token short of room for another call
        body = THREE_CITIES | {"max_tokens": max_tokens}
        choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1
    chunks = sse_chunks(http, THREE_CITIES)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    assert len(streamed_calls(chunks)) == 1


def test_a_reply_cut_after_a_complete_call_keeps_it_streamed_or_not(http, cut_in_second_call):
    body = THREE_CITIES | {"max_tokens": cut_in_second_call}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "length" and not choice["message"]["content"]
    (call,) = choice["message"]["tool_calls"]  # the next one was cut: dropped
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"]
    chunks = sse_chunks(http, body)
    assert len(streamed_calls(chunks)) == 2, "the second call had begun"
    first = streamed_calls(chunks)[0]
    assert first["arguments"] == call["function"]["arguments"] and first["fragments"] > 1
    finishes = [(k, c["choices"][0]["finish_reason"]) for k, c in enumerate(chunks) if c["choices"]]
    last_call = max(
        k for k, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get("tool_calls")
    )
    assert [f for _, f in finishes if f] == ["length"] and finishes[-1][0] > last_call


@pytest.mark.parametrize(
    "question",
    ["What's the weather in Rome, Paris and Berlin?", "Is it raining in Tokyo?", "How do I reset my router?"],
)
def test_required_tool_choice_with_two_tools_and_48_tokens_returns_calls(http, question):
    body = THREE_CITIES | {"tools": [WEATHER, SEARCH], "max_tokens": 48}
    body["messages"] = [{"role": "user", "content": question}]
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["message"]["tool_calls"], choice
    for call in choice["message"]["tool_calls"]:
        assert isinstance(json.loads(call["function"]["arguments"]), dict)


@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_a_sampled_reply_cut_by_max_tokens_returns_every_call_before_the_cut_one(http, temperature):
    """A call followed by the next one's head was complete: only the last streamed call may be cut.
    (A sampled reply can also spend all its tokens inside the first call's string: no call then.)"""
    for seed in range(3):
        body = THREE_CITIES | {
            "tools": [WEATHER, SEARCH],
            "max_tokens": 48,
            "temperature": temperature,
            "seed": seed,
        }
        streamed = streamed_calls(sse_chunks(http, body))
        choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        returned = [
            (c["function"]["name"], c["function"]["arguments"])
            for c in choice["message"].get("tool_calls") or []
        ]
        assert len(returned) >= len(streamed) - 1, (seed, streamed, choice)
        assert returned == [(c["name"], c["arguments"]) for c in streamed[: len(returned)]]


# ---- start-up --------------------------------------------------------------------------------


def test_busy_port_is_a_one_line_error_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        proc = subprocess.run(
            [*kvblocks_command(), "serve", "--port", str(port)],
            capture_output=True, text=True, env=cli_env(), timeout=120,
        )  # fmt: skip
        elapsed = time.monotonic() - started
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0 and f"127.0.0.1:{port}" in proc.stderr
    assert elapsed < 15, f"took {elapsed:.1f} s: the model was loaded first"


# ---- the Responses API -----------------------------------------------------------------------


def test_responses_string_input_gives_text_and_usage(client):
    resp = client.responses.create(
        model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=8
    )
    assert resp.object == "response" and resp.status in ("completed", "incomplete")
    assert isinstance(resp.output_text, str)
    assert resp.usage.input_tokens > 0 and resp.usage.output_tokens <= 8
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens"


def test_responses_stream_events_join_to_the_completed_text(client):
    events = list(client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=12, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text


def test_responses_function_call_then_output_continues_from_the_cache(client):
    first = client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[RESPONSES_WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=60, temperature=0,
    )  # fmt: skip
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    follow = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[RESPONSES_WEATHER], max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
    )  # fmt: skip
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert client.responses.retrieve(follow.id).id == follow.id


def test_responses_streamed_function_arguments_arrive_as_deltas(client):
    events = list(
        client.responses.create(
            model=MODEL, input="Weather in Paris?", tools=[RESPONSES_WEATHER], tool_choice="required",
            parallel_tool_calls=False, max_output_tokens=60, temperature=0, stream=True,
        )
    )  # fmt: skip
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert deltas
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads("".join(deltas)) == json.loads(done.arguments)
    final = events[-1].response
    assert [i.call_id for i in final.output if i.type == "function_call"] == [done.item_id[3:]]


def test_responses_cut_after_a_complete_call_keeps_it_and_lists_every_streamed_item(
    client, cut_in_second_call
):
    events = list(
        client.responses.create(
            model=MODEL, input=THREE_CITIES["messages"][0]["content"], tools=[RESPONSES_WEATHER_UNIT],
            tool_choice="required", max_output_tokens=cut_in_second_call, temperature=0, stream=True,
        )
    )  # fmt: skip
    final = events[-1]
    assert final.type == "response.incomplete"
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert [i.id for i in final.response.output] == added and len(added) == 2
    assert [i.status for i in final.response.output] == ["completed", "incomplete"]
    first = final.response.output[0]
    assert first.status == "completed" and json.loads(first.arguments)["city"]
    deltas = [
        e.delta
        for e in events
        if e.type == "response.function_call_arguments.delta" and e.item_id == first.id
    ]
    done = [e for e in events if e.type == "response.function_call_arguments.done" and e.item_id == first.id]
    assert len(deltas) > 1 and "".join(deltas) == done[0].arguments == first.arguments
    whole = client.responses.create(
        model=MODEL, input=THREE_CITIES["messages"][0]["content"], tools=[RESPONSES_WEATHER_UNIT],
        tool_choice="required", max_output_tokens=cut_in_second_call, temperature=0,
    )  # fmt: skip
    assert whole.status == "incomplete" and [i.arguments for i in whole.output] == [first.arguments]


def test_responses_json_schema_format_constrains_the_text(client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    resp = client.responses.create(
        model=MODEL, input="Give a number.", max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "num", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert resp.status == "completed"
    assert isinstance(json.loads(resp.output_text)["n"], int)


def test_responses_refuses_what_it_cannot_honour_by_name(http):
    r = http.post("/v1/responses", json={"input": "hi", "reasoning": {"effort": "high"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning"
    r = http.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_openai_agents_sdk_runs_at_its_defaults(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    model = agents.OpenAIResponsesModel(
        model=MODEL,
        openai_client=openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0),
    )
    settings = agents.ModelSettings(max_tokens=40, temperature=0)
    # a structured output ends under its grammar, so the run completes whatever the model would say
    agent = agents.Agent(
        name="a", instructions="Answer yes or no.", model=model, model_settings=settings, output_type=bool
    )
    result = agents.Runner.run_sync(agent, "Is the sky blue?")
    assert isinstance(result.final_output, bool)
