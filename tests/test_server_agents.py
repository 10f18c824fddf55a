"""Agents against `kvblocks serve` on the default model (SmolLM2-135M-Instruct): tools, structured
output and the agent frameworks people use (openai SDK, langchain-openai, litellm), over real HTTP.

SmolLM2's chat template knows no tools, so tools go through kvblocks' built-in preamble and the
Hermes format. A forced call (`tool_choice` required or named) is decoded under a grammar built
from the tools' schemas, so it parses and validates every time, whatever the model would say.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_proc import start_server, stop_cleanly

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the product manual",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = [
    "What's the weather like in Paris today?",
    "Is it raining in Tokyo?",
    "How do I reset my router?",
    "Tell me a joke.",
]


@pytest.fixture(scope="module")
def server():
    server = start_server("--capacity", "8192")
    yield server
    stop_cleanly(server)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def valid_call(call, allowed: set[str]) -> dict:
    assert call.type == "function" and call.id
    assert call.function.name in allowed
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


@pytest.mark.parametrize("question", QUESTIONS)
def test_a_named_tool_choice_always_gives_a_valid_call_of_that_tool(client, question):
    r = client.chat.completions.create(
        model=MODEL,
        messages=user(question),
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    valid_call(choice.message.tool_calls[0], {"get_weather"})


@pytest.mark.parametrize("question", QUESTIONS[:3])
def test_required_tool_choice_always_gives_valid_calls_streamed_or_not(client, question):
    kwargs = dict(
        model=MODEL,
        messages=user(question),
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # one call, so it ends well within max_tokens (a cut one is no call)
        max_tokens=160,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs)
    calls = whole.choices[0].message.tool_calls
    assert calls and whole.choices[0].finish_reason == "tool_calls"
    for call in calls:
        valid_call(call, set(SCHEMAS))
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):  # argument fragments, by index
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                if delta.function.name:
                    names[delta.index] = delta.function.name
                arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    streamed = [(names[i], json.loads(arguments[i])) for i in sorted(names)]
    assert streamed == [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_tool_choice_none_never_yields_calls(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=user("Weather in Oslo?"),
        tools=TOOLS,
        tool_choice="none",
        max_tokens=30,
        temperature=0,
    )
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")


def test_tool_history_reaches_the_prompt(client):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
    }
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3, "sky": "snow"}'},
    ]
    counts = []
    for messages in (history[:1], history[:2], history):
        r = client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, max_tokens=1, temperature=0
        )
        counts.append(r.usage.prompt_tokens)
    assert counts[0] < counts[1] < counts[2]


def test_json_schema_output_always_parses_and_validates(client):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "population": {"type": "integer"},
            "capital": {"type": "boolean"},
        },
        "required": ["city", "population", "capital"],
        "additionalProperties": False,
    }
    for question in ("Describe Paris.", "Describe a small village."):
        r = client.chat.completions.create(
            model=MODEL,
            messages=user(question),
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": schema, "strict": True},
            },
            max_tokens=120,
            temperature=0,
        )
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object_output_is_a_json_object(client):
    r = client.chat.completions.create(
        model=MODEL, messages=user("Reply with a JSON object giving the name and age of my cat Tom, who is 3."),
        response_format={"type": "json_object"}, max_tokens=150, temperature=0,
    )  # fmt: skip
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_an_invalid_schema_is_a_400_naming_response_format(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=user("x"), max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}},
        )  # fmt: skip
    assert info.value.body["param"] == "response_format"


# ---- agent frameworks --------------------------------------------------------------------------


def test_langchain_bind_tools_returns_calls_and_structured_output_returns_the_object(server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    llm = ChatOpenAI(
        model=MODEL,
        base_url=f"{server.url}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=150,
        max_retries=0,
    )
    message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Rome?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(message.tool_calls[0]["args"], SCHEMAS["get_weather"])

    class City(BaseModel):
        name: str
        population: int

    city = llm.with_structured_output(City, method="json_schema").invoke("Describe Berlin.")
    assert isinstance(city, City)

    class Place(BaseModel):  # strings: greedy SmolLM2 writes endless digits for a population
        city: str
        country: str

    place = llm.with_structured_output(Place, method="function_calling").invoke("Where is the Eiffel Tower?")
    assert isinstance(place, Place) and place.city


def test_langchain_completion_class_sends_batched_prompts(server):
    from langchain_openai import OpenAI

    llm = OpenAI(
        model=MODEL, base_url=f"{server.url}/v1", api_key="unused", temperature=0, max_tokens=5, max_retries=0
    )
    result = llm.generate(["The sea is", "The sky is", "The road is"])
    assert len(result.generations) == 3
    assert all(g[0].text for g in result.generations)


def test_litellm_with_tools(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of its price list
    import litellm

    r = litellm.completion(
        model=f"openai/{MODEL}", api_base=f"{server.url}/v1", api_key="unused", messages=user("Weather in Lima?"),
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0,
    )  # fmt: skip
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
