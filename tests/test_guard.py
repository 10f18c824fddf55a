"""The server's front door over real sockets (tiny model): body limits, slow senders, clients that
leave before a non-streaming answer, and the start-up warnings about a trusted or unbounded Redis."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from redis_server import start_redis
from server_proc import make_tiny_model_dir, scrape, start_server, stop_cleanly, tiny_model_dir

MODEL = "tiny"
KEY = "sk-guard-test-1"
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server():
    server = start_server(
        "--model", str(tiny_model_dir()), "--served-model-name", MODEL, "--api-key", KEY,
        "--max-body-bytes", str(LIMIT), "--read-timeout", "1",
        api_key=KEY,
    )  # fmt: skip
    yield server
    stop_cleanly(server)


def test_a_body_over_the_limit_gets_a_413_before_anything_reads_it(server):
    prompt = "x " * LIMIT
    started = time.perf_counter()
    response = httpx.post(
        f"{server.url}/v1/completions", headers=server.headers, json={"model": MODEL, "prompt": prompt}
    )
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and str(LIMIT) in error["message"]
    assert time.perf_counter() - started < 5


def test_a_chunked_body_without_a_length_is_cut_at_the_limit(server):
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(LIMIT // 1024 + 2):
            yield b"y" * 1024
        yield b'"}'

    response = httpx.post(
        f"{server.url}/v1/completions",
        headers=server.headers | {"content-type": "application/json"},
        content=chunks(),
    )
    assert response.status_code == 413


def test_a_client_that_sends_its_body_too_slowly_gets_a_408(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: 200\r\n\r\n".encode()
            + b'{"model": "tiny",'
        )
        started = time.perf_counter()
        reply = b""
        while b"request_timeout" not in reply:  # the head and the body may come in separate reads
            part = sock.recv(4096)
            if not part:
                break
            reply += part
        reply = reply.decode(errors="replace")
    assert reply.startswith("HTTP/1.1 408")
    assert "request_timeout" in reply
    assert time.perf_counter() - started < 5


def test_the_server_still_serves_after_refusing_bodies(server):
    response = httpx.post(
        f"{server.url}/v1/completions",
        headers=server.headers,
        json={"model": MODEL, "prompt": "hello", "max_tokens": 2},
        timeout=60,
    )
    assert response.status_code == 200


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    """A long context, so one request can generate for seconds."""
    model = make_tiny_model_dir(tmp_path_factory.mktemp("long"), context=16384)
    server = start_server("--model", str(model), "--served-model-name", MODEL)
    yield server
    stop_cleanly(server)


def test_a_non_streaming_client_that_leaves_is_cancelled_within_a_step(slow_server):
    with slow_server.client() as http:
        before = scrape(http).get("kvblocks_requests_cancelled_total", 0.0)
        body = {"model": MODEL, "prompt": "count:", "max_tokens": 16000, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{slow_server.url}/v1/completions", json=body, timeout=1.0)
        left = time.perf_counter()
        while True:
            stats = http.get("/v1/cache/stats").json()
            if stats["engine"]["active"] == 0:
                break
            assert time.perf_counter() - left < 3.0, "the generation went on after its client left"
            time.sleep(0.05)
        samples = scrape(http)
    assert samples["kvblocks_requests_cancelled_total"] == before + 1
    assert samples.get("kvblocks_generation_tokens_total", 0.0) < 16000


def test_serve_warns_once_that_redis_without_a_secret_is_trusted_and_unbounded(tmp_path):
    redis = start_redis(tmp_path / "redis")
    try:
        redis.client().config_set("maxmemory", 0)
        server = start_server("--model", str(tiny_model_dir()), "--redis", redis.url)
        log = server.stop()
        assert log.count("Redis is trusted") == 1
        assert "no maxmemory" in log
        secret = tmp_path / "secret"
        secret.write_text("a-deployment-secret-0123456789\n")
        redis.client().config_set("maxmemory", 64 << 20)
        server = start_server(
            "--model", str(tiny_model_dir()), "--redis", redis.url, "--redis-secret-file", str(secret)
        )
        log = server.stop()
        assert "Redis is trusted" not in log and "no maxmemory" not in log
    finally:
        redis.stop()
