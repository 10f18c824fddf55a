"""Large request bodies decoded and validated off the event loop, in worker processes.

A 4 MiB body of small items (100,000 messages, 140,000 content parts) costs one to three seconds
of json, the structure walk and pydantic's validation. json and pydantic hold the GIL for their
whole run, so a worker thread would stall the event loop (and `/health`) just as long: bodies
above `INLINE_BODY_BYTES` go to a small pool of processes, which return the validated model
pickled. It is rebuilt in the executor's own thread, one model's `__setstate__` at a time
(Python code, so the GIL keeps switching to the loop). Small bodies stay inline: for them a
round trip to a process costs more than the parse.

At most `workers` large bodies are parsed at once and one per tenant, so a burst queues (each
waiting body is already read and bounded by --max-body-bytes) instead of multiplying memory. The
workers run `WORKER_NICENESS` steps nicer than the server: a core they share with the engine goes to
the engine's steps first, so another tenant's next token does not wait for a sender's 4 MiB of JSON.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from pydantic import BaseModel

from kvblocks.server.errors import APIError, parse_body

INLINE_BODY_BYTES = 64 << 10
DEFAULT_WORKERS = 2
WORKER_NICENESS = 10  # a nice-10 process gets about a tenth of a core it shares with a nice-0 one


class BodyParser:
    """The worker pool and the gates in front of it; lives on `app.state.body_parser`."""

    def __init__(self, workers: int = DEFAULT_WORKERS) -> None:
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._total = asyncio.Semaphore(workers)
        self._per_tenant: dict[object, asyncio.Semaphore] = {}
        self._tenant_bodies: defaultdict[object, int] = defaultdict(int)  # parsing or queued

    def start(self) -> None:
        """Start the workers (each imports pydantic and the schemas, about a second), so the first
        large body does not pay for it."""
        self._pool = self._new_pool()
        for future in [self._pool.submit(_ready) for _ in range(self.workers)]:
            future.result()

    def stop(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    async def parse(self, tenant, raw: bytes, content_type: str, model: type[BaseModel], *options):
        """`parse_body(raw, content_type, model, *options)`, inline for a small body, else in a
        worker once this tenant's turn and a free worker come."""
        if len(raw) <= INLINE_BODY_BYTES or self._pool is None:
            return parse_body(raw, content_type, model, *options)
        gate = self._per_tenant.setdefault(tenant, asyncio.Semaphore(1))
        self._tenant_bodies[tenant] += 1
        try:
            async with gate, self._total:
                parsed, records = await self._in_worker(raw, content_type, model, *options)
        finally:
            self._tenant_bodies[tenant] -= 1
            if not self._tenant_bodies[tenant]:  # the tenant's last body: forget its gate
                del self._tenant_bodies[tenant], self._per_tenant[tenant]
        for record in records:
            logging.getLogger(record.name).handle(record)
        return parsed

    async def _in_worker(self, *args):
        pool = self._pool
        try:
            return await asyncio.wrap_future(pool.submit(_parse_logged, *args))
        except BrokenProcessPool as exc:  # a worker died (killed, out of memory): start afresh
            if self._pool is pool:
                pool.shutdown(wait=False, cancel_futures=True)
                self._pool = self._new_pool()
            raise APIError(
                503, "the request body could not be parsed: a parsing worker stopped; retry",
                type_="server_error", code="parser_unavailable",
            ) from exc  # fmt: skip

    def _new_pool(self) -> ProcessPoolExecutor:
        # spawn, not fork: the server process runs the engine's threads and holds the model
        return ProcessPoolExecutor(
            self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker
        )


def _start_worker() -> None:
    """A worker leaves shutting down to the server: Ctrl-C or a SIGTERM sent to the process group
    would otherwise kill it mid-parse, with a traceback, while the server drains. It runs nicer than
    the server (`WORKER_NICENESS`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.nice(WORKER_NICENESS)


def _ready() -> None:
    """Nothing: a worker has started once it ran this (its imports are done)."""


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _parse_logged(raw: bytes, content_type: str, model: type[BaseModel], *options):
    """In a worker: the parsed body and the warnings it logged (--lenient's ignored arguments),
    which the server process logs as its own."""
    server_log = logging.getLogger("kvblocks.server")
    collect = _Collect()
    server_log.addHandler(collect)
    server_log.propagate = False
    try:
        return parse_body(raw, content_type, model, *options), collect.records
    finally:
        server_log.removeHandler(collect)
