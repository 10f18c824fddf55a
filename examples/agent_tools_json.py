"""An agent with a tool and JSON output, through `kvblocks serve` and the openai client.

Shows:
1. Tools. The agent sends `tools=[get_weather]`; the reply is a tool call, which the program
   "runs" locally (a small table stands in for a weather service) and sends back as a `tool`
   message; the model then answers in words. SmolLM2's chat template knows no tools, so the server
   writes them into the prompt in the Hermes format and parses `<tool_call>` blocks out of the
   reply. A model this small rarely calls a tool on its own, so the first step asks for one with
   `tool_choice="required"` (`--tool-choice auto` leaves it to the model): the call is then decoded
   under a grammar built from the tool's schema and always parses and validates.
2. JSON output. A request with `response_format` `json_schema` (strict) returns text that
   `json.loads` parses into an object following the schema (constrained decoding).

Run (start the server first; tools and JSON need a chat model, the default SmolLM2-135M-Instruct
is fine; tiny random-weight models never produce sensible calls):

    kvblocks serve &
    python examples/agent_tools_json.py
    python examples/agent_tools_json.py --base-url http://127.0.0.1:8000/v1 --api-key KEY

Output (abbreviated):

    user: What's the weather in Paris right now?
    step 1: tool call get_weather({"city": "Paris", "unit": "celsius"})
    tool get_weather -> {"city": "Paris", "temperature": 21, "unit": "celsius", "sky": "sunny"}
    step 2: answer: Paris, France, 21°C, sunny.
    json: {"city": "Paris", "temperature_c": 21, "advice": "Savor the sun..."}
    parsed: city='Paris' temperature_c=21 advice='Savor the sun...'
"""

from __future__ import annotations

import argparse
import json
import os

from openai import OpenAI

WEATHER_TOOL = {
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
WEATHER = {"paris": (21, "sunny"), "oslo": (3, "snow"), "tokyo": (17, "rain")}
REPORT_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "temperature_c": {"type": "integer"},
        "advice": {"type": "string"},
    },
    "required": ["city", "temperature_c", "advice"],
    "additionalProperties": False,
}


def get_weather(city: str, unit: str = "celsius") -> dict:
    """The local "tool": a table instead of a weather service."""
    celsius, sky = WEATHER.get(city.strip().lower(), (15, "cloudy"))
    temperature = celsius if unit == "celsius" else round(celsius * 9 / 5 + 32)
    return {"city": city, "temperature": temperature, "unit": unit, "sky": sky}


def run_tool(name: str, arguments: str) -> str:
    if name != "get_weather":
        return json.dumps({"error": f"no tool named {name}"})
    return json.dumps(get_weather(**json.loads(arguments)))


def tool_agent(client: OpenAI, model: str, question: str, args) -> None:
    """Ask, run the tools the model calls, send the results back, until it answers in words."""
    messages = [
        {"role": "system", "content": "You are a helpful assistant with tools."},
        {"role": "user", "content": question},
    ]
    print(f"user: {question}")
    for step in range(1, args.max_steps + 1):
        r = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=[WEATHER_TOOL],
            tool_choice=args.tool_choice if step == 1 else "auto",
            parallel_tool_calls=False,
            max_tokens=args.max_tokens,
            temperature=0,
        )
        message = r.choices[0].message
        if not message.tool_calls:
            print(f"step {step}: answer: {(message.content or '').strip()}")
            return
        messages.append(message.model_dump(exclude_none=True))  # the assistant turn with its calls
        for call in message.tool_calls:
            print(f"step {step}: tool call {call.function.name}({call.function.arguments})")
            result = run_tool(call.function.name, call.function.arguments)
            print(f"tool {call.function.name} -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print(f"no answer after {args.max_steps} steps")


def json_report(client: OpenAI, model: str, args) -> None:
    """Structured output: the reply is JSON that follows REPORT_SCHEMA."""
    r = client.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": "It is 21 degrees and sunny in Paris. Give the city, the temperature "
                "and one piece of advice.",
            }
        ],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "weather_report", "schema": REPORT_SCHEMA, "strict": True},
        },
        max_tokens=args.max_tokens,
        temperature=0,
    )
    text = r.choices[0].message.content
    print(f"json: {text}")
    report = json.loads(text)
    print("parsed: " + " ".join(f"{k}={report[k]!r}" for k in REPORT_SCHEMA["required"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("KVBLOCKS_API_KEY", "unused"),
        help="the server's API key, if it has one (default $KVBLOCKS_API_KEY)",
    )
    parser.add_argument("--question", default="What's the weather in Paris right now?")
    parser.add_argument(
        "--tool-choice", default="required", choices=("required", "auto"), help="for the first step"
    )
    parser.add_argument("--max-steps", type=int, default=3, help="model calls before giving up")
    parser.add_argument("--max-tokens", type=int, default=96, help="reply length limit per call")
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    tool_agent(client, model, args.question, args)
    json_report(client, model, args)
    client.close()


if __name__ == "__main__":
    main()
