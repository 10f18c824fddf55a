"""Child processes: `kvblocks serve` (or any HTTP server) on a free loopback port, its stderr in a log
the caller's folder holds, ready once GET /health answers, stopped with SIGTERM (SIGKILL if it lingers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvblocks.launch.ports import HOST, free_port


class ServiceError(RuntimeError):
    """A service binary is missing, or the process exited or did not answer in time."""


def terminate(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM (a graceful shutdown), then SIGKILL if the process is still there after `timeout_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Service:
    """A child process answering at `url`, its stderr in `log`."""

    proc: subprocess.Popen
    url: str
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no log)"

    def stop(self, timeout_s: float = 10.0) -> None:
        terminate(self.proc, timeout_s)

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def kvblocks_command() -> list[str]:
    """The `kvblocks` console script of this interpreter's environment."""
    script = Path(sys.executable).with_name("kvblocks")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvblocks.cli.commands"]


def cli_env(**extra: str) -> dict[str, str]:
    """Environment for a kvblocks subprocess: one torch thread, no inherited API key or URL."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVBLOCKS_API_KEY", "KVBLOCKS_URL")}
    env |= {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return env | extra


def spawn_serve(args: list[str], workdir: Path, name: str = "serve") -> Service:
    """Start `kvblocks serve ARGS` on a free port with one torch thread; `wait_serve` until it answers."""
    port = free_port()
    return spawn([*kvblocks_command(), "serve", "--port", str(port), *args], port, workdir, name)


def spawn(cmd: list[str], port: int, workdir: Path, name: str, **env: str) -> Service:
    """Start `cmd` (a server that will listen on `port`) with `cli_env(**env)`, stderr in `workdir/NAME.log`."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"{name}.log"
    with log.open("wb") as err:
        try:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=cli_env(**env)
            )
        except OSError as exc:
            raise ServiceError(f"cannot run {cmd[0]}: {exc}") from exc
    return Service(proc, f"http://{HOST}:{port}", log)


def wait_serve(service: Service, timeout_s: float = 180.0) -> Service:
    """Return once GET /health answers 200 (raise ServiceError if the server exits or never answers)."""
    import httpx

    def ready() -> bool:
        try:
            return httpx.get(f"{service.url}/health", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    deadline = time.monotonic() + timeout_s
    while not ready():
        if not service.alive():
            raise ServiceError(
                f"kvblocks serve exited with {service.proc.returncode}: {service.log_tail(500)}"
            )
        if time.monotonic() > deadline:
            service.stop()
            raise ServiceError(
                f"kvblocks serve did not answer within {timeout_s:g} s: {service.log_tail(500)}"
            )
        time.sleep(0.1)
    return service
