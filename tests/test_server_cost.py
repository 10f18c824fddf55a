"""The cost model at the door and the fair tokenising gate, against a real server (tiny model with
an 8,192-token context, two tenants).

Before: 115,000 one-character messages (3.9 MB) rendered to 690,000 tokens in 16 s before their 400,
and two connections sending them held both tokenising places, so another tenant's first chunk
came after 24 s instead of 0.18 s. Now counts and a lower bound on the rendered prompt refuse such
requests before anything is rendered, and a prompt that fits is never refused.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import threading
import time

import httpx
import psutil
import pytest
from server_proc import cli_env, kvblocks_command, start_server, stop_cleanly, tiny_model_dir

from kvblocks.launch.ports import free_port

MODEL = "tiny"
CONTEXT = 8192
KEYS = {"attacker": "sk-attacker-0001", "victim": "sk-victim-0002"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": k, "tenant": t} for t, k in KEYS.items()]}))
    path.chmod(0o600)
    server = start_server(
        "--model", str(tiny_model_dir(context=CONTEXT)), "--served-model-name", MODEL, "--api-keys", str(path),
    )  # fmt: skip
    yield server
    stop_cleanly(server)


def post(server, tenant: str, path: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {KEYS[tenant]}", "Content-Type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=120)


def one_char_messages(count: int) -> list[dict]:
    return [{"role": "user", "content": "a"}] * count


CHAT_ATTACK = json.dumps({"model": MODEL, "messages": one_char_messages(115_000), "max_tokens": 1}).encode()


def refused(response: httpx.Response, param: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the server process and its living children (the body parsers)
    have used: what a request cost the server whatever else the machine runs (a loaded CI machine
    tripled the wall time of a fast 400)."""
    process = psutil.Process(pid)
    total = 0.0
    for p in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = p.cpu_times()
            total += times.user + times.system
    return total


def timed(server, path: str, body: bytes) -> tuple[float, httpx.Response]:
    """The server's CPU seconds for `body` at `path`, and its answer."""
    start = cpu_seconds(server.proc.pid)
    response = post(server, "attacker", path, body)
    return cpu_seconds(server.proc.pid) - start, response


def test_115k_one_character_messages_are_a_fast_400_naming_messages(server):
    seconds, response = timed(server, "/v1/chat/completions", CHAT_ATTACK)
    refused(response, "messages")
    assert seconds < 6.0  # 16 s when they were rendered first (wall time, quiet machine)


def test_110k_responses_input_items_are_a_fast_400_naming_input(server):
    body = {"model": MODEL, "input": one_char_messages(110_000), "max_output_tokens": 1}
    seconds, response = timed(server, "/v1/responses", json.dumps(body).encode())
    assert "110000 items" in refused(response, "input")["message"]
    assert seconds < 6.0  # 20 s when they were rendered first (wall time, quiet machine)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/v1/cache/explain"])
def test_more_messages_than_the_cap_are_a_400_naming_messages(server, path):
    response = post(server, "attacker", path, {"messages": one_char_messages(2049)})
    assert "at most 2048" in refused(response, "messages")["message"]


def test_more_content_parts_than_the_cap_are_a_400_naming_messages(server):
    parts = [{"type": "text", "text": "a"}] * 8193
    body = {"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 1}
    assert (
        "8193 content parts"
        in refused(post(server, "attacker", "/v1/chat/completions", body), "messages")["message"]
    )


def test_more_responses_input_items_than_the_cap_are_a_400_naming_input(server):
    body = {"model": MODEL, "input": one_char_messages(2049), "max_output_tokens": 1}
    assert "at most 2048" in refused(post(server, "attacker", "/v1/responses", body), "input")["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": one_char_messages(1800), "max_tokens": 1}, "messages"),
        ("/v1/responses", {"input": one_char_messages(1800), "max_output_tokens": 1}, "input"),
        ("/tokenize", {"messages": one_char_messages(1800)}, "messages"),
        ("/v1/cache/explain", {"messages": one_char_messages(1800)}, "messages"),
        ("/v1/chat/completions/render", {"messages": one_char_messages(1800)}, "messages"),
    ],
)
def test_messages_whose_template_alone_overflows_the_context_are_refused_unrendered(
    server, path, body, param
):
    """1,800 short messages have 1,800 characters, far below the character bound, but their
    template costs at least 9,000 tokens: refused by the estimate, not after rendering."""
    error = refused(post(server, "attacker", path, body), param)
    assert error["code"] == "context_length_exceeded"
    assert "at least 9000 tokens" in error["message"]


def test_a_long_conversation_that_fits_the_context_is_never_refused(server):
    messages = [{"role": ("user", "assistant")[i % 2], "content": "a"} for i in range(1200)]
    rendered = post(server, "victim", "/tokenize", {"model": MODEL, "messages": messages})
    assert rendered.status_code == 200, rendered.text
    assert 7000 < rendered.json()["count"] <= CONTEXT - 1  # near the context, above the estimate
    body = {"model": MODEL, "messages": messages, "max_tokens": 1}
    response = post(server, "victim", "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == rendered.json()["count"]


def first_chunk_seconds(server) -> float:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {KEYS['victim']}"}
    start = time.perf_counter()
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                return time.perf_counter() - start
    raise AssertionError("the stream ended without a chunk")


def test_two_attacking_connections_do_not_delay_another_tenants_first_chunk(server):
    idle = statistics.median(first_chunk_seconds(server) for _ in range(5))
    stop, sent = threading.Event(), []

    def attack() -> None:
        while not stop.is_set():
            sent.append(post(server, "attacker", "/v1/chat/completions", CHAT_ATTACK).status_code)

    threads = [threading.Thread(target=attack) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        attacked = statistics.median(first_chunk_seconds(server) for _ in range(5))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert sent and set(sent) == {400}
    assert attacked < max(5 * idle, idle + 1.0), (idle, attacked)  # 0.18 s -> 24 s before
    assert server.alive()


def test_a_message_cap_above_the_schemas_ceiling_stops_the_server_before_it_loads():
    command = [*kvblocks_command(), "serve", "--port", str(free_port()), "--max-messages", "20000"]
    done = subprocess.run(command, capture_output=True, text=True, env=cli_env(), timeout=120)
    assert done.returncode != 0 and "--max-messages must be at most 16384" in done.stderr, done.stderr
