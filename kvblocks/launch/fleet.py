"""A fleet on one host: `kvblocks serve` replicas on 127.0.0.1, optionally sharing one Redis (or Redis
Cluster) with one secret, behind sglang-router or vllm-router, all unmodified programs started as
they are documented in docs/DEPLOY.md (`Fleet.commands` lists the exact command lines). A replica
can be stopped, killed and restarted on its own address, so the router finds it again.

`python -m kvblocks.launch.fleet` (what `scripts/fleet` runs) starts one and keeps it up.
"""

from __future__ import annotations

import argparse
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvblocks.cli.argtypes import positive_int
from kvblocks.launch.ports import HOST, free_port
from kvblocks.launch.redis_server import LocalCluster, RedisServer
from kvblocks.launch.router import ROUTERS, Router
from kvblocks.launch.service import Service, ServiceError, cli_env, kvblocks_command


@dataclass
class Replica:
    """One `kvblocks serve` on a fixed port: `restart` brings it back where the router expects it."""

    index: int
    args: list[str]
    workdir: Path
    headers: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    service: Service | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def command(self) -> list[str]:
        return [*kvblocks_command(), "serve", "--host", HOST, "--port", str(self.port), *self.args]

    def spawn(self) -> Replica:
        """Start the process (see `wait`); its stderr goes to `replica-I.log`, appended across restarts."""
        assert self.service is None or not self.service.alive(), "already running"
        log = self.workdir / f"replica-{self.index}.log"
        with log.open("ab") as err:
            proc = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=cli_env()
            )
        self.service = Service(proc, self.url, log)
        self.starts += 1
        return self

    def wait(self, timeout_s: float = 180.0) -> Replica:
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if not self.service.alive():
                raise ServiceError(f"replica {self.index} exited: {self.service.log_tail(800)}")
            if time.monotonic() > deadline:
                raise ServiceError(f"replica {self.index} did not answer within {timeout_s:g} s")
            time.sleep(0.1)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM: a graceful shutdown (queued Redis writes land first)."""
        if self.service is not None:
            self.service.stop(timeout_s)

    def kill(self) -> None:
        """SIGKILL: a crash, with requests in flight."""
        if self.service is not None and self.service.alive():
            self.service.proc.kill()
            self.service.proc.wait()

    def restart(self) -> Replica:
        self.stop()
        return self.spawn().wait()

    def alive(self) -> bool:
        return self.service is not None and self.service.alive()

    def get(self, path: str):
        import httpx

        response = httpx.get(f"{self.url}{path}", headers=self.headers, timeout=30.0)
        response.raise_for_status()
        return response

    def post(self, path: str, body: dict | None = None, **params):
        import httpx

        response = httpx.post(
            f"{self.url}{path}", json=body, params=params, headers=self.headers, timeout=60.0
        )
        response.raise_for_status()
        return response.json()

    def stats(self) -> dict:
        """`/v1/cache/stats` (the whole server's view with an admin key, else the tenant's)."""
        return self.get("/v1/cache/stats").json()

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {sample name with its labels: value}."""
        samples = {}
        for line in self.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples


class Fleet:
    """N replicas, an optional shared Redis, an optional router; a context manager that stops them all.

    `serve_args` go to every replica, `replica_args[i]` to replica i only. `redis` is "server" (a
    private redis-server), "cluster" (a private 3-node Redis Cluster), a URL to use as it is, or
    None; the replicas share it with one secret (`secret_file`, else a fresh one in `workdir`) and
    `redis_chunk_tokens` (None: kvblocks' default).
    `headers` go with the fleet's own calls to the replicas (an admin key when they require keys).
    `kv_events` gives each replica a live and a replay KV-events address (`kv_event_sources`), which
    `kv_event_router_args` hands to vllm-router's `kv_aware` policy.
    """

    def __init__(
        self,
        workdir: str | Path,
        replicas: int = 3,
        serve_args: Sequence[str] = (),
        *,
        replica_args: Sequence[Sequence[str]] = (),
        redis: str | None = None,
        secret_file: str | Path | None = None,
        redis_chunk_tokens: int | None = None,
        headers: dict[str, str] | None = None,
        kv_events: bool = False,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.redis: RedisServer | LocalCluster | None = None
        if redis == "server":
            self.redis = RedisServer(self.workdir / "redis")
        elif redis == "cluster":
            self.redis = LocalCluster(3, self.workdir / "redis-cluster")
        self.redis_url = self.redis.url if self.redis is not None else redis
        self.secret_file = Path(secret_file) if secret_file else None
        shared: list[str] = []
        if self.redis_url is not None:
            if self.secret_file is None:
                self.secret_file = self.workdir / "redis.secret"
                self.secret_file.write_text(secrets.token_hex(32))
                self.secret_file.chmod(0o600)
            shared = ["--redis", self.redis_url, "--redis-secret-file", str(self.secret_file)]
            if redis_chunk_tokens is not None:
                shared += ["--redis-chunk-tokens", str(redis_chunk_tokens)]
        extra = [list(a) for a in replica_args] + [[] for _ in range(replicas - len(replica_args))]
        self.kv_event_sources: list[tuple[str, str]] = []
        if kv_events:
            for args in extra:
                live, replay = (f"tcp://{HOST}:{free_port()}" for _ in range(2))
                self.kv_event_sources.append((live, replay))
                args += ["--kv-events-endpoint", live, "--kv-events-replay-endpoint", replay]
        self.replicas = [
            Replica(i, [*serve_args, *shared, *extra[i]], self.workdir, dict(headers or {}))
            for i in range(replicas)
        ]
        self.router: Router | None = None

    def start(self, timeout_s: float = 240.0) -> Fleet:
        try:
            if self.redis is not None:
                self.redis.start()
            for r in self.replicas:
                r.spawn()
            for r in self.replicas:
                r.wait(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def kv_event_router_args(self, model: str, block_size: int = 16) -> list[str]:
        """vllm-router's arguments to subscribe to every replica's KV events (live and replay) for the
        served model `model`, in blocks of `block_size` tokens (the replicas' --kv-event-block-size)."""
        args = ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
        for replica, (live, replay) in zip(self.replicas, self.kv_event_sources, strict=True):
            args += ["--kv-event-source", f"{replica.url}={live}"]
            args += ["--kv-event-replay-source", f"{replica.url}={replay}"]
        return args

    def plan_router(self, kind: str, policy: str, args: Sequence[str] = ()) -> Router:
        """The router in front of every replica, not started yet."""
        return Router(kind, policy, [r.url for r in self.replicas], self.workdir, list(args))

    def start_router(self, kind: str, policy: str, args: Sequence[str] = ()) -> Router:
        """Start (or replace) the router in front of every replica."""
        self.stop_router()
        self.router = self.plan_router(kind, policy, args)
        return self.router.start()

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None

    @property
    def url(self) -> str:
        assert self.router is not None, "no router started"
        return self.router.url

    def stop(self) -> None:
        self.stop_router()
        for r in self.replicas:
            r.stop()
        if self.redis is not None:
            self.redis.stop()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def commands(self) -> list[str]:
        """The command lines this fleet runs, for a shell (what docs/DEPLOY.md shows)."""
        lines = [shlex.join(r.command) for r in self.replicas]
        if self.router is not None:
            lines.append(shlex.join(self.router.command))
        return lines

    def stats(self) -> list[dict]:
        """Each replica's prefix-cache stats (`/v1/cache/stats` "cache")."""
        return [r.stats()["cache"] for r in self.replicas]

    def flush(self, spill: bool = False) -> None:
        """Empty every replica's device cache (`/flush_cache`); with `spill`, the shared tier too."""
        for i, r in enumerate(self.replicas):
            r.post("/flush_cache", spill="true" if spill and i == 0 else "false")

    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait until no replica runs, queues or locks anything and every Redis write has landed."""
        deadline = time.monotonic() + timeout_s
        for r in self.replicas:
            while True:
                s = r.stats()
                busy = s["engine"]["active"] + s["engine"]["queued"] + s["cache"]["locked_tokens"]
                if busy == 0 and s["cache"].get("redis_queue_depth", 0) == 0:
                    break
                if time.monotonic() > deadline:
                    raise ServiceError(f"replica {r.index} still busy after {timeout_s:g} s: {s}")
                time.sleep(0.05)


# ---- the launcher (scripts/fleet) ---------------------------------------------------------------


def served_name(serve_args: Sequence[str]) -> str:
    """The model name replicas started with `serve_args` serve, as `kvblocks serve` names it."""
    from kvblocks.models import served_name as name_of

    names: dict[str, str] = {}
    for i, arg in enumerate(serve_args):
        flag, eq, value = arg.partition("=")
        if flag in ("--served-model-name", "--model"):
            names[flag] = value if eq else (serve_args[i + 1] if i + 1 < len(serve_args) else "")
    return name_of(names.get("--served-model-name"), names.get("--model"))


def main(argv: Sequence[str] | None = None) -> int:
    """`scripts/fleet`: start a fleet on this host and keep it up until Ctrl-C or SIGTERM."""
    import signal

    p = argparse.ArgumentParser(
        prog="scripts/fleet",
        description="Start N `kvblocks serve` replicas on 127.0.0.1, an optional shared Redis and a router in "
        "front of them; print their command lines and addresses; stop them all on Ctrl-C or SIGTERM.",
        epilog="example: scripts/fleet --replicas 3 --router sglang --redis server -- --model PATH",
    )
    p.add_argument("--replicas", type=positive_int, default=3, help="kvblocks serve replicas (default 3)")
    p.add_argument(
        "--router", choices=[*ROUTERS, "none"], default="sglang", help="the router (default sglang)"
    )
    p.add_argument("--policy", default="cache_aware", help="the router's --policy (default cache_aware)")
    p.add_argument("--router-arg", action="append", default=[], help="extra router argument (repeatable)")
    p.add_argument(
        "--redis",
        default=None,
        metavar="server|cluster|URL",
        help="a shared tier: a private redis-server, a private 3-node Redis Cluster, or a running Redis",
    )
    p.add_argument(
        "--redis-secret-file", default=None, help="the replicas' shared secret (default: a new one)"
    )
    p.add_argument("--redis-chunk-tokens", type=positive_int, default=None, help="tokens per Redis chunk")
    p.add_argument(
        "--workdir", default=None, help="folder for logs and the secret (default: a new temporary one)"
    )
    p.add_argument(
        "--kv-events",
        action="store_true",
        help="each replica publishes KV events on addresses of its own, and vllm-router subscribes to them "
        "(use with --router vllm --policy kv_aware)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the command lines and exit")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: arguments for every replica")
    args = p.parse_args(argv)
    serve = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvblocks-fleet-"))
    fleet = Fleet(
        workdir,
        args.replicas,
        serve,
        redis=args.redis,
        secret_file=args.redis_secret_file,
        redis_chunk_tokens=args.redis_chunk_tokens,
        kv_events=args.kv_events,
    )
    router_args = list(args.router_arg)
    if args.kv_events and args.router == "vllm":
        router_args += fleet.kv_event_router_args(served_name(serve))
    router = None if args.router == "none" else fleet.plan_router(args.router, args.policy, router_args)
    try:
        commands = fleet.commands + ([shlex.join(router.command)] if router else [])
    except ServiceError as exc:
        print(f"scripts/fleet: {exc}", file=sys.stderr)
        return 1
    if args.dry_run:
        print("\n".join(commands))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        fleet.start()
        if router is not None:
            fleet.router = router.start()
        print("\n".join(commands), flush=True)
        where = f"{args.router}-router ({args.policy}) at {router.url}" if router else "no router"
        shared = f", Redis at {fleet.redis_url}" if fleet.redis_url else ""
        print(
            f"scripts/fleet: {args.replicas} replicas, {where}{shared}; logs in {workdir}; Ctrl-C stops",
            flush=True,
        )
        while all(r.alive() for r in fleet.replicas):
            time.sleep(1.0)
        print("scripts/fleet: a replica exited; stopping the fleet", file=sys.stderr)
        return 1
    except ServiceError as exc:
        print(f"scripts/fleet: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        fleet.stop()


if __name__ == "__main__":
    sys.exit(main())
