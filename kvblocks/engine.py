"""Engine: the one loop that owns the model. Requests queue up; the loop interleaves them fairly.

Every forward pass runs on the engine thread, so two requests never race on the model. Each
cycle the scheduler picks the requests to advance (today: every active request, one step each,
round-robin); `_step` advances one request. Batching several requests into one forward would
replace `_step` over a batch without changing how requests enter or leave.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvblocks.generator import CachedGenerator, Piece
from kvblocks.metrics import CacheCollector, Metrics


@dataclass(eq=False)
class Request:
    """One queued generation. `emit` is called on the engine thread with each Piece, or an Exception."""

    prompt: object
    options: dict
    emit: Callable[[Piece | BaseException], None]
    id: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    stream: Iterator[Piece] | None = None
    last_token_at: float = 0.0
    tokens: int = 0  # prompt ids plus tokens generated so far (the request's KV footprint)


@dataclass(frozen=True, slots=True)
class Load:
    """What the engine holds right now, as routers ask for it (`/get_load`)."""

    running: int
    waiting: int
    tokens: int  # prompt plus generated tokens of the running and waiting requests


class Engine:
    def __init__(
        self, generator: CachedGenerator, metrics: Metrics | None = None, max_active: int = 64
    ) -> None:
        self.generator = generator
        self.metrics = metrics or Metrics()
        if generator.cache is not None:
            self.metrics.register(CacheCollector(generator.cache))
        self.max_active = max_active
        self._inbox: queue.Queue[Request] = queue.Queue()
        self._active: list[Request] = []
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvblocks-engine", daemon=True)
        self.stall_s = 30.0
        self._beat = time.monotonic()  # when the loop last completed a step
        self._death: str | None = None

    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    def submit(self, prompt, emit: Callable[[Piece | BaseException], None], **options) -> Request:
        ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        request = Request(prompt, options, emit, id=next(self._ids), tokens=len(prompt) if ids else 0)
        request.emit = _guarded(emit, request)
        self._inbox.put(request)
        return request

    @property
    def queued(self) -> int:
        return self._inbox.qsize()

    @property
    def active(self) -> int:
        return len(self._active)

    def health_problem(self) -> str | None:
        """Why the engine cannot serve right now (its thread died, or it stopped stepping while work
        waits for longer than `stall_s`), or None when it is healthy. Safe from any thread."""
        if self._thread.ident is not None and not self._thread.is_alive() and not self._stop.is_set():
            return f"the engine thread died: {self._death or 'unknown cause'}"
        stalled = time.monotonic() - self._beat
        if stalled > self.stall_s and (self.active or self.queued):
            return f"the engine has not completed a step for {stalled:.0f} s while requests wait"
        return None

    def load(self) -> Load:
        """A snapshot taken from any thread: the engine thread may admit or finish requests meanwhile,
        so the counts are each exact at the moment they are read, not jointly."""
        running = self._running_requests()
        with self._inbox.mutex:
            waiting = self._waiting_requests() + [r for r in self._inbox.queue if r is not None]
        return Load(len(running), len(waiting), sum(r.tokens for r in running + waiting))

    def _running_requests(self) -> list[Request]:
        return list(self._active)

    def _waiting_requests(self) -> list[Request]:
        """Requests taken from the inbox but not running yet (none here: admission is the take)."""
        return []

    # ---- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # reported by health_problem, then re-raised for the thread's hook
            self._death = f"{type(exc).__name__}: {exc}"
            raise

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._beat = time.monotonic()
            self._admit(block=not self._active)
            for request in self._schedule():
                self._step(request)
        for request in list(self._active):  # _finish removes from the list
            self._finish(request)

    def _admit(self, block: bool) -> None:
        while len(self._active) < self.max_active:
            try:
                request = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            if request is None:
                return
            block = False
            if request.cancelled.is_set():  # its client left while it waited
                self.metrics.inc("kvblocks_requests_cancelled_total")
                continue
            request.stream = self.generator.stream(request.prompt, **request.options)
            self._active.append(request)

    def _schedule(self) -> list[Request]:
        """Which requests advance this cycle: all active ones, in arrival order (fair round-robin)."""
        return list(self._active)

    def _step(self, request: Request) -> None:
        if request.cancelled.is_set():
            self.metrics.inc("kvblocks_requests_cancelled_total")
            self._finish(request)
            return
        try:
            piece = next(request.stream)
        except StopIteration:
            self._finish(request)
            return
        except Exception as exc:  # a failed request must not take the loop down; the client gets it
            self.metrics.inc("kvblocks_requests_failed_total")
            self._finish(request)
            request.emit(exc)
            return
        self._observe(request, len(piece.token_ids))
        if piece.result is not None:
            self._finish(request)
            self._record(piece)
        request.emit(piece)

    def _observe(self, request: Request, tokens: int) -> float:
        """Time `tokens` new tokens of `request`: TTFT (queueing included, what the client waits for)
        or the gap since its last token. Returns the time."""
        now = time.perf_counter()
        if request.last_token_at:
            self.metrics.observe("kvblocks_inter_token_seconds", now - request.last_token_at)
        else:
            self.metrics.observe("kvblocks_time_to_first_token_seconds", now - request.submitted)
        request.last_token_at = now
        request.tokens += tokens
        return now

    def _finish(self, request: Request) -> None:
        if request.stream is not None:
            request.stream.close()  # commits computed tokens to the cache and releases trie locks
        if request in self._active:
            self._active.remove(request)

    def _record(self, piece: Piece) -> None:
        r = piece.result
        m = self.metrics
        m.inc("kvblocks_requests_total")
        m.inc("kvblocks_prompt_tokens_total", r.prompt_tokens)
        m.inc("kvblocks_cached_prompt_tokens_total", r.cached_tokens)
        m.inc("kvblocks_generation_tokens_total", len(r.token_ids))
        if r.spec is not None:
            m.inc("kvblocks_spec_drafted_tokens_total", r.spec.drafted)
            m.inc("kvblocks_spec_accepted_tokens_total", r.spec.accepted)
            m.inc("kvblocks_spec_rounds_total", r.spec.rounds)


def _guarded(emit: Callable[[Piece | BaseException], None], request: Request):
    """`emit` as the engine thread calls it: a consumer whose callback raises loses its request
    (cancelled, the traceback on stderr), never the engine thread or the other requests."""

    def call(item: Piece | BaseException) -> None:
        try:
            emit(item)
        except Exception:
            traceback.print_exc()
            request.cancelled.set()

    return call
