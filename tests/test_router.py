"""`kvblocks.launch.router`: the real sglang-router and vllm-router in front of stand-in replicas.

A stand-in (this file run as a program) answers what the routers ask at registration and a chat
completion naming its port, over kept-alive HTTP/1.1 connections as `kvblocks serve` does, so a
replica can be SIGKILLed at an exact moment without booting a model.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kvblocks.launch.ports import free_port
from kvblocks.launch.router import Router


class StandIn(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # the router keeps connections open, as it does to kvblocks serve

    def log_message(self, *args) -> None:
        pass

    def reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path.startswith("/v1/models"):
            self.reply({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})
        elif self.path.startswith(("/server_info", "/get_server_info", "/model_info", "/get_model_info")):
            self.reply({"model_path": "stand-in", "served_model_name": "stand-in", "is_generation": True})
        elif self.path.startswith("/get_load"):
            self.reply({"load": 0})
        else:
            self.reply({"status": "ok"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        port = self.server.server_address[1]
        message = {"role": "assistant", "content": "ok"}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        self.reply(
            {"id": "x", "object": "chat.completion", "port": port, "choices": [choice], "usage": usage}
        )


def answering(port: int, proc: subprocess.Popen) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200
    except httpx.TransportError:
        assert proc.poll() is None, "a stand-in exited"
        return False


@pytest.fixture
def stand_ins():
    """{port: process} of three stand-ins, answering."""
    procs = {}
    for port in (free_port() for _ in range(3)):
        procs[port] = subprocess.Popen([sys.executable, __file__, str(port)], stdin=subprocess.DEVNULL)
    for port, proc in procs.items():
        while not answering(port, proc):
            time.sleep(0.05)
    yield procs
    for proc in procs.values():
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_a_request_for_a_replica_that_just_died_is_retried_on_a_live_one(stand_ins, tmp_path, kind):
    """cache_aware sends a prompt back to the replica that served it; once that replica is gone the
    router's retries must outlast its health check (with the routers' default schedule, 9 in 10
    such requests failed with a 500 in ~0.4 s)."""
    workers = [f"http://127.0.0.1:{port}" for port in stand_ins]
    router = Router(kind, "cache_aware", workers, tmp_path).start(60.0)
    try:
        for trial in range(2):  # two of the three replicas die, one after the other
            body = {"model": "stand-in", "messages": [{"role": "user", "content": f"{trial} " * 200}]}
            first = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=30.0)
            assert first.status_code == 200, first.text
            holder = stand_ins.pop(first.json()["port"])
            holder.kill()
            holder.wait()
            again = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=30.0)
            assert again.status_code == 200, again.text
            assert again.json()["port"] in stand_ins
    finally:
        router.stop()


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), StandIn).serve_forever()
