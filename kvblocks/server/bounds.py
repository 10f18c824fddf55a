"""Work a request may cost before it is validated: prompt length, concurrent tokenisation.

A prompt that cannot fit the context is refused before it is tokenised. The bound is on
characters and never refuses a prompt that fits: no token stands for more than `max_token_bytes`
bytes of text, and a character is at least a byte, so a text of more than
`max_context * max_token_bytes` characters needs at least `max_context` tokens (chat messages get
a tighter bound in `kvblocks.server.cost`). Tokenisation runs in worker threads, at most
`MAX_TOKENIZING` at once, so a burst of large prompts queues instead of multiplying the server's
memory; the places go fairly across tenants (`FairGate`), so one tenant's burst cannot hold them all.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
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


def char_limit(token_bytes: int | None, max_context: int | None) -> int | None:
    """Characters above which a text cannot fit `max_context` tokens, given the longest token's
    bytes (None: no safe bound)."""
    return None if token_bytes is None or not max_context else max_context * token_bytes


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


class FairGate:
    """At most `places` holders at once, shared fairly among tenants.

    When tenants wait, the next free place goes to the waiting tenant that has held places for
    the least time per unit of weight (weighted fair queuing, so places go round-robin by weight);
    a tenant holding its share (`places * weight / the weights of the tenants holding or waiting`)
    takes another only while no tenant under its share waits. Work-conserving: one tenant alone
    may hold every place. A tenant that comes back after idling starts level with the others'
    clock (no credit saved up while idle). `charge(tenant, seconds)` hears each hold as it ends;
    `clock` times the holds. Single event loop only (like asyncio.Semaphore)."""

    def __init__(
        self,
        places: int,
        weight_of: Callable[[str], float] = lambda tenant: 1.0,
        charge: Callable[[str, float], None] = lambda tenant, seconds: None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        assert places >= 1
        self.places = places
        self.clock = clock
        self.weight_of = weight_of
        self.charge = charge
        self.holding: Counter[str] = Counter()
        self.used: dict[str, float] = {}  # seconds held / weight: each tenant's virtual time
        self._waiting: dict[str, deque[asyncio.Future]] = {}
        self._clock = 0.0  # the virtual time of the last tenant given a place

    def waiting(self, tenant: str) -> int:
        return len(self._waiting.get(tenant, ()))

    @asynccontextmanager
    async def place(self, tenant: str) -> AsyncIterator[None]:
        """Hold one place for `tenant`; the time held is charged to it when the block ends."""
        await self._acquire(tenant)
        start = self.clock()
        try:
            yield
        finally:
            self._release(tenant, self.clock() - start)

    async def _acquire(self, tenant: str) -> None:
        if not self.holding[tenant] and not self.waiting(tenant):
            self.used[tenant] = max(self.used.get(tenant, 0.0), self._clock)
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(waiter)
        self._grant()
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.cancelled():  # never given a place: leave the line
                line = self._waiting[tenant]
                line.remove(waiter)
                if not line:
                    del self._waiting[tenant]
                self._grant()
            else:  # given a place as it was cancelled: hand it on
                self._release(tenant, 0.0)
            raise

    def _release(self, tenant: str, seconds: float) -> None:
        self.holding[tenant] -= 1
        if not self.holding[tenant]:
            del self.holding[tenant]
        self.used[tenant] += seconds / self.weight_of(tenant)
        self.charge(tenant, seconds)
        self._grant()

    def _grant(self) -> None:
        while self.holding.total() < self.places and self._waiting:
            tenant = self._next()
            line = self._waiting[tenant]
            waiter = line.popleft()
            if not line:
                del self._waiting[tenant]
            self.holding[tenant] += 1
            self._clock = self.used[tenant]
            waiter.set_result(None)

    def _next(self) -> str:
        """The waiting tenant next in line: under its share before at it, then least used."""
        active = set(self._waiting) | set(self.holding)
        total = sum(self.weight_of(t) for t in active)

        def rank(tenant: str) -> tuple[bool, float]:
            share = self.places * self.weight_of(tenant) / total
            return self.holding[tenant] >= share, self.used[tenant]

        return min(self._waiting, key=rank)


async def tokenizing(gate: FairGate, tenant: str, fn: Callable[..., T], *args) -> T:
    """`fn(*args)` in a worker thread, once `gate` gives `tenant` one of its places."""
    async with gate.place(tenant):
        return await run_in_threadpool(fn, *args)


def chat_chars(messages) -> int:
    """Characters of the messages that any chat template renders (stripped at most); an assistant
    turn is left out because some templates drop earlier turns' reasoning."""
    return sum(len(m.text().strip()) for m in messages if m.role != "assistant")
