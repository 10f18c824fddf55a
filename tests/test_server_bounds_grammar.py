"""Hostile schemas against a real server (issue 41): every route that compiles a grammar refuses
what would crash or stall the compiler, names the field, and keeps serving.

A flat `$defs` chain of 3,000 `$ref`s overflowed the compiling thread's stack (SIGSEGV, the whole
server gone); it must be a 400 here, which is why these tests run a server subprocess and never
compile such a schema in the pytest process.
"""

from __future__ import annotations

import json
import time

import pytest
from server_proc import start_server, stop_cleanly
from test_grammar import ref_chain, slow_schema

from kvblocks.engine.request import EngineError
from kvblocks.generate.params import ConstraintError
from kvblocks.server.openai_routes import engine_failure

MODEL = "SmolLM2-135M-Instruct"
BUDGET_S = 0.1  # --grammar-timeout: the legit schemas here compile in under 5 ms
USER = [{"role": "user", "content": "Give me the answer as JSON."}]


@pytest.fixture(scope="module")
def server():
    server = start_server("--capacity", "8192", "--grammar-timeout", str(BUDGET_S))
    yield server
    stop_cleanly(server)  # no request left a traceback, the shutdown was clean


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def tool(schema: dict) -> dict:
    return {"type": "function", "function": {"name": "lookup", "parameters": schema}}


def refused(reply, param: str, *words: str) -> None:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def still_serves(server, http) -> None:
    assert server.alive()
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 2})
    assert reply.status_code == 200, reply.text


def test_a_ref_chain_of_3000_links_on_response_format_is_a_400_and_the_server_lives(server, http):
    body = {
        "model": MODEL,
        "messages": USER,
        "max_tokens": 4,
        "response_format": schema_format(ref_chain(3000)),
    }
    assert len(json.dumps(body)) < 128 << 10  # under the size limit: the depth limit refuses it
    reply = http.post("/v1/chat/completions", json=body)
    refused(reply, "response_format", "3003 levels deep", "limit of 128")
    still_serves(server, http)


def test_a_ref_chain_of_3000_links_on_text_format_is_a_400_and_the_server_lives(server, http):
    fmt = {"type": "json_schema", "name": "answer", "schema": ref_chain(3000)}
    body = {"model": MODEL, "input": "Answer in JSON.", "max_output_tokens": 4, "text": {"format": fmt}}
    reply = http.post("/v1/responses", json=body)
    refused(reply, "text.format", "3003 levels deep")
    still_serves(server, http)


def test_a_ref_chain_of_3000_links_in_a_forced_tool_schema_is_a_400_and_the_server_lives(server, http):
    body = {"model": MODEL, "messages": USER, "max_tokens": 4, "tools": [tool(ref_chain(3000))]}
    reply = http.post("/v1/chat/completions", json=body | {"tool_choice": "required"})
    refused(reply, "tools[0].function.parameters", "3003 levels deep")
    flat = {"type": "function", "name": "lookup", "parameters": ref_chain(3000)}
    body = {"model": MODEL, "input": "Look it up.", "max_output_tokens": 4, "tools": [flat]}
    reply = http.post("/v1/responses", json=body | {"tool_choice": "required"})
    refused(reply, "tools[0].parameters", "3003 levels deep")
    still_serves(server, http)


def test_a_ref_chain_of_10000_links_is_refused_by_its_size(server, http):
    body = {
        "model": MODEL,
        "messages": USER,
        "max_tokens": 4,
        "response_format": schema_format(ref_chain(10000)),
    }
    reply = http.post("/v1/chat/completions", json=body)
    refused(reply, "response_format", "bytes, over this server's limit of 131072")
    still_serves(server, http)


def test_a_deep_schema_within_the_limits_compiles_and_constrains_the_reply(http):
    schema = ref_chain(40, "properties")  # 123 levels: deeper than real agents' schemas
    body = {"model": MODEL, "messages": USER, "max_tokens": 6, "response_format": schema_format(schema)}
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"].startswith('{"a": {"a"')


def test_a_schema_that_compiles_too_slowly_is_refused_within_the_budget(server, http):
    body = {
        "model": MODEL,
        "messages": USER,
        "max_tokens": 4,
        "response_format": schema_format(slow_schema()),
    }
    began = time.monotonic()
    reply = http.post("/v1/chat/completions", json=body)
    elapsed = time.monotonic() - began
    refused(reply, "response_format", f"took longer than this server's limit of {BUDGET_S:g} s")
    assert elapsed < BUDGET_S + 2.0
    still_serves(server, http)


def test_a_constraint_that_gives_out_while_decoding_answers_400_naming_the_field():
    """What the routes answer for a branch the engine failed: the constraint's field, not a 500."""
    stopped = ConstraintError(
        "text.format: the grammar stopped while decoding: too many states", "text.format"
    )
    error = engine_failure(EngineError("sampling", stopped))
    assert (error.status, error.param, error.code) == (400, "text.format", "grammar_limit")
    assert engine_failure(stopped).status == 400  # the one-request path hands the cause itself
    assert engine_failure(EngineError("forward", RuntimeError("boom"))).status == 500
