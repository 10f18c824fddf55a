"""The soak's HTTP side (`kvblocks bench soak`): what the traffic saw (`Tally`), each thread's
keep-alive client, well-formed chat requests, malformed bodies and the hostile tenant's attacks."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from kvblocks.launch.service import Service

ATTACK_TIMEOUT_S = 300  # an attack request's client timeout: see `attack`
MODEL = "unknown"  # what a request that names no model sends (sglang-router's placeholder): the served one


@dataclass(slots=True)
class Tally:
    """What the traffic saw, shared by its threads (under `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    replies: list[tuple[dict, str]] = field(default_factory=list)  # (chat body, reply text)
    good_5xx: list[str] = field(default_factory=list)
    bad_5xx: list[str] = field(default_factory=list)
    bad_not_4xx: list[str] = field(default_factory=list)
    rejected_429: int = 0
    health_failures: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    huge_prompt_s: list[float] = field(default_factory=list)  # time to the 400 of a prompt too long
    attacks: list[tuple[str, int, float]] = field(default_factory=list)  # (attack, status, seconds)
    # requests the client gave up on (its timeout, not an answer of the server): "tenant: what"
    timeouts: list[str] = field(default_factory=list)
    attack_timeouts: list[str] = field(default_factory=list)

    def add(self, name: str, value) -> None:
        with self.lock:
            getattr(self, name).append(value)

    def answered(self, who: str, response: httpx.Response) -> bool:
        """Whether a well-formed request of `who` got its 200; a 429 is counted as a refusal, a
        5xx as a failure, anything else noted."""
        if response.status_code == 200:
            return True
        if response.status_code == 429:
            with self.lock:
                self.rejected_429 += 1
        else:
            kind = "good_5xx" if response.status_code >= 500 else "bad_not_4xx"
            self.add(kind, f"{who}: {response.status_code} {response.text[:200]}")
        return False


def headers(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer sk-soak-{tenant}-0000"}


_CLIENTS = threading.local()


def client(server: Service) -> httpx.Client:
    """This thread's keep-alive client of `server`, as an agent's SDK keeps one. A new client a request
    builds an SSL context and a connection each time: tens of milliseconds of the client's CPU and
    GIL on the cores the server uses, which the victim's TTFT measured too, more so the more threads
    (the flooder's six) made clients at once."""
    clients = _CLIENTS.__dict__.setdefault("by_url", {})
    if server.url not in clients:
        clients[server.url] = httpx.Client(base_url=server.url)
    return clients[server.url]


def send(
    tally: Tally, post: Callable[[], httpx.Response], timeouts: str, what: str, failures: str
) -> httpx.Response | None:
    """`post()`'s answer, or None: past the client's timeout it is noted in the tally's `timeouts`
    (the client giving up, not an answer of the server), a transport error in its `failures`."""
    try:
        return post()
    except httpx.TimeoutException:
        tally.add(timeouts, f"{what} past the client's timeout")
    except httpx.TransportError as exc:
        tally.add(failures, f"{what}: transport error {exc}")
    return None


def chat(server: Service, tenant: str, body: dict, tally: Tally, timeout: float = 300) -> str | None:
    """A well-formed chat request: its reply text (recorded for the replay), None when refused."""
    r = send(
        tally,
        lambda: client(server).post("/v1/chat/completions", json=body, headers=headers(tenant), timeout=timeout),
        "timeouts", f"{tenant}: chat request", "good_5xx",
    )  # fmt: skip
    if r is None or not tally.answered(tenant, r):
        return None
    text = r.json()["choices"][0]["message"]["content"] or ""
    tally.add("replies", (body, text))
    return text


MALFORMED: tuple[tuple[str, bytes], ...] = (
    ("not json", b"{not json"),
    ("deep nesting", b'{"model": "x", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("lone surrogate", b'{"model": "x", "messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("unknown field", b'{"model": "x", "messages": [], "frobnicate": 1}'),
    ("huge prompt", b'{"model": "x", "prompt": "' + b"word " * 700_000 + b'", "max_tokens": 1}'),
    ("bad penalty", b'{"model": "x", "prompt": "0", "max_tokens": 2, "repetition_penalty": 1e-38}'),
)


def malformed(server: Service, tally: Tally, only: str | None = None) -> None:
    for name, raw in MALFORMED:
        if only is not None and name != only:
            continue
        route = "/v1/completions" if b'"prompt"' in raw else "/v1/chat/completions"
        start = time.perf_counter()
        try:
            r = httpx.post(f"{server.url}{route}", content=raw, timeout=60,
                           headers=headers("beta") | {"Content-Type": "application/json"})  # fmt: skip
        except httpx.TransportError as exc:
            tally.add("bad_5xx", f"{name}: transport error {exc}")
            continue
        if name == "huge prompt":
            tally.add("huge_prompt_s", time.perf_counter() - start)
        if r.status_code >= 500:
            tally.add("bad_5xx", f"{name}: {r.status_code} {r.text[:200]}")
        elif not 400 <= r.status_code < 500:
            tally.add("bad_not_4xx", f"{name}: {r.status_code}")
    if only is None:
        time.sleep(1.0)


def ref_chain(links: int) -> dict:
    """A JSON schema whose `$defs` form one flat `$ref` chain of `links` links (~33 bytes a link)."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(links)}
    defs[f"d{links}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def build_attacks() -> list[tuple[str, str, bytes]]:
    """(name, route, body) of each attack; each must be a 4xx, or a 200 that costs only its sender."""
    chain = {"type": "json_schema", "json_schema": {"name": "chain", "schema": ref_chain(3000)}}
    user = [{"role": "user", "content": "hi"}]
    blocks = [{"text": f" w{i}", "block": True} for i in range(250)] + [{"text": " end"}]
    few_blocks = [{"text": f" block {i} " * 4, "block": True} for i in range(48)] + [{"text": " end"}]
    tiny_messages = [{"role": "user", "content": "a"}] * 115_000
    items = [{"role": "user", "content": "a"}] * 110_000
    metadata = {f"k{i}": "v" * 4000 for i in range(900)}
    stored = [{"role": "user", "content": "remember " * 6000}]
    pinned = [{"role": "system", "content": [{"type": "text", "text": "pin " * 4000,
                                              "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}, *user]  # fmt: skip
    bodies = [
        ("ref chain", "/v1/chat/completions", {"messages": user, "max_tokens": 4, "response_format": chain}),
        ("ref chain (text.format)", "/v1/responses",
         {"input": "hi", "max_output_tokens": 4, "text": {"format": {"type": "json_schema", "name": "c",
                                                                      "schema": ref_chain(3000)}}}),
        ("250 blocks", "/v1/completions",
         {"prompt_blocks": blocks, "kv_mode": "blend", "max_tokens": 2}),
        ("48 blocks", "/v1/completions",
         {"prompt_blocks": few_blocks, "kv_mode": "blend", "max_tokens": 2}),
        ("115k messages", "/v1/chat/completions", {"messages": tiny_messages, "max_tokens": 1}),
        ("110k input items", "/v1/responses", {"input": items, "max_output_tokens": 1}),
        ("huge metadata", "/v1/responses", {"input": "hi", "max_output_tokens": 1, "metadata": metadata}),
        ("stored 48 KB", "/v1/responses", {"input": stored, "max_output_tokens": 1, "store": True}),
        ("pin the cache", "/v1/chat/completions", {"messages": pinned, "max_tokens": 1}),
    ]  # fmt: skip
    return [(name, route, json.dumps({"model": MODEL, **body}).encode()) for name, route, body in bodies]


ATTACKS: list[tuple[str, str, bytes]] = []  # built once by `soak` before its phases (~8 MB of JSON)


def attack(server: Service, tally: Tally, i: int) -> None:
    """The attacker's next attack: its status and time are recorded; a 5xx or a dead server is a failure.
    A request the server accepts is served at the attacker's share: while the victim is active, one
    16-token cut of prefill a step (SERVER.md, Limits, fairness and faults), so the stored 6,000-token
    conversation takes 375 steps, 1-2 minutes on a 2-core CPU, after the attacker's request before it.
    The client waits `ATTACK_TIMEOUT_S` for that; past it the request counts as a client timeout, which
    is the client giving up, not an answer of the server (a 5xx)."""
    name, route, raw = ATTACKS[i % len(ATTACKS)]
    start = time.perf_counter()
    r = send(
        tally,
        lambda: client(server).post(route, content=raw, timeout=ATTACK_TIMEOUT_S,
                                    headers=headers("attacker") | {"Content-Type": "application/json"}),
        "attack_timeouts", f"attacker: {name}", "bad_5xx",
    )  # fmt: skip
    if r is None:
        return
    tally.add("attacks", (name, r.status_code, time.perf_counter() - start))
    if r.status_code >= 500:
        tally.add("bad_5xx", f"attack {name}: {r.status_code} {r.text[:200]}")
    if not server.alive():
        tally.add("health_failures", f"the server process exited after the attack {name}")
    time.sleep(0.2)


def vanish(server: Service) -> None:
    """A client that starts a stream and hangs up after its first chunk."""
    body = {"model": MODEL, "prompt": "vanishing client " * 20, "max_tokens": 64, "stream": True}
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers("alpha"),
                          timeout=60) as r:  # fmt: skip
            for _ in r.iter_lines():
                break
    except httpx.TransportError:
        pass
    time.sleep(0.5)
