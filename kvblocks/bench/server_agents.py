"""The client side of `kvblocks bench server`: agents that stream chat completions and what each
request saw (`Sent`), per server (`Load`). Shared by the agent load (`server.py`) and the
decode-heavy load (`server_decode.py`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np


@dataclass(slots=True)
class Sent:
    """One request as the client saw it."""

    agent: int
    turn: int
    prompt_ids: list[int]
    submitted: float
    first: float = 0.0
    done: float = 0.0
    text: str = ""
    reply_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0  # the server's `usage` (0 where it sent none)

    @property
    def ttft(self) -> float:
        return self.first - self.submitted


@dataclass(slots=True)
class Load:
    """One server (its URL and served model id) and what it was sent: every request, the timed
    rounds' requests and their wall times."""

    url: str
    model: str = ""
    sent: list[Sent] = field(default_factory=list)
    timed: list[Sent] = field(default_factory=list)
    spans: list[float] = field(default_factory=list)
    resent: int = 0  # requests sent again on a new connection: a kept-alive one closed under them


async def wave(
    client,
    load: Load,
    tokenizer,
    system: str,
    args,
    tag: str,
    turns: int,
    bar,
    max_tokens: int | None = None,
    extra: dict | None = None,
) -> list[Sent]:
    """All agents at once, each a conversation of `turns` requests (`extra`: fields added to each
    request's body); returns the requests sent."""
    results = await asyncio.gather(
        *(
            agent(client, load, tokenizer, system, args, tag, a, turns, bar, max_tokens, extra)
            for a in range(args.agents)
        )
    )
    return [s for convo in results for s in convo]


async def agent(
    client,
    load: Load,
    tokenizer,
    system: str,
    args,
    tag: str,
    index: int,
    turns: int,
    bar=None,
    max_tokens: int | None = None,
    extra: dict | None = None,
) -> list[Sent]:
    from kvblocks.generate.text import encode_prompt

    messages = [{"role": "system", "content": system}]
    sent = []
    for turn in range(turns):
        order = 1000 + 37 * index + turn
        text = f"[{tag}] Customer {index} says: my order {order} has not arrived yet (message {turn + 1}). "
        text += "What should I do?"
        messages.append({"role": "user", "content": text})
        s = Sent(index, turn, encode_prompt(tokenizer, messages), time.perf_counter())
        load.sent.append(s)
        await chat(client, load, messages, max_tokens or args.max_tokens, s, extra)
        s.reply_ids = tokenizer(s.text, add_special_tokens=False)["input_ids"]
        messages.append({"role": "assistant", "content": s.text})
        sent.append(s)
        if bar is not None:
            bar.update()
    return sent


async def chat(
    client, load: Load, messages: list[dict], max_tokens: int, s: Sent, extra: dict | None = None
) -> None:
    """One streaming chat completion; fills in `s` (first content chunk, text, usage)."""
    url = load.url
    body = {"model": load.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    body |= {"stream": True, "stream_options": {"include_usage": True}} | (extra or {})
    s.submitted = time.perf_counter()
    try:
        await _stream(client, url, body, s)
    except httpx.RemoteProtocolError:
        # A pooled connection the server had closed while idle (llama-server closes kept-alive
        # connections after a few seconds): nothing was answered, so the request is sent once more
        # on a new connection and counted; a second failure, or one after an answer began, stands.
        if s.first or s.text or s.prompt_tokens:
            raise
        load.resent += 1
        await _stream(client, url, body, s)
    s.done = time.perf_counter()
    s.first = s.first or s.done


async def _stream(client, url: str, body: dict, s: Sent) -> None:
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(f"{url} streamed an error: {event['error']}")
            if event.get("usage"):
                s.prompt_tokens = event["usage"]["prompt_tokens"]
                s.completion_tokens = event["usage"].get("completion_tokens") or 0
                details = event["usage"].get("prompt_tokens_details") or {}  # transformers serve has none
                s.cached_tokens = details.get("cached_tokens") or 0
            for choice in event["choices"]:
                content = choice["delta"].get("content")
                if content:
                    s.first = s.first or time.perf_counter()
                    s.text += content


def ttfts(sent: list[Sent]) -> list[float]:
    return [s.ttft for s in sent]


def p50_p99(ttft: list[float]) -> tuple[float, float]:
    return float(np.median(ttft)), float(np.percentile(ttft, 99))
