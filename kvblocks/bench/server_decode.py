"""The decode-heavy load of `kvblocks bench server --decode-heavy N` (issue 23's peers check).

Every agent sends one turn with `N` max_tokens, all at once, against the batched kvblocks server
and the peers of the run (llama-server at its best setting, transformers serve). Prefill is a
small share here: the servers race on decode, where llama.cpp's quantised kernels are strongest.
The round's wall time is the makespan. Makespans compare only where every reply has its `N`
tokens, so kvblocks and llama-server are asked to write past end-of-sequence (`ignore_eos`, which
both take; transformers serve refuses fields it does not know, and its replies may end sooner);
the report counts the replies that came back shorter, by their servers' `usage`.
"""

from __future__ import annotations

import time

import numpy as np

from kvblocks.bench.harness import Check, Report
from kvblocks.bench.server_agents import Load, p50_p99, ttfts, wave

KVBLOCKS = "kvblocks serve (batched)"
NAMES = {
    "batched": KVBLOCKS,
    "llama": "llama.cpp llama-server",
    "transformers": "transformers serve --continuous-batching",
}
FULL_LENGTH = {"batched": {"ignore_eos": True}, "llama": {"ignore_eos": True}}  # the body fields per server


def servers(args, urls: dict[str, str]) -> list[str]:
    """The servers the decode-heavy load runs on (none unless asked for)."""
    if not args.decode_heavy:
        return []
    return [key for key in NAMES if key in urls]


async def drive(client, loads: dict, tokenizer, system: str, args, bar) -> dict:
    """Rounds of the decode-heavy wave, rotated between the servers; returns a fresh `Load` per
    server holding only these requests."""
    keys = servers(args, {key: load.url for key, load in loads.items()})
    heavy = {key: Load(loads[key].url, loads[key].model) for key in keys}
    for r in range(args.rounds if keys else 0):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            t0 = time.perf_counter()
            done = await wave(
                client,
                heavy[key],
                tokenizer,
                system,
                args,
                f"decode {r}",
                1,
                bar,
                args.decode_heavy,
                FULL_LENGTH.get(key),
            )
            heavy[key].spans.append(time.perf_counter() - t0)
            heavy[key].timed += done
    return heavy


def report(args, heavy: dict, llama_slots: int) -> Report:
    samples = {NAMES[key]: ttfts(load.timed) for key, load in heavy.items()}
    params = {"agents": args.agents, "turns": 1, "max_tokens": args.decode_heavy, "rounds": args.rounds}
    params |= {"system_prompt_tokens": args.system_tokens, "clock": "wall (client side, streaming)"}
    title = f"decode-heavy: {args.agents} agents x 1 turn x {args.decode_heavy} tokens, kvblocks vs peers"
    out = Report(
        "server-decode-heavy", title, params, samples, baseline=KVBLOCKS if "batched" in heavy else None
    )
    for key, load in heavy.items():
        p50, p99 = p50_p99(samples[NAMES[key]])
        out.checks += [
            Check(f"makespan (median round), {NAMES[key]}", median(load.spans), "s"),
            Check(f"TTFT p50, {NAMES[key]}", p50, "s"),
            Check(f"TTFT p99, {NAMES[key]}", p99, "s"),
            Check(f"completion tokens/s, {NAMES[key]}", tokens_per_s(load), "tok/s"),
            Check(
                f"replies short of {args.decode_heavy} tokens, {NAMES[key]}", short(load, args.decode_heavy)
            ),
        ]
    if "batched" in heavy and "llama" in heavy:
        ours, theirs = heavy["batched"], heavy["llama"]
        out.checks += [
            Check(
                "makespan llama-server / kvblocks", median(theirs.spans) / median(ours.spans), "", 1.5, True
            ),
            Check("completion tokens/s kvblocks / llama-server", tokens_per_s(ours) / tokens_per_s(theirs)),
            Check(
                "TTFT p50 llama-server / kvblocks",
                p50_p99(ttfts(theirs.timed))[0] / p50_p99(ttfts(ours.timed))[0],
                "",
                10.0,
                True,
            ),
        ]
    out.notes = [
        f"every agent sends one chat turn (the shared {args.system_tokens}-token system prompt, cached by "
        f"the earlier rounds, and a new user message) asking for {args.decode_heavy} tokens at temperature "
        "0, all agents at once; makespan = the round's wall time from the first request sent to the last "
        "reply done",
        f"llama-server runs with `--parallel {llama_slots}`"
        + (" (its best setting on one thread)" if llama_slots == 1 else ""),
        "kvblocks and llama-server write every reply to its max_tokens (`ignore_eos`); a makespan ratio "
        "compares equal work only where neither has replies short of it",
    ]
    return out


def median(values: list[float]) -> float:
    return float(np.median(values))


def tokens_per_s(load) -> float:
    """Completion tokens (the server's `usage`, else the re-tokenised reply) over the rounds' wall time."""
    return sum(completion_tokens(s) for s in load.timed) / sum(load.spans)


def completion_tokens(s) -> int:
    return s.completion_tokens or len(s.reply_ids)


def short(load, max_tokens: int) -> int:
    """Timed replies with fewer than `max_tokens` tokens (an end-of-sequence honoured, or an error)."""
    return sum(completion_tokens(s) < max_tokens for s in load.timed)
