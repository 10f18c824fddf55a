"""`kvblocks bench soak`: several tenants' agent traffic for minutes while faults are injected.

One `kvblocks serve` with a keys file, a sealed Redis tier and a small device pool (so prefixes
spill and come back) serves agent tenants holding multi-turn conversations, one victim tenant that
streams and measures its TTFT, and one tenant that floods the queue. Meanwhile faults arrive in
turn: Redis paused (SIGSTOP), killed and restarted, FLUSHALL, stored values bit-flipped, replaced by
oversized ones or by keys of the wrong type; clients that vanish mid-stream; malformed bodies; and a
hostile tenant's requests that each cost more than their share unless the server bounds them (issue 41):
a JSON schema whose `$ref` chain overflows a compiler's stack, a request of hundreds of one-token KV
blocks in `blend`, 115k one-character messages, 110k Responses input items, oversized `metadata`,
stored responses past the tenant's byte budget, and `cache_control` pins of the whole cache.

The victim's TTFT and the 400 of a too-long prompt are first measured on the idle server; the
traffic then runs for a quarter of the duration without faults (RSS is read after this warm-up),
then for the duration with them. Then every agent and victim request is replayed alone on a server whose cache is flushed before each: a reply that differs
is a wrong output. Reported: wrong outputs (target 0), engine deaths (/health not 200 or the process
gone; 0), 5xx answers to well-formed requests (0), to malformed ones and to the attacks (0), RSS
growth from warm-up to the end (within 10%), and the victim's TTFT p99 while a tenant floods and while
the attacker runs, each against its p99 on the idle server (at most 2x).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from kvblocks.bench.harness import BenchOptions, Check, Report, add_suite, ints
from kvblocks.bench.soak_http import (
    ATTACK_TIMEOUT_S,
    ATTACKS,
    MODEL,
    Tally,
    attack,
    build_attacks,
    chat,
    client,
    headers,
    malformed,
    send,
    vanish,
)
from kvblocks.launch.redis_server import RedisServer
from kvblocks.launch.service import Service, spawn_serve, wait_serve

TENANTS = ("victim", "alpha", "beta", "flood", "capped", "attacker")
BOUNDED = ("capped", "attacker")  # with `max_running` 4 and `max_waiting` 32, as an operator would bound them
TOPICS = ("refunds", "shipping", "invoices", "passwords", "warranty", "upgrades", "outages", "billing")


OPTIONS = ints("", [
    ("duration", 120, "seconds of traffic under faults"),
    ("agents", 3, "concurrent agents per agent tenant"),
    ("max-tokens", 8, "max_tokens per agent request"),
    ("system-tokens", 300, "words in each tenant's system prompt"),
    ("fault-every", 6, "seconds between injected faults"),
    ("oversized-mb", 64, "size of the oversized values written under cache keys"),
    ("capacity", 3000, "device pool in tokens (small: prefixes spill to Redis and return)"),
])  # fmt: skip


def add_parser(suites: argparse._SubParsersAction) -> None:
    add_suite(
        suites,
        "soak",
        run,
        help="several tenants' agent traffic while Redis, clients and a flooding tenant misbehave",
        description="Agent traffic of several tenants against kvblocks serve with a Redis tier while faults "
        "are injected; every reply is checked against the request alone without the cache.",
        model=True,
        options=OPTIONS,
    )


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    with tempfile.TemporaryDirectory(prefix="kvblocks-soak-") as tmp:
        work = Path(tmp)
        keys = write_keys(work)
        secret = work / "secret"
        secret.write_text("soak-secret-" + "x" * 32)
        secret.chmod(0o600)
        with RedisServer(work / "redis") as redis:
            redis.start()
            server = spawn_serve(serve_args(args, keys, redis.url, secret), work)
            try:
                wait_serve(server)
                tally, readings = soak(server, redis, args)
            finally:
                server.stop(60)
        wrong = replay(args, tally, work)
    return [report(args, tally, readings, wrong)]


def serve_args(args: argparse.Namespace, keys: Path, redis_url: str, secret: Path) -> list[str]:
    model = ["--model", args.model] if args.model else []
    return [
        *model, "--capacity", str(args.capacity), "--api-keys", str(keys),
        "--redis", redis_url, "--redis-secret-file", str(secret), "--redis-chunk-tokens", "32",
    ]  # fmt: skip


def write_keys(work: Path) -> Path:
    entries = [{"key": f"sk-soak-{t}-0000", "tenant": t} for t in TENANTS]
    for entry in entries:
        if entry["tenant"] in BOUNDED:
            entry |= {"max_running": 4, "max_waiting": 32}
    entries.append({"key": "sk-soak-admin-0000", "tenant": "ops", "admin": True})
    path = work / "keys.json"
    path.write_text(json.dumps({"keys": entries}))
    path.chmod(0o600)
    return path


def system_prompt(tenant: str, words: int) -> str:
    rng = random.Random(tenant)
    return f"You are {tenant}'s support agent. " + " ".join(rng.choice(TOPICS) for _ in range(words))


def soak(server: Service, redis: RedisServer, args: argparse.Namespace) -> tuple[Tally, dict[str, float]]:
    """The victim's TTFT and the too-long prompt's 400 on the idle server; then the traffic without
    faults (warm-up: RSS is read after it); then the traffic under faults. Returns the tally of the
    last phase and the readings."""
    if not ATTACKS:  # built before any TTFT is timed: the client's work is not the server's latency
        ATTACKS.extend(build_attacks())
    idle = Tally()
    for i in range(16):  # the first turns compute the victim's system prompt, the rest hit it
        victim_turn(server, args, idle if i >= 4 else Tally(), i)
    for _ in range(5):
        malformed(server, idle, only="huge prompt")
    readings = {
        "idle_ttft_p99": float(np.percentile(idle.ttft_s, 99)),
        "idle_huge_prompt_s": _median(idle.huge_prompt_s),
    }
    for flooder in ("flood", "capped"):  # the victim while only a flooder runs (the fairness target)
        flooded = Tally()
        traffic(server, redis, args, flooded, 30, faults_on=False, agents=False, flooder=flooder)
        readings[f"{flooder}_ttft_p99"] = float(np.percentile(flooded.ttft_s, 99))
        readings[f"{flooder}_429"] = flooded.rejected_429
        readings[f"{flooder}_timeouts"] = flooded.timeouts
    attacked = Tally()  # the victim while only the attacker runs
    traffic(server, redis, args, attacked, 30, faults_on=False, agents=False, flooder=None, attacker=True)
    readings["attack_ttft_p99"] = float(np.percentile(attacked.ttft_s, 99))
    readings["attack_5xx"] = len(attacked.bad_5xx)
    readings["attack_timeouts"] = attacked.attack_timeouts
    readings["attacks"] = attacked.attacks
    traffic(server, redis, args, Tally(), max(10, args.duration // 4), faults_on=False)
    readings["warm"] = rss_mib(server)
    tally = Tally()
    traffic(server, redis, args, tally, args.duration, faults_on=True)
    if redis.paused:
        redis.resume()
    readings["end"] = rss_mib(server)
    readings["alive"] = float(server.alive())
    return tally, readings


def traffic(
    server: Service, redis: RedisServer, args, tally: Tally, seconds: int, faults_on: bool,
    agents: bool = True, flooder: str | None = "flood", attacker: bool | None = None,
) -> None:  # fmt: skip
    """The victim, the `flooder` tenant and (by default with `agents`) the attacker for `seconds`; with
    `agents`, every other tenant's traffic too (and the Redis faults, if on). The flooder runs six
    clients of eight prompts each: "flood" without bounds of its own, "capped" with `max_running` 4 and
    `max_waiting` 32 (fewer than its 48 prompts, so it meets 429s). The attacker runs two clients, each
    sending the attacks in turn."""
    stop = threading.Event()
    workers = [threading.Thread(target=agent, args=(server, args, tally, t, a, stop))
               for t in ("alpha", "beta") for a in range(args.agents if agents else 0)]  # fmt: skip
    turns = itertools.count()
    steps = [lambda: victim_turn(server, args, tally, next(turns))]
    if flooder is not None:
        steps += [lambda: flood(server, tally, flooder)] * 6
    if agents:
        steps += [lambda: malformed(server, tally), lambda: vanish(server), lambda: health(server, tally)]
    if attacker if attacker is not None else agents:
        rounds = itertools.count()
        steps += [lambda: attack(server, tally, next(rounds))] * 2
    workers += [threading.Thread(target=loop, args=(stop, step)) for step in steps]
    if faults_on:
        workers.append(threading.Thread(target=faults, args=(stop, redis, args, tally)))
    for w in workers:
        w.start()
    stop.wait(seconds)
    stop.set()
    for w in workers:
        w.join(300)


def loop(stop: threading.Event, step: Callable[[], None]) -> None:
    while not stop.is_set():
        step()


def agent(server: Service, args, tally: Tally, tenant: str, index: int, stop: threading.Event) -> None:
    """Conversations of three turns on the tenant's system prompt; the replies become the history."""
    rng = random.Random(f"{tenant}-{index}")
    system = {"role": "system", "content": system_prompt(tenant, args.system_tokens)}
    while not stop.is_set():
        messages = [system]
        for _ in range(3):
            messages.append(
                {"role": "user", "content": f"Agent {index}: tell me about {rng.choice(TOPICS)}."}
            )
            body = {"model": MODEL, "messages": list(messages), "max_tokens": args.max_tokens}
            body["temperature"] = 0
            reply = chat(server, tenant, body, tally)
            if reply is None or stop.is_set():
                break
            messages.append({"role": "assistant", "content": reply})


def victim_turn(server: Service, args, tally: Tally, i: int) -> None:
    """One streamed request of the victim tenant; its TTFT is the first chunk carrying text."""
    body = {
        "model": MODEL, "max_tokens": 4, "temperature": 0, "stream": True,
        "messages": [{"role": "system", "content": system_prompt("victim", args.system_tokens)},
                     {"role": "user", "content": f"Question {i % 5}: where is my order?"}],
    }  # fmt: skip
    session = client(server)  # made before the clock starts: an agent's SDK client exists before it asks
    start = time.perf_counter()
    first, text = None, ""
    try:
        with session.stream("POST", "/v1/chat/completions", json=body, headers=headers("victim"),
                            timeout=300) as r:  # fmt: skip
            if r.status_code != 200:
                r.read()
                tally.answered("victim", r)
                return
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # the stream failed after its 200
                    tally.add("good_5xx", f"victim: error event {chunk['error']}")
                    return
                delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
                if delta.get("content") and first is None:
                    first = time.perf_counter() - start
                text += delta.get("content") or ""
    except httpx.TimeoutException:
        tally.add("timeouts", "victim: stream past the client's 300 s")
        return
    except httpx.TransportError as exc:
        tally.add("good_5xx", f"victim: transport error {exc}")
        return
    tally.add("ttft_s", first if first is not None else time.perf_counter() - start)
    tally.add("replies", ({**body, "stream": False}, text))


def flood(server: Service, tally: Tally, tenant: str) -> None:
    """Eight prompts per request, as fast as the server answers; 429s are what a bounded one should
    get, and after one the flooder waits what its `Retry-After` says, as the OpenAI SDKs do."""
    body = {"model": MODEL, "prompt": [f"flood {i} " * 30 for i in range(8)], "max_tokens": 16}
    r = send(
        tally,
        lambda: client(server).post("/v1/completions", json=body, headers=headers(tenant), timeout=300),
        "timeouts", f"{tenant}: completions request", "good_5xx",
    )  # fmt: skip
    if r is not None and not tally.answered(tenant, r) and r.status_code == 429:
        time.sleep(float(r.headers.get("retry-after", 1)))


def health(server: Service, tally: Tally) -> None:
    try:
        r = client(server).get("/health", timeout=10)
        if r.status_code != 200:
            tally.add("health_failures", f"{r.status_code} {r.text[:200]}")
    except httpx.TransportError as exc:
        tally.add("health_failures", f"transport error {exc}")
    if not server.alive():
        tally.add("health_failures", "the server process exited")
    time.sleep(0.5)


def faults(stop: threading.Event, redis: RedisServer, args, tally: Tally) -> None:
    """One Redis fault every `fault_every` seconds, in turn."""
    kinds = (pause, kill_restart, flushall, bitflip, oversize, wrong_type)
    i = 0
    while not stop.wait(args.fault_every):
        kind = kinds[i % len(kinds)]
        try:
            kind(redis, args)
            tally.add("faults", kind.__name__)
        except Exception as exc:
            tally.add("faults", f"{kind.__name__} failed: {exc}")
        i += 1


def pause(redis: RedisServer, args) -> None:
    redis.pause()
    time.sleep(2.0)
    redis.resume()


def kill_restart(redis: RedisServer, args) -> None:
    redis.kill()
    time.sleep(1.0)
    redis.start()


def flushall(redis: RedisServer, args) -> None:
    with redis.client() as c:
        c.flushall()


def cache_keys(redis: RedisServer, n: int) -> list[bytes]:
    with redis.client() as c:
        return [k for _, k in zip(range(n), c.scan_iter(count=100))]


def bitflip(redis: RedisServer, args) -> None:
    with redis.client() as c:
        for key in cache_keys(redis, 8):
            value = bytearray(c.get(key) or b"")
            if value:
                value[len(value) // 2] ^= 0x40
                c.set(key, bytes(value))


def oversize(redis: RedisServer, args) -> None:
    with redis.client(socket_timeout=30) as c:
        for key in cache_keys(redis, 2):
            c.set(key, b"\x00" * (args.oversized_mb << 20))


def wrong_type(redis: RedisServer, args) -> None:
    with redis.client() as c:
        for key in cache_keys(redis, 4):
            c.delete(key)
            c.rpush(key, b"not a record")


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def rss_mib(server: Service) -> float:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def replay(args: argparse.Namespace, tally: Tally, work: Path) -> list[str]:
    """Every recorded request run alone without the cache (each distinct body once: greedy replies to
    one body must all equal its reference): the replies that differ. The reference is a server in the
    soaked one's configuration and dtype, its cache flushed before each request: a `--no-cache` server
    runs one request per forward, which in bfloat16 (the default on a CPU with native BF16) rounds
    otherwise than the batch-invariant engine, cache or not."""
    model = ["--model", args.model] if args.model else []
    server = spawn_serve(model, work, "reference")
    by_body: dict[str, list[str]] = {}
    for body, text in tally.replies:
        by_body.setdefault(json.dumps(body, sort_keys=True), []).append(text)
    wrong = []
    try:
        wait_serve(server)
        with httpx.Client(base_url=server.url, timeout=300) as c:
            for key, texts in by_body.items():
                body = json.loads(key)
                c.post("/flush_cache").raise_for_status()  # alone, without the cache
                r = c.post("/v1/chat/completions", json=body)
                expected = r.json()["choices"][0]["message"]["content"] or ""
                asked = body["messages"][-1]["content"]
                wrong += [f"{asked!r}: {text!r} != {expected!r}" for text in texts if text != expected]
    finally:
        server.stop(30)
    return wrong


def report(args: argparse.Namespace, tally: Tally, readings: dict[str, float], wrong: list[str]) -> Report:
    params = {"duration_s": args.duration, "agents": args.agents * 2, "max_tokens": args.max_tokens}
    params |= {"capacity": args.capacity, "fault_every_s": args.fault_every}
    title = "Soak: agent tenants, a victim and a flooder while Redis and clients misbehave"
    r = Report("soak", title, params)
    soak_p99 = float(np.percentile(tally.ttft_s, 99)) if tally.ttft_s else float("inf")
    growth = (readings["end"] - readings["warm"]) / readings["warm"]
    flood_vs_idle = readings["flood_ttft_p99"] / readings["idle_ttft_p99"]
    capped_vs_idle = readings["capped_ttft_p99"] / readings["idle_ttft_p99"]
    timeouts = tally.timeouts + readings["flood_timeouts"] + readings["capped_timeouts"]
    attack_timeouts = tally.attack_timeouts + readings["attack_timeouts"]
    attack_vs_idle = readings["attack_ttft_p99"] / readings["idle_ttft_p99"]
    huge_ms = 1e3 * readings["idle_huge_prompt_s"]
    r.checks += [
        Check("wrong outputs", len(wrong), "", 0),
        Check("engine deaths (health not 200)", len(tally.health_failures) + (1 - readings["alive"]), "", 0),
        Check("5xx on well-formed requests", len(tally.good_5xx), "", 0),
        Check("5xx on malformed requests", len(tally.bad_5xx), "", 0),
        Check("victim TTFT p99 while a tenant floods / idle p99", flood_vs_idle, "x", 2.0),
        Check("victim TTFT p99 while a tenant with max_running floods / idle p99", capped_vs_idle, "x", 2.0),
        Check("client timeouts on well-formed requests", len(timeouts), "", 0),
        Check("victim TTFT p99 while a tenant attacks / idle p99", attack_vs_idle, "x", 2.0),
        Check("5xx on the attacks", readings["attack_5xx"], "", 0),
        Check(
            f"attacks past the client's {ATTACK_TIMEOUT_S} s (served at the attacker's share)",
            len(attack_timeouts),
        ),
        Check("RSS growth after warm-up", 100 * growth, "%", 10.0),
        Check("3.5 MB prompt that cannot fit: 400 on the idle server, p50", huge_ms, "ms", 100),
    ]
    r.notes += [
        f"{len(tally.replies)} replies ({len({json.dumps(b, sort_keys=True) for b, _ in tally.replies})} "
        f"distinct requests) checked against each request alone on a server whose cache is flushed before "
        f"each; {tally.rejected_429} requests "
        f"refused with 429; faults injected: {len(tally.faults)} ({', '.join(sorted(set(tally.faults)))})",
        f"victim TTFT p99: {readings['idle_ttft_p99'] * 1e3:.0f} ms idle, "
        f"{readings['flood_ttft_p99'] * 1e3:.0f} ms while the flooder alone runs "
        f"({readings['flood_429']} of its requests refused with 429), "
        f"{readings['capped_ttft_p99'] * 1e3:.0f} ms while a flooder with max_running 4 runs "
        f"({readings['capped_429']} refused with 429), {soak_p99 * 1e3:.0f} ms under the "
        f"whole soak (two more tenants' agents and the faults: {soak_p99 / readings['idle_ttft_p99']:.1f}x); "
        f"RSS {readings['warm']:.0f} MiB after warm-up, {readings['end']:.0f} MiB at the end; the too-long "
        f"prompt's 400 took {1e3 * _median(tally.huge_prompt_s):.0f} ms (p50) under load",
    ]
    r.notes.append(
        "attacks (status: count, p50 time): " + attack_summary(readings["attacks"] + tally.attacks)
    )
    r.notes += [f"wrong: {w}" for w in wrong[:5]] + [
        f"5xx: {e}" for e in (tally.good_5xx + tally.bad_5xx)[:5]
    ]
    r.notes += [f"health: {h}" for h in tally.health_failures[:5]] + tally.bad_not_4xx[:5]
    r.notes += [f"client timeout: {t}" for t in (timeouts + attack_timeouts)[:5]]
    return r


def attack_summary(attacks: list[tuple[str, int, float]]) -> str:
    by_name: dict[str, list[tuple[int, float]]] = {}
    for name, status, seconds in attacks:
        by_name.setdefault(name, []).append((status, seconds))
    parts = []
    for name, seen in by_name.items():
        statuses = sorted({status for status, _ in seen})
        counts = ", ".join(f"{st}: {sum(1 for x, _ in seen if x == st)}" for st in statuses)
        parts.append(f"{name} ({counts}, {1e3 * _median([t for _, t in seen]):.0f} ms)")
    return "; ".join(parts) or "none"
