"""Typed agents against `kvblocks serve` (SmolLM2-135M-Instruct) over real HTTP: tools together
with a structured final answer, the stored input items of a response, and `system_fingerprint`.

With `tool_choice` "auto" and a JSON format the reply is decoded under one grammar of (tool calls
| the JSON answer): whichever the model picks parses, the call under its tool's schema, the answer
under the format's. A forced call is a call; the format waits for a later turn.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel
from server_proc import start_server, stop_cleanly

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"acme": "sk-acme-typed-0001", "globex": "sk-globex-typed-0002"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                # no "<" in a city: a call's text holds no `</tool_call>` the Hermes parser would cut at
                "city": {"type": "string", "description": "City name", "pattern": "^[A-Za-z .'-]{1,24}$"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TOOL_SCHEMA = WEATHER["function"]["parameters"]
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 40}, "confident": {"type": "boolean"}},
    "required": ["answer", "confident"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": ANSWER, "strict": True},
}
QUESTIONS = [
    "What's the weather like in Paris today?",
    "Tell me a joke.",
    "What is the capital of Italy?",
]
INVITE = "What's the weather like in Paris today? Use the get_weather tool."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": k, "tenant": t} for t, k in KEYS.items()]}))
    server = start_server("--capacity", "8192", "--api-keys", str(path), api_key=KEYS["acme"])
    yield server
    stop_cleanly(server)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS["acme"], max_retries=0, timeout=300) as c:
        yield c


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def checked_calls(calls) -> list[dict]:
    """Each call names the tool and its arguments validate against the tool's schema."""
    out = []
    for call in calls:
        assert call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, TOOL_SCHEMA)
        out.append(args)
    return out


# ---- tools with a structured final answer ------------------------------------------------------


def test_auto_tools_with_a_json_schema_give_a_valid_call_or_a_valid_answer(client):
    kinds = set()
    for question in QUESTIONS:
        for seed in range(3):  # seeded draws: the same replies every run
            r = client.chat.completions.create(
                model=MODEL, messages=user(question), tools=[WEATHER], tool_choice="auto",
                response_format=JSON_SCHEMA_FORMAT, parallel_tool_calls=False, max_tokens=80,
                temperature=1.0, seed=seed,
            )  # fmt: skip
            choice = r.choices[0]
            if choice.message.tool_calls:
                assert choice.finish_reason == "tool_calls"
                checked_calls(choice.message.tool_calls)
                kinds.add("call")
            else:
                assert choice.finish_reason == "stop", choice
                jsonschema.validate(json.loads(choice.message.content), ANSWER)
                kinds.add("answer")
    assert kinds == {"call", "answer"}, "the model took both branches of the grammar"


def test_auto_tools_with_a_json_object_format_call_the_tool_when_invited(client):
    r = client.chat.completions.create(
        model=MODEL, messages=user(INVITE), tools=[WEATHER], response_format={"type": "json_object"},
        parallel_tool_calls=False, max_tokens=80, temperature=0,
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and checked_calls(choice.message.tool_calls)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tools_with_a_format_give_a_call(client, stream):
    kwargs = dict(
        model=MODEL, messages=user("Tell me a joke."), tools=[WEATHER], tool_choice="required",
        response_format=JSON_SCHEMA_FORMAT, parallel_tool_calls=False, max_tokens=80, temperature=0,
    )  # fmt: skip
    if not stream:
        r = client.chat.completions.create(**kwargs)
        assert r.choices[0].finish_reason == "tool_calls"
        checked_calls(r.choices[0].message.tool_calls)
        return
    arguments, finish = "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                arguments += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), TOOL_SCHEMA)


def test_a_named_tool_with_a_format_gives_a_call_of_that_tool(client):
    r = client.chat.completions.create(
        model=MODEL, messages=user("Tell me a joke."), tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        response_format={"type": "json_object"}, max_tokens=80, temperature=0,
    )  # fmt: skip
    assert r.choices[0].finish_reason == "tool_calls" and checked_calls(r.choices[0].message.tool_calls)


def test_responses_text_format_with_tools_gives_a_call_or_a_valid_message(client):
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}
    for question in QUESTIONS:
        r = client.responses.create(
            model=MODEL, input=question, tools=[{"type": "function", **WEATHER["function"]}],
            text={"format": fmt}, parallel_tool_calls=False, max_output_tokens=80, temperature=0,
        )  # fmt: skip
        assert r.status == "completed"
        calls = [item for item in r.output if item.type == "function_call"]
        if calls:
            for item in calls:
                assert item.name == "get_weather"
                jsonschema.validate(json.loads(item.arguments), TOOL_SCHEMA)
        else:
            jsonschema.validate(json.loads(r.output_text), ANSWER)
    forced = client.responses.create(
        model=MODEL, input="Tell me a joke.", tools=[{"type": "function", **WEATHER["function"]}],
        tool_choice="required", text={"format": fmt}, parallel_tool_calls=False, max_output_tokens=80,
        temperature=0,
    )  # fmt: skip
    assert [item.type for item in forced.output] == ["function_call"]


def test_a_bad_format_is_refused_by_the_routes_own_name_for_it(client):
    bad = {"name": "bad", "schema": {"type": "no-such-type"}}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(
            model=MODEL, input="hi", tools=[{"type": "function", **WEATHER["function"]}],
            text={"format": {"type": "json_schema", **bad}},
        )  # fmt: skip
    assert info.value.body["param"] == "text.format"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=user("hi"), tools=[WEATHER], tool_choice="required",
            response_format={"type": "json_schema", "json_schema": bad},
        )  # fmt: skip
    assert info.value.body["param"] == "response_format"


class Weather(BaseModel):
    city: str
    sunny: bool


def test_openai_agents_sdk_typed_agent_runs_its_tool_then_answers_in_its_type(server):
    """The agent's requests carry its tool and its output type (`text.format`) together. The tool
    serves once (a 135M model would call it again forever); then the final message is the type."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    ran = []

    @agents.function_tool(is_enabled=lambda context, agent: not ran)
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        ran.append(city)
        return f"Sunny in {city}."

    model = agents.OpenAIResponsesModel(
        model=MODEL,
        openai_client=openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEYS["acme"], max_retries=0),
    )
    agent = agents.Agent(
        name="weather",
        instructions="Use the get_weather tool, then answer.",
        model=model,
        tools=[get_weather],
        output_type=Weather,
        model_settings=agents.ModelSettings(max_tokens=80, temperature=0, parallel_tool_calls=False),
    )
    result = agents.Runner.run_sync(agent, "Is it sunny in Paris? Use the get_weather tool.", max_turns=3)
    assert ran == ["Paris"], "the typed agent called its tool"
    assert isinstance(result.final_output, Weather) and result.final_output.city == "Paris"


# ---- input items of a stored response ----------------------------------------------------------


def items_of(client, response_id: str, **query) -> list:
    """Every input item, page by page (`after` the last id of the page before)."""
    out, after = [], openai.NOT_GIVEN
    while True:
        page = client.responses.input_items.list(response_id, after=after, **query)
        assert page.object == "list" and page.last_id == (page.data[-1].id if page.data else None)
        out += page.data
        if not page.has_more:
            return out
        after = page.last_id


def test_input_items_list_a_stored_conversation_in_openais_shape_and_pages(client):
    tool = {"type": "function", **WEATHER["function"]}
    first = client.responses.create(
        model=MODEL, input="What's the weather like in Paris today?", tools=[tool], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=60, temperature=0,
    )  # fmt: skip
    (call,) = [item for item in first.output if item.type == "function_call"]
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[tool], max_output_tokens=8, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C."}],
    )  # fmt: skip
    (asked,) = client.responses.input_items.list(first.id).data
    assert asked.type == "message" and asked.role == "user"
    assert asked.content[0].type == "input_text" and asked.content[0].text.startswith("What's the weather")
    chain = items_of(client, second.id, order="asc")
    assert [item.type for item in chain] == ["message", "function_call", "function_call_output"]
    assert chain[1].call_id == call.call_id and chain[1].arguments == call.arguments
    assert chain[2].call_id == call.call_id and chain[2].output == "Sunny, 24 C."
    newest_first = items_of(client, second.id)  # OpenAI's default order: desc
    assert [item.id for item in newest_first] == [item.id for item in reversed(chain)]
    paged = items_of(client, second.id, order="asc", limit=1)  # three pages of one
    assert [item.model_dump() for item in paged] == [item.model_dump() for item in chain]
    page = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert page.has_more and page.first_id == chain[0].id and page.last_id == chain[1].id


def test_input_items_of_another_tenants_response_are_a_404(client, server):
    r = client.responses.create(model=MODEL, input="hello", max_output_tokens=4)
    other = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS["globex"], max_retries=0)
    with other, pytest.raises(openai.NotFoundError):
        other.responses.input_items.list(r.id)
    assert client.responses.input_items.list(r.id).data


def test_input_items_refuse_what_they_cannot_honour_by_name(server, client):
    r = client.responses.create(model=MODEL, input="hello", max_output_tokens=4)
    with server.client() as http:
        for query, param in [
            ({"limit": 0}, "limit"),
            ({"limit": 101}, "limit"),
            ({"order": "sideways"}, "order"),
            ({"after": "msg_nope"}, "after"),
            ({"include": "message.input_image.image_url"}, "include"),
        ]:
            reply = http.get(f"/v1/responses/{r.id}/input_items", params=query)
            assert reply.status_code == 400 and param in reply.json()["error"]["param"], (query, reply.text)


# ---- system_fingerprint --------------------------------------------------------------------------


def fingerprints(server) -> set[str]:
    """The system_fingerprint of a chat completion, a completion and every chunk of both streamed."""
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS["acme"], max_retries=0) as c:
        found = {
            c.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2).system_fingerprint,
            c.completions.create(model=MODEL, prompt="hi", max_tokens=2).system_fingerprint,
        }
        chat = list(c.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2, stream=True))
        text = list(c.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True))
    # each stream has chunks (a loaded server may send its two tokens' pieces in one)
    assert len(chat) >= 2 and len(text) >= 1
    return found | {chunk.system_fingerprint for chunk in chat + text}


def test_system_fingerprint_is_on_every_answer_and_chunk_and_the_same_after_a_restart(server):
    (fingerprint,) = fingerprints(server)
    assert fingerprint and fingerprint.startswith("fp_")
    again = start_server("--capacity", "1024")
    try:
        assert fingerprints(again) == {fingerprint}
    finally:
        stop_cleanly(again)
