"""`kvblocks bench fleet`: multi-tenant chat load on a fleet (`kvblocks.launch.fleet`) behind a router.

The workload is what the routers are for: tenants with long system prompts of their own, each
sending many chat requests, shuffled. Each tenant's first request arrives, the fleet settles, then
the rest arrive concurrently. The ideal hit rate is the most any routing can reach: every request
but a tenant's first hits the prefix that all of that tenant's prompts share. The suite runs it
behind `cache_aware` and `round_robin` routing, each without and with a shared Redis tier.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvblocks.bench.harness import BenchOptions, Check, Option, Report, add_suite, fmt_seconds, ints, progress
from kvblocks.errors import UserError
from kvblocks.launch.fleet import Fleet, Replica
from kvblocks.launch.router import ROUTERS, router_program
from kvblocks.launch.service import ServiceError

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
