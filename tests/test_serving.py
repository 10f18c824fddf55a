"""`kvblocks serve`'s connections and drain, against a real server: slow or idle connections are
closed on time while others are served, a client address has a cap on connections, and a drain
that runs out of time ends every stream with an error event and its terminator, then exits 0."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time

import httpx
import pytest
from server_proc import start_server, stop_cleanly, tiny_model_dir

from kvblocks.server.serving import ConnectionLimits

MODEL = "tiny"
HEADER_TIMEOUT_S = 2.0
KEEP_ALIVE_S = 1.0
PER_CLIENT = 8
SLOWLORIS = 300


@pytest.fixture(scope="module")
def server():
    server = start_server(
        "--model", str(tiny_model_dir()), "--served-model-name", MODEL,
        "--header-timeout", str(HEADER_TIMEOUT_S), "--keep-alive-timeout", str(KEEP_ALIVE_S),
        "--max-connections-per-client", str(PER_CLIENT), "--max-connections", "1000",
    )  # fmt: skip
    yield server
    stop_cleanly(server)


def connect(server, source: str) -> socket.socket:
    """A TCP connection to the server from the loopback address `source` (127.0.0.0/8 is all local)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", server.port))
    return sock


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes `sock` within `within_s` (whatever it sent first is skipped)."""
    sock.settimeout(within_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_300_slowloris_connections_are_closed_after_the_header_timeout_while_a_client_is_served(server):
    sockets = [connect(server, f"127.0.1.{i % 60 + 1}") for i in range(SLOWLORIS)]  # 5 per address
    opened = time.monotonic()
    try:
        for sock in sockets:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        served = []
        while time.monotonic() - opened < HEADER_TIMEOUT_S + 2:
            for sock in sockets:  # a header line now and then, never the blank line that ends them
                with contextlib.suppress(OSError):  # closed by the server already
                    sock.sendall(b"X-Slow: 1\r\n")
            started = time.perf_counter()
            reply = httpx.get(f"{server.url}/health", timeout=5)
            served.append((reply.status_code, time.perf_counter() - started))
            time.sleep(0.5)
        assert all(status == 200 and elapsed < 1.0 for status, elapsed in served), served
        still_open = [s for s in sockets if not closed_by_server(s, 1.0)]
        assert not still_open, f"{len(still_open)} of {SLOWLORIS} slow connections are still open"
    finally:
        for sock in sockets:
            sock.close()


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(server):
    sock = connect(server, "127.0.2.1")
    try:
        assert not closed_by_server(sock, HEADER_TIMEOUT_S - 1)
        assert closed_by_server(sock, 2)
    finally:
        sock.close()


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(server):
    sock = connect(server, "127.0.2.2")
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        idle_since = time.monotonic()
        assert closed_by_server(sock, KEEP_ALIVE_S + 2)
        assert time.monotonic() - idle_since >= KEEP_ALIVE_S - 0.1
    finally:
        sock.close()


def test_a_client_address_over_its_connection_cap_gets_a_503_and_others_are_served(server):
    held = [connect(server, "127.0.3.1") for _ in range(PER_CLIENT)]
    try:
        time.sleep(0.2)  # the server has counted them
        extra = connect(server, "127.0.3.1")
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        extra.settimeout(5)
        reply = b""
        while chunk := extra.recv(65536):
            reply += chunk
        extra.close()
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), reply
        assert b"retry-after: 1" in head.lower() and b"connection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        other = connect(server, "127.0.3.2")
        other.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        other.settimeout(5)
        assert other.recv(65536).startswith(b"HTTP/1.1 200")
        other.close()
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    again = httpx.get(f"{server.url}/health", timeout=5)  # a closed connection frees its place
    assert again.status_code == 200


def test_the_total_cap_is_checked_before_the_per_client_one():
    limits = ConnectionLimits(max_per_client=2, max_total=3)
    limits.open_by_client.update({"a": 2, "b": 1})
    assert "(--max-connections)" in limits.over_cap("c")
    limits.open_by_client["b"] = 0
    assert "--max-connections-per-client" in limits.over_cap("a")
    assert limits.over_cap("b") is None
    assert ConnectionLimits(max_per_client=0, max_total=0).over_cap("a") is None


def test_a_drain_that_runs_out_of_time_ends_every_stream_with_an_error_event_and_exits_0():
    server = start_server(
        "--model", str(tiny_model_dir(context=4096)), "--served-model-name", MODEL, "--drain-timeout", "1",
    )  # fmt: skip
    streams = {
        "/v1/completions": {"prompt": "Once", "max_tokens": 4000, "ignore_eos": True, "stream": True},
        "/v1/chat/completions": {
            "messages": [{"role": "user", "content": "Tell a long story"}],
            "max_tokens": 4000, "ignore_eos": True, "stream": True,
        },
        "/v1/responses": {
            "input": "Tell a long story", "max_output_tokens": 4000, "temperature": 0, "stream": True,
        },
    }  # fmt: skip
    lines = {path: [] for path in streams}
    started = threading.Barrier(len(streams) + 1, timeout=120)

    def read(path: str) -> None:
        body = {"model": MODEL, **streams[path]}
        with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=120) as response:
            first = True
            for line in response.iter_lines():
                lines[path].append(line)
                if first and line:
                    first = False
                    started.wait()

    readers = [threading.Thread(target=read, args=(path,)) for path in streams]
    for reader in readers:
        reader.start()
    try:
        started.wait()
        server.proc.send_signal(signal.SIGTERM)
        for reader in readers:
            reader.join(60)
            assert not reader.is_alive()
        assert server.proc.wait(60) == 0
    finally:
        for reader in readers:
            reader.join(1)
    log = server.stop()
    assert "Traceback" not in log, log
    for path in ("/v1/completions", "/v1/chat/completions"):
        data = [line for line in lines[path] if line]
        assert data[-1] == "data: [DONE]", data[-3:]
        error = json.loads(data[-2].removeprefix("data: "))["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "server_error", error
    events = [line for line in lines["/v1/responses"] if line]
    assert events[-2] == "event: error", events[-3:]
    error = json.loads(events[-1].removeprefix("data: "))
    assert error["type"] == "error" and error["code"] == "server_shutting_down", error
