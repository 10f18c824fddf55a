"""Work a request may cost before it is validated: prompt length, concurrent tokenisation.

A prompt that cannot fit the context is refused before it is tokenised. The bound is on
characters and never refuses a prompt that fits: no token stands for more than `max_token_bytes`
bytes of text, and a character is at least a byte, so a text of more than
`max_context * max_token_bytes` characters needs at least `max_context` tokens. Tokenisation runs in
worker threads, at most `MAX_TOKENIZING` at once, so a burst of large prompts queues instead of
multiplying the server's memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from starlette.concurrency import run_in_threadpool

from kvblocks.server.errors import APIError

MAX_TOKENIZING = 2
T = TypeVar("T")


def max_token_bytes(tokenizer) -> int | None:
    """The most UTF-8 bytes any token decodes to (81 for SmolLM2), or None where the bound does not
    hold: a normalizer may delete characters before tokenisation, so text length says nothing."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return max(len(text.encode("utf-8", "surrogatepass")) for text in texts)


def char_limit(tokenizer, max_context: int | None) -> int | None:
    """Characters above which a text cannot fit `max_context` tokens (None: no safe bound)."""
    longest = max_token_bytes(tokenizer) if max_context else None
    return None if longest is None else max_context * longest


def check_chars(limit: int | None, chars: int, max_context: int | None, where: str) -> None:
    """Refuse a text of `chars` characters that cannot fit the context, before tokenising it."""
    if limit is not None and chars > limit:
        raise APIError(
            400,
            f"{where}: the prompt has {chars} characters, more than any prompt that fits the model's "
            f"context of {max_context} tokens can have ({limit})",
            param=where,
            code="context_length_exceeded",
        )


async def tokenizing(gate: asyncio.Semaphore, fn: Callable[..., T], *args) -> T:
    """`fn(*args)` in a worker thread, once one of the `MAX_TOKENIZING` places is free."""
    async with gate:
        return await run_in_threadpool(fn, *args)


def chat_chars(messages) -> int:
    """Characters of the messages that any chat template renders (stripped at most); an assistant
    turn is left out because some templates drop earlier turns' reasoning."""
    return sum(len(m.text().strip()) for m in messages if m.role != "assistant")
