"""The HTTP edge under hostile input and at shutdown, over real HTTP (tiny model, 256-token context).

A prompt that cannot fit is refused before it is tokenised, quickly, and a prompt that fits is never
refused by that bound; deep JSON and lone surrogates are 400s naming the field; /health and
/health_generate report a serving engine; SIGTERM drains a stream in flight and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_proc import start_server, stop_cleanly, tiny_model_dir

from kvblocks.server.bounds import MAX_TOKENIZING, FairGate, tokenizing

MODEL = "tiny"
CONTEXT = 256
MAX_BODY = 4 << 20


@pytest.fixture(scope="module")
def server():
    server = start_server(
        "--model", str(tiny_model_dir(context=CONTEXT)), "--served-model-name", MODEL,
        "--max-body-bytes", str(MAX_BODY),
    )  # fmt: skip
    yield server
    stop_cleanly(server)


def post(server, path: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)


def rss_kib(server) -> int:
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))


HUGE = "lorem ipsum " * ((MAX_BODY - 4096) // 12)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": HUGE, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["hi", HUGE], "max_tokens": 1}, "prompt[1]"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": HUGE}]},
            "messages",
        ),
        ("/tokenize", {"prompt": HUGE}, "prompt"),
        ("/tokenize", {"prompt": HUGE, "add_special_tokens": False}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": HUGE}]}, "messages"),
        ("/v1/cache/explain", {"prompt": HUGE}, "prompt"),
        ("/v1/cache/explain", {"messages": [{"role": "system", "content": HUGE}]}, "messages"),
    ],
)
def test_a_maximum_size_prompt_that_cannot_fit_is_refused_before_tokenising(server, path, body, param):
    before = rss_kib(server)
    started = time.perf_counter()
    response = post(server, path, body)
    elapsed = time.perf_counter() - started
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "context_length_exceeded"
    assert elapsed < 1.0  # tokenising it would take seconds
    assert rss_kib(server) - before < 64 * 1024


def test_a_prompt_of_the_longest_tokens_that_fits_is_not_refused_by_the_bound(server):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir(context=CONTEXT))
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    longest = max((t for t in texts if t.strip()), key=lambda t: len(t.encode()))
    prompt = longest * (CONTEXT // 2)
    response = post(server, "/tokenize", {"prompt": prompt, "add_special_tokens": False})
    assert response.status_code == 200, response.text
    assert response.json()["count"] < CONTEXT


def test_concurrent_tokenisation_is_bounded():
    running, peak = 0, 0
    lock = threading.Lock()

    def work() -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.05)
        with lock:
            running -= 1

    async def burst() -> None:
        gate = FairGate(MAX_TOKENIZING)
        await asyncio.gather(*(tokenizing(gate, f"tenant {i % 3}", work) for i in range(8)))

    asyncio.run(burst())
    assert peak == MAX_TOKENIZING


@pytest.mark.parametrize("depth", [100, 5000])
def test_json_nested_deeper_than_the_limit_is_a_400(server, depth):
    body = b'{"model": "tiny", "prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400, response.text
    assert "nested deeper than 64" in response.json()["error"]["message"]


TOOL = {"type": "function", "function": {"name": "f", "description": "D\\ud800", "parameters": {}}}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi \\ud800"}]}',
            "messages[0].content",
        ),
        ("/v1/completions", '{"prompt": "x\\udfff y"}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "\\ud800"]}', "prompt[1]"),
        ("/tokenize", '{"prompt": "\\ud83d"}', "prompt"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi"}], "tools": ['
            + json.dumps(TOOL).replace("\\\\", "\\")
            + "]}",
            "tools[0].function.description",
        ),
        ("/v1/cache/explain", '{"prompt": "hi", "cache_salt": "s\\ud800"}', "cache_salt"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    response = post(server, path, body.encode())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "lone surrogate" in error["message"]


def test_a_surrogate_pair_is_a_character_not_an_error(server):
    response = post(server, "/tokenize", b'{"prompt": "smile \\ud83d\\ude00"}')
    assert response.status_code == 200, response.text


def test_health_and_health_generate_answer_200_on_a_serving_engine(server):
    health = httpx.get(f"{server.url}/health")
    deep = httpx.get(f"{server.url}/health_generate", timeout=60)
    assert health.status_code == deep.status_code == 200
    assert deep.json()["status"] == "ok"


def test_a_flood_of_anonymous_health_generate_checks_costs_about_one_generation_a_second(server):
    def total() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        return float(
            next(line for line in text.splitlines() if line.startswith("kvblocks_requests_total ")).split()[1]
        )

    before = total()
    start = time.monotonic()

    async def flood() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return [
                r.status_code for r in await asyncio.gather(*(c.get("/health_generate") for _ in range(24)))
            ]

    assert asyncio.run(flood()) == [200] * 24
    seconds = time.monotonic() - start
    assert total() - before <= seconds + 2


def test_sigterm_drains_a_stream_in_flight_then_exits_0():
    server = start_server(
        "--model", str(tiny_model_dir(context=4096)), "--served-model-name", MODEL, "--drain-timeout", "300",
    )  # fmt: skip
    lines: list[str] = []
    first = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                lines.append(line)
                first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        assert first.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while (health := httpx.get(f"{server.url}/health")).status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]
        refused = httpx.post(
            f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}
        )
        assert refused.status_code == 503 and refused.headers["Retry-After"].isdigit()
        assert reader.is_alive(), "the stream should still be running while the server drains"
        reader.join(300)
        assert [line for line in lines if line][-1] == "data: [DONE]"
        assert server.proc.wait(60) == 0
    finally:
        reader.join(1)
    log = server.stop()
    assert "Traceback" not in log, log
