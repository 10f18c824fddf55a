"""sglang-router or vllm-router, unmodified, in front of `kvblocks serve` replicas on 127.0.0.1."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvblocks.launch.ports import HOST, free_port
from kvblocks.launch.service import Service, ServiceError

ROUTERS = ("sglang", "vllm")

# How both routers notice a replica that died, and what they do with a request sent to it meanwhile.
# The health check takes a dead replica out of rotation within about a second. Until then the policy
# may pick it (cache_aware picks it every time for a prefix it holds), and each failed try is
# retried through the policy again: the routers' default schedule (5 tries 50 ms apart, x1.5) is
# over in ~0.4 s, before the health check acts, so the request failed with a 500. This schedule
# (100 ms doubling to 1 s, 8 tries) outlasts it by seconds; see docs/DEPLOY.md "When a replica dies".
HEALTH_ARGS = (
    "--health-check-interval-secs", "1",
    "--health-failure-threshold", "1",
    "--health-success-threshold", "1",
)  # fmt: skip
RETRY_ARGS = (
    "--retry-max-retries", "8",
    "--retry-initial-backoff-ms", "100",
    "--retry-backoff-multiplier", "2",
    "--retry-max-backoff-ms", "1000",
)  # fmt: skip


def router_program(kind: str) -> list[str]:
    """The router's own launcher, as installed from the package index (the `test` extra)."""
    if kind == "sglang":
        if importlib.util.find_spec("sglang_router") is None:
            raise ServiceError("sglang-router is not installed: pip install sglang-router==0.3.2")
        return [sys.executable, "-m", "sglang_router.launch_router"]
    if kind == "vllm":
        beside = Path(sys.executable).with_name("vllm-router")
        found = str(beside) if beside.exists() else shutil.which("vllm-router")
        if found is None:
            raise ServiceError("vllm-router is not installed: pip install vllm-router==0.1.17")
        return [found]
    raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got '{kind}'")


@dataclass
class Router:
    """sglang-router or vllm-router on 127.0.0.1 (both ports bound explicitly: sglang-router binds its
    API and its Prometheus port to 0.0.0.0 by default)."""

    kind: str
    policy: str
    workers: list[str]
    workdir: Path
    args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    service: Service | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def command(self) -> list[str]:
        return [
            *router_program(self.kind),
            "--host", HOST,
            "--port", str(self.port),
            "--worker-urls", *self.workers,
            "--policy", self.policy,
            "--prometheus-host", HOST,
            "--prometheus-port", str(self.metrics_port),
            # find workers, and notice one that died or came back, within seconds; retry a request
            # that reached a dead one until the health check has taken it out
            "--worker-startup-check-interval", "1",
            *HEALTH_ARGS,
            *RETRY_ARGS,
            "--log-level", "warn" if self.kind == "sglang" else "warning",
            *self.args,
        ]  # fmt: skip

    def start(self, timeout_s: float = 120.0) -> Router:
        log = self.workdir / f"router-{self.kind}-{self.policy}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        self.service = Service(proc, self.url, log)
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if not self.service.alive():
                raise ServiceError(f"{self.kind}-router exited: {self.service.log_tail(1500)}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServiceError(
                    f"{self.kind}-router not ready within {timeout_s:g} s: {self.service.log_tail(1500)}"
                )
            time.sleep(0.2)
        return self

    def ready(self) -> bool:
        """Every worker registered and healthy: sglang-router registers them in the background after
        it answers; vllm-router's `/health` is 200 once no worker is unhealthy."""
        import httpx

        try:
            if self.kind == "sglang":
                workers = httpx.get(f"{self.url}/workers", timeout=2.0).json().get("workers", [])
                return len(workers) == len(self.workers) and all(w.get("is_healthy") for w in workers)
            return httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
        except (httpx.TransportError, ValueError):
            return False

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop()

    def metrics(self) -> str:
        import httpx

        return httpx.get(f"http://{HOST}:{self.metrics_port}/metrics", timeout=5.0).text
