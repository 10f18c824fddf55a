"""Engine: the one loop that owns the model. Requests queue up; the loop interleaves them fairly.

Every forward pass runs on the engine thread, so two requests never race on the model. Submitted
requests wait in the `WaitingRoom` (bounded per tenant and in total; a full room refuses with
`QueueFullError`); each cycle admits from it in weighted fair order across tenants, then advances
every active request one step (`_step`). `BatchEngine` keeps this loop and admission and replaces
the steps with packed forwards.

A fault stays where it happened: an exception while serving one request fails that request (the
client gets an `EngineError` naming the phase), and one outside any request fails the requests of
that cycle; neither stops the thread. `health_problem` says when the thread died or stalled anyway.
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvblocks.engine.admission import LimitsOf, QueueFullError, RoomLimits, WaitingRoom, no_limits
from kvblocks.generate.generator import CachedGenerator, Piece
from kvblocks.telemetry import tracing
from kvblocks.telemetry.metrics import CacheCollector, Metrics

__all__ = ["Engine", "EngineError", "Load", "QueueFullError", "Request"]


class EngineError(RuntimeError):
    """What a request's client receives when the engine failed it: the phase and the cause."""

    def __init__(self, phase: str, cause: BaseException) -> None:
        super().__init__(f"{phase} failed: {type(cause).__name__}: {cause}")
        self.phase = phase


@dataclass(eq=False)
class Request:
    """One queued generation. `emit` is called on the engine thread with each Piece, or an Exception."""

    prompt: object
    options: dict
    emit: Callable[[Piece | BaseException], None]
    id: int = 0
    tenant: str = ""
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    stream: Iterator[Piece] | None = None
    last_token_at: float = 0.0
    tokens: int = 0  # prompt ids plus tokens generated so far (the request's KV footprint)
    prepared: Any = None  # the batched engine's state for it, made once at its first admission
    spans: dict = field(default_factory=dict)  # its open trace spans by phase (tracing on only)


@dataclass(frozen=True, slots=True)
class Load:
    """What the engine holds right now, as routers ask for it (`/get_load`)."""

    running: int
    waiting: int
    tokens: int  # prompt plus generated tokens of the running and waiting requests


class Engine:
    def __init__(
        self,
        generator: CachedGenerator,
        metrics: Metrics | None = None,
        max_active: int = 64,
        limits: RoomLimits | None = None,
        limits_of: LimitsOf = no_limits,
    ) -> None:
        self.generator = generator
        self.metrics = metrics or Metrics()
        if generator.cache is not None:
            self.metrics.register(CacheCollector(generator.cache))
        self.max_active = max_active
        self.room = WaitingRoom(
            limits, limits_of, lambda: self.metrics.inc("kvblocks_requests_cancelled_total")
        )
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
        self.room.wake()
        self._thread.join(timeout)

    def submit(self, prompt, emit: Callable[[Piece | BaseException], None], *, tenant: str = "", **options):
        """Queue one request; QueueFullError when its tenant's line or the room is full."""
        return self.submit_all([(prompt, emit, options)], tenant=tenant)[0]

    def submit_all(
        self, items: Iterable[tuple[object, Callable[[Piece | BaseException], None], dict]], tenant: str = ""
    ) -> list[Request]:
        """Queue several requests of one tenant together, or none (QueueFullError): the branches of
        one HTTP request are refused as a whole, never half admitted."""
        requests = []
        for prompt, emit, options in items:
            ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
            request = Request(
                prompt, options, emit, next(self._ids), tenant, tokens=len(prompt) if ids else 0
            )
            request.emit = _guarded(emit, request)
            trace_submitted(request)
            requests.append(request)
        try:
            self.room.put_all(tenant, requests)
        except QueueFullError:
            self.metrics.inc("kvblocks_requests_rejected_total", len(requests))
            for request in requests:
                trace_ended(request, outcome="rejected")
            raise
        return requests

    @property
    def queued(self) -> int:
        return len(self.room)

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
        waiting = self.room.items()
        return Load(len(running), len(waiting), sum(r.tokens for r in running + waiting))

    def _running_requests(self) -> list[Request]:
        return list(self._active)

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
            try:
                self._cycle()
            except Exception as exc:  # a fault outside every per-request guard: a bug, contained
                self._contain(exc)
        self._shutdown()

    def _cycle(self) -> None:
        if not self._active:
            self.room.wait(0.5)
        self._admit()
        for request in list(self._active):
            self._step(request)

    def _contain(self, exc: Exception) -> None:
        """Fail the requests this cycle was serving, keep the thread."""
        traceback.print_exception(exc)
        self.metrics.inc("kvblocks_engine_errors_total")
        for request in list(self._active):
            self._fail(request, exc, "engine step")

    def _shutdown(self) -> None:
        for request in list(self._active):  # _finish removes from the list
            self._finish(request)
        stopping = RuntimeError("the server is shutting down")
        for request in self.room.items():
            request.emit(EngineError("admission", stopping))

    def _next_waiting(self) -> Request | None:
        """The request admission offers next: the head of the least served tenant's line."""
        running = Counter(r.tenant for r in self._running_requests())
        for tenant in self.room.fair_order(running):
            heads = self.room.heads(tenant, 1)
            if heads:
                return heads[0]
        return None

    def _admit(self) -> None:
        while len(self._active) < self.max_active:
            request = self._next_waiting()
            if request is None:
                return
            self.room.remove(request.tenant, request)
            self._start_serial(request)

    def _start_serial(self, request: Request) -> None:
        """Run `request` one `CachedGenerator.stream` step per cycle (its errors surface in `_step`)."""
        trace_admitted(request)
        request.stream = self.generator.stream(request.prompt, **request.options)
        self._active.append(request)

    def _step(self, request: Request) -> None:
        if request.cancelled.is_set():
            self.metrics.inc("kvblocks_requests_cancelled_total")
            self._finish(request)
            return
        try:
            with tracing.current(request.spans.get("prefill")):  # the lookup nests under the prefill
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
            self._record(request, piece)
            self._finish(request)
        request.emit(piece)

    def _fail(self, request: Request, exc: BaseException, phase: str) -> None:
        """`request` ends with an error naming `phase`; whatever it held goes back."""
        self.metrics.inc("kvblocks_requests_failed_total")
        self._finish(request)
        request.emit(EngineError(phase, exc))

    def _observe(self, request: Request, tokens: int) -> float:
        """Time `tokens` new tokens of `request`: TTFT (queueing included, what the client waits for)
        or the gap since its last token. Returns the time."""
        now = time.perf_counter()
        if request.last_token_at:
            self.metrics.observe("kvblocks_inter_token_seconds", now - request.last_token_at)
        else:
            self.metrics.observe("kvblocks_time_to_first_token_seconds", now - request.submitted)
            trace_first_token(request)
        request.last_token_at = now
        request.tokens += tokens
        return now

    def _finish(self, request: Request) -> None:
        """Close its stream (which commits its tokens and releases its locks), then forget it: in this
        order, so that a request no longer active holds nothing."""
        if request.stream is not None:
            stream, request.stream = request.stream, None
            try:
                stream.close()
            except Exception:  # the commit failed: the reply stands, the cache does without it
                traceback.print_exc()
                self.metrics.inc("kvblocks_engine_errors_total")
        if request in self._active:
            self._active.remove(request)
        trace_ended(request, outcome="ended")  # spans a result did not close: cancelled or failed

    def _record(self, request: Request, piece: Piece) -> None:
        r = piece.result
        m = self.metrics
        m.finished(r.finish_reason, time.perf_counter() - request.submitted)
        m.inc("kvblocks_prompt_tokens_total", r.prompt_tokens)
        m.inc("kvblocks_cached_prompt_tokens_total", r.cached_tokens)
        m.inc("kvblocks_generation_tokens_total", len(r.token_ids))
        if r.spec is not None:
            m.inc("kvblocks_spec_drafted_tokens_total", r.spec.drafted)
            m.inc("kvblocks_spec_accepted_tokens_total", r.spec.accepted)
            m.inc("kvblocks_spec_rounds_total", r.spec.rounds)
        trace_ended(
            request,
            outcome="finished",
            finish_reason=r.finish_reason,
            prompt_tokens=r.prompt_tokens,
            cached_tokens=r.cached_tokens,
            completion_tokens=len(r.token_ids),
        )


# ---- traces (kvblocks.telemetry.tracing; each a no-op while tracing is off) ------------------------------


def trace_submitted(request: Request) -> None:
    if tracing.enabled():
        root = tracing.start("kvblocks.request", request_id=request.id, prompt_tokens=request.tokens or None)
        request.spans = {"request": root, "queue": tracing.start("queue", root)}


def trace_admitted(request: Request) -> None:
    """Out of the queue; the prefill starts (again, after a preemption before its first token)."""
    if request.spans:
        tracing.end(request.spans.pop("queue", None))
        if "decode" not in request.spans and "prefill" not in request.spans:
            request.spans["prefill"] = tracing.start("prefill", request.spans["request"])


def trace_first_token(request: Request) -> None:
    if request.spans and "decode" not in request.spans:
        tracing.end(request.spans.pop("prefill", None))
        root = request.spans["request"]
        request.spans["decode"] = tracing.start("decode", root)
        params = request.options.get("params")
        if params is not None and params.constraint is not None:
            request.spans["constrained"] = tracing.start("constrained_decoding", root)


def trace_ended(request: Request, **attributes) -> None:
    if request.spans:
        for phase in ("queue", "prefill", "constrained", "decode"):
            tracing.end(request.spans.pop(phase, None))
        tracing.end(request.spans.pop("request"), **attributes)


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
