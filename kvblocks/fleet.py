"""`kvblocks bench fleet`, and the fleet it runs: `kvblocks serve` replicas behind a real router.

A `Fleet` is N replicas on 127.0.0.1, optionally sharing one Redis (or Redis Cluster) with one
secret, behind sglang-router or vllm-router, all unmodified programs started as they are documented
in docs/DEPLOY.md (`Fleet.commands` lists the exact command lines). A replica can be stopped,
killed and restarted on its own address, so the router finds it again.

The workload is what the routers are for: tenants with long system prompts of their own, each
sending many chat requests, shuffled. Each tenant's first request arrives, the fleet settles, then
the rest arrive concurrently. The ideal hit rate is the most any routing can reach: every request
but a tenant's first hits the prefix that all of that tenant's prompts share. The suite runs it
behind `cache_aware` and `round_robin` routing, each without and with a shared Redis tier.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvblocks.bench.fixtures import (
    LocalCluster,
    RedisServer,
    Service,
    ServiceError,
    cli_env,
    free_port,
    kvblocks_command,
)
from kvblocks.bench.harness import BenchOptions, Check, Option, Report, add_suite, fmt_seconds, ints, progress
from kvblocks.errors import UserError

ROUTERS = ("sglang", "vllm")
HOST = "127.0.0.1"

# ---- the fleet ---------------------------------------------------------------------------------


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
            # find workers, and notice one that died or came back, within seconds
            "--worker-startup-check-interval", "1",
            "--health-check-interval-secs", "1",
            "--health-failure-threshold", "1",
            "--health-success-threshold", "1",
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


# ---- the workload ------------------------------------------------------------------------------

WORDS = (
    "ledger", "invoice", "region", "shipment", "policy", "refund", "account", "priority", "channel",
    "audit", "quota", "tariff", "carrier", "warranty", "escalation", "contract", "renewal", "billing",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who sends a request: its system prompt, and its `cache_salt` or API key (a keys-file tenant)."""

    name: str
    system: str
    salt: str | None = None
    key: str | None = None


def make_tenants(
    tokenizer, count: int, system_tokens: int, *, keys: Sequence[str] = (), salted: bool = True, seed: int = 0
) -> list[Tenant]:
    """`count` tenants with system prompts of about `system_tokens` tokens each, all different from
    the first word on. Tenant i sends `keys[i]` when given, and its own `cache_salt` when `salted`."""
    rng = random.Random(seed)
    tenants = []
    for t in range(count):
        words = [f"You are the assistant of tenant {t} ({rng.randrange(10**6)}). Follow these rules:"]
        while len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]) < system_tokens:
            words += [rng.choice(WORDS) for _ in range(16)]
        while len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]) > system_tokens:
            words.pop()
        key = keys[t] if t < len(keys) else None
        tenants.append(Tenant(f"tenant-{t}", " ".join(words), f"salt-{t}" if salted else None, key))
    return tenants


@dataclass(slots=True)
class Job:
    tenant: int
    messages: list[dict]
    ids: list[int] = field(default_factory=list)  # the prompt ids the replicas prefill


def make_jobs(tenants: Sequence[Tenant], per_tenant: int, seed: int = 0) -> list[Job]:
    """`per_tenant` chat requests of every tenant (its system prompt, a short question), shuffled."""
    rng = random.Random(seed)
    jobs = [
        Job(t, [
            {"role": "system", "content": tenant.system},
            {"role": "user", "content": f"Question {q}: " + " ".join(rng.choice(WORDS) for _ in range(8)) + "?"},
        ])
        for t, tenant in enumerate(tenants)
        for q in range(per_tenant)
    ]  # fmt: skip
    rng.shuffle(jobs)
    return jobs


def tokenize_jobs(replica: Replica, jobs: Sequence[Job]) -> None:
    """Each job's prompt ids as a replica's `/tokenize` gives them: the ids its chat route prefills."""
    for job in jobs:
        job.ids = replica.post("/tokenize", {"messages": job.messages})["tokens"]


def ideal_hits(jobs: Sequence[Job]) -> list[int]:
    """Per job, the most any routing can have cached: nothing for a tenant's first job, then the prefix
    all of that tenant's prompts share (at most all but the last token: one is always recomputed)."""
    shared: dict[int, list[int]] = {}
    for job in jobs:
        common = shared.setdefault(job.tenant, job.ids)
        n = min(len(common), len(job.ids))
        diff = np.flatnonzero(np.asarray(common[:n]) != np.asarray(job.ids[:n]))
        shared[job.tenant] = common[: int(diff[0]) if diff.size else n]
    seen: set[int] = set()
    out = []
    for job in jobs:
        out.append(0 if job.tenant not in seen else min(len(shared[job.tenant]), len(job.ids) - 1))
        seen.add(job.tenant)
    return out


@dataclass(slots=True)
class Sent:
    """One request as the client saw it; `error` is set when it failed."""

    job: Job
    submitted: float = 0.0
    first: float = 0.0
    done: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.first - self.submitted


def send(client, url: str, job: Job, tenant: Tenant, max_tokens: int, model: str | None = None) -> Sent:
    """One streaming chat completion through `url`; the usage comes in the last chunk."""
    import httpx

    body: dict = {
        "messages": job.messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    if tenant.salt is not None:
        body["cache_salt"] = tenant.salt
    headers = {"Authorization": f"Bearer {tenant.key}"} if tenant.key else {}
    s = Sent(job, submitted=time.perf_counter())
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                s.error = f"HTTP {response.status_code}: {response.read().decode(errors='replace')[:300]}"
                return s
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    s.error = f"streamed error: {event['error']}"
                    return s
                if event.get("usage"):
                    s.prompt_tokens = event["usage"]["prompt_tokens"]
                    s.cached_tokens = event["usage"]["prompt_tokens_details"]["cached_tokens"]
                if any(c["delta"].get("content") for c in event.get("choices", [])):
                    s.first = s.first or time.perf_counter()
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    s.done = time.perf_counter()
    s.first = s.first or s.done
    if s.error is None and not s.prompt_tokens:
        s.error = "no usage in the stream"
    return s


def drive(
    url: str,
    jobs: Sequence[Job],
    tenants: Sequence[Tenant],
    *,
    max_tokens: int = 4,
    concurrency: int = 8,
    settle: Callable[[], None] | None = None,
    model: str | None = None,
    during: Callable[[int], None] | None = None,
    show: bool = False,
) -> list[Sent]:
    """Each tenant's first job (concurrently), `settle()`, then the others `concurrency` at a time.
    `during(i)` runs on the caller's thread after the i-th of the others was submitted (the tests kill
    and restart a replica there). Results come back in the order of `jobs`."""
    import httpx

    firsts = list({job.tenant: job for job in reversed(jobs)}.values())
    rest = [job for job in jobs if all(job is not f for f in firsts)]
    with (
        httpx.Client(
            timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=concurrency + 8)
        ) as client,
        ThreadPoolExecutor(max(concurrency, len(firsts))) as pool,
        progress(len(jobs), "fleet requests", show) as bar,
    ):

        def one(job: Job) -> Sent:
            out = send(client, url, job, tenants[job.tenant], max_tokens, model)
            bar.update()
            return out

        sent = {id(job): s for job, s in zip(firsts, pool.map(one, firsts))}
        if settle is not None:
            settle()
        futures = []
        for i, job in enumerate(rest):
            futures.append(pool.submit(one, job))
            if during is not None:
                during(i)
            while sum(not f.done() for f in futures) >= concurrency:
                time.sleep(0.005)
        sent |= {id(job): f.result() for job, f in zip(rest, futures)}
    return [sent[id(job)] for job in jobs]


@dataclass(slots=True)
class Outcome:
    """A workload's result: the prompt tokens, the cached ones (as the replicas' `usage` said) and the ideal."""

    sent: list[Sent]
    prompt_tokens: int
    cached_tokens: int
    ideal_tokens: int

    @classmethod
    def of(cls, sent: Sequence[Sent]) -> Outcome:
        ideal = ideal_hits([s.job for s in sent])
        ok = [(s, best) for s, best in zip(sent, ideal) if s.error is None]
        return cls(
            list(sent),
            sum(s.prompt_tokens for s, _ in ok),
            sum(s.cached_tokens for s, _ in ok),
            sum(best for _, best in ok),
        )

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    @property
    def ideal_rate(self) -> float:
        return self.ideal_tokens / self.prompt_tokens

    @property
    def of_ideal(self) -> float:
        return self.cached_tokens / self.ideal_tokens

    @property
    def errors(self) -> list[Sent]:
        return [s for s in self.sent if s.error is not None]

    def ttfts(self) -> list[float]:
        return [s.ttft for s in self.sent if s.error is None]


# ---- the suite ---------------------------------------------------------------------------------

POLICIES = ("cache_aware", "round_robin")


OPTIONS = (
    Option("--router", None, "sglang", "the router to run (default sglang)", choices=ROUTERS),
    *ints("", [
        ("replicas", 3, "kvblocks serve replicas"),
        ("tenants", 3, "tenants, each with its own system prompt"),
        ("requests", 8, "requests per tenant"),
        ("system-tokens", 800, "tokens of each tenant's system prompt"),
        ("max-tokens", 4, "max_tokens per request"),
        ("concurrency", 8, "requests in flight at once"),
        ("capacity", 8192, "device cache per replica, in tokens"),
        ("chunk-tokens", 16, "tokens per Redis chunk"),
    ]),
    Option("--server-arg", None, [], "extra argument for every replica", repeat=True),
)  # fmt: skip


def add_parser(suites: argparse._SubParsersAction) -> None:
    add_suite(
        suites,
        "fleet",
        run,
        help="replicas behind sglang-router or vllm-router: cache-aware vs round-robin, with and without Redis",
        description="N `kvblocks serve` replicas behind a real router, multi-tenant load: hit rate, TTFT and "
        "per-replica resident tokens for cache_aware vs round_robin routing, without and with a shared Redis tier "
        "(a private redis-server).",
        model=True,
        options=OPTIONS,
    )


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    from transformers import AutoTokenizer

    from kvblocks import models

    try:
        path = models.resolve(args.model)
        tokenizer = AutoTokenizer.from_pretrained(path)
        router_program(args.router)
    except (models.ModelLoadError, OSError, ServiceError) as exc:
        raise UserError(str(exc)) from exc
    tenants = make_tenants(tokenizer, args.tenants, args.system_tokens)
    jobs = make_jobs(tenants, args.requests)
    serve = ["--threads", str(opts.threads), "--capacity", str(args.capacity), *args.server_arg]
    if args.model:
        serve += ["--model", args.model]
    results: dict[tuple[str, bool], tuple[Outcome, list[dict], int]] = {}
    with tempfile.TemporaryDirectory(prefix="kvblocks-bench-fleet-") as tmp:
        for shared in (False, True):
            fleet = Fleet(
                Path(tmp) / ("shared" if shared else "alone"),
                args.replicas,
                serve,
                redis="server" if shared else None,
                redis_chunk_tokens=args.chunk_tokens,
            )
            try:
                fleet.start()
                if not jobs[0].ids:
                    tokenize_jobs(fleet.replicas[0], jobs)
                for policy in POLICIES:
                    fleet.flush(spill=shared)
                    fleet.start_router(args.router, policy)
                    before = sum(s["spill_hit_tokens"] for s in fleet.stats())
                    sent = drive(fleet.url, jobs, tenants, max_tokens=args.max_tokens, concurrency=args.concurrency,
                                 settle=fleet.settle, show=opts.progress)  # fmt: skip
                    fleet.settle()
                    stats = fleet.stats()
                    restored = sum(s["spill_hit_tokens"] for s in stats) - before
                    results[policy, shared] = (Outcome.of(sent), stats, restored)
                    fleet.stop_router()
            except ServiceError as exc:
                raise UserError(str(exc)) from exc
            finally:
                fleet.stop()
    return [build_report(args, tokenizer, tenants, jobs, results)]


def variant_name(policy: str, shared: bool) -> str:
    return f"{policy}{', shared Redis' if shared else ''}"


def build_report(args, tokenizer, tenants, jobs, results) -> Report:
    samples = {variant_name(p, s): outcome.ttfts() for (p, s), (outcome, _, _) in results.items()}
    report = Report(
        "fleet",
        f"{args.replicas} replicas behind {args.router}-router, by routing policy and shared tier",
        {
            "router": f"{args.router}-router",
            "replicas": args.replicas,
            "tenants": args.tenants,
            "requests": len(jobs),
            "system_prompt_tokens": args.system_tokens,
            "mean_prompt_tokens": round(float(np.mean([len(j.ids) for j in jobs])), 1),
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "redis_chunk_tokens": args.chunk_tokens,
        },
        samples,
    )
    checks, notes = [], []
    for (policy, shared), (outcome, stats, restored) in results.items():
        name = variant_name(policy, shared)
        resident = [s["resident_tokens"] for s in stats]
        target = 0.95 if policy == "cache_aware" or shared else None
        checks += [
            Check(f"{name}: hit rate", outcome.hit_rate),
            Check(f"{name}: hit rate / ideal", outcome.of_ideal, target=target, higher_is_better=True),
            Check(f"{name}: tokens restored from Redis", restored, "tokens"),
            Check(f"{name}: mean resident tokens per replica", float(np.mean(resident)), "tokens"),
            Check(f"{name}: failed requests", len(outcome.errors), target=0),
        ]
        ttft = outcome.ttfts()
        notes.append(
            f"{name}: hit rate {outcome.hit_rate:.3f} (ideal {outcome.ideal_rate:.3f}), {restored} tokens "
            f"restored from Redis, resident tokens per replica {resident}, TTFT p50 "
            f"{fmt_seconds(float(np.median(ttft)))} p99 {fmt_seconds(float(np.percentile(ttft, 99)))}"
        )
    aware = np.mean([s["resident_tokens"] for s in results["cache_aware", False][1]])
    spread = np.mean([s["resident_tokens"] for s in results["round_robin", False][1]])
    checks.append(
        Check("resident tokens per replica, cache_aware / round_robin", float(aware / spread), target=0.6)
    )
    report.checks = checks
    notes += [
        f"{args.tenants} tenants, each with its own {args.system_tokens}-token system prompt and cache_salt, send "
        f"{args.requests} chat requests each (system prompt plus a short question), shuffled; each tenant's first "
        f"request goes first, the fleet settles, then the rest go {args.concurrency} at a time (streaming, "
        f"temperature 0); TTFT = request sent to first content chunk, on the client, through the router",
        "hit rate = cached prompt tokens / prompt tokens from the replicas' `usage` (Redis restores included); "
        "ideal = every request but a tenant's first hits the prefix all of that tenant's prompts share",
        "each variant starts from empty caches (`/flush_cache`, with `?spill=true` for the shared tier) and a "
        "fresh router; replicas run one torch thread each, all on this machine, so timings are noisy",
    ]
    report.notes = notes
    return report


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

    from kvblocks.bench.harness import positive_int

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
