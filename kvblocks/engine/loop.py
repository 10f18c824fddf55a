"""Engine: the one loop that owns the model. Requests queue up; the loop interleaves them fairly.

Every forward pass runs on the engine thread, so two requests never race on the model. Submitted
requests wait in the `WaitingRoom` (bounded per tenant and in total; a full room refuses with
`QueueFullError`). Each step admits from it, then schedules → runs → postprocesses the packed batch
(`Scheduler`, `StepForward`, the per-token rule) and advances the requests on the serial runner
one stream step each. `Engine(generator)` is this loop with the serial runner alone; `BatchEngine`
is the same loop with a packed runner.

A fault stays where it happened: every phase is guarded here (`_fail`, `_contain`). An exception
while serving one request fails that request (the client gets an `EngineError` naming the phase),
and one outside any request fails the requests of that step; neither stops the thread.
`health_problem` says when the thread died or stalled anyway.
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvblocks.blocks.segments import Block, is_segmented
from kvblocks.engine import speculative
from kvblocks.engine.admission import LimitsOf, QueueFullError, RoomLimits, WaitingRoom, no_limits
from kvblocks.engine.intake import SequenceFactory
from kvblocks.engine.ledger import TenantLedger
from kvblocks.engine.model_runner import StepForward
from kvblocks.engine.postprocess import Postprocessor
from kvblocks.engine.promotion import BlockPromotions
from kvblocks.engine.report import Reporter, trace_ended, trace_submitted
from kvblocks.engine.request import Emit, EngineError, Load, Options, Request
from kvblocks.engine.scheduler import Batch, BatchLimits, Failure, Scheduler, Step
from kvblocks.engine.sequence import Sequence
from kvblocks.engine.serial import SerialRunner
from kvblocks.engine.slots import SlotManager
from kvblocks.generate.generator import CachedGenerator
from kvblocks.generate.params import ConstraintError
from kvblocks.generate.text import Prompt
from kvblocks.telemetry.metrics import CacheCollector, Metrics, Seq2SeqCollector

if TYPE_CHECKING:
    import torch

    from kvblocks.blocks.report import StoredBlock
    from kvblocks.generate.decoding import Piece

__all__ = ["Engine", "EngineError", "Load", "QueueFullError", "Request"]


class Engine:
    """The loop; with `packed` (what `BatchEngine` passes) it also runs packed forwards."""

    def __init__(
        self,
        generator: CachedGenerator,
        metrics: Metrics | None = None,
        max_active: int = 64,
        limits: RoomLimits | None = None,
        limits_of: LimitsOf = no_limits,
        *,
        packed: tuple[StepForward, BatchLimits] | None = None,
    ) -> None:
        self.generator = generator
        self.cache = generator.cache
        self.metrics = metrics or Metrics()
        if generator.cache is not None:
            self.metrics.register(CacheCollector(generator.cache))
        seq2seq = getattr(generator, "seq2seq", None)  # an encoder-decoder generator's whole cache
        if seq2seq is not None:
            self.metrics.register(Seq2SeqCollector(seq2seq))
        self.max_active = max_active
        # the work done for each tenant lately: the scheduler charges its steps, other parts of the
        # server (tokenizing, KV block fills) charge theirs with `ledger.charge(tenant, tokens)`
        self.ledger = TenantLedger(lambda tenant: limits_of(tenant).weight)
        self.room = WaitingRoom(
            limits, limits_of, lambda: self.metrics.inc("kvblocks_requests_cancelled_total"), self.ledger
        )
        self.report = Reporter(self.metrics)
        block_chunk = (packed[1] if packed is not None else BatchLimits()).max_batch_tokens
        self.serial = SerialRunner(generator, self.report, max_active, block_chunk, self.ledger.charge)
        self.promotions = BlockPromotions(generator, self.metrics, block_chunk, self.ledger.charge)
        self.runner: StepForward | None = None
        self.scheduler: Scheduler | None = None
        self.intake: SequenceFactory | None = None
        self.rounds = generator if isinstance(generator, speculative.Rounds) else None
        if packed is not None:
            if generator.cache is None:
                raise ValueError("packed forwards need a prefix cache")
            self.runner, batch_limits = packed
            self.slots = SlotManager(generator.cache)
            self.intake = SequenceFactory(
                generator, self.slots, self.rounds, self.room, self.serial, self.report
            )
            self.scheduler = Scheduler(
                self.room, self.slots, batch_limits, self.intake, self.rounds, lambda: len(self.serial.active)
            )
            self.output = Postprocessor(self.report, self.scheduler, self.slots, self.rounds, self.promotions)
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvblocks-engine", daemon=True)
        self.stall_s = 30.0
        self._beat = time.monotonic()  # when the loop last completed a step
        self._death: str | None = None

    # ---- the inbox, from any thread -------------------------------------------------------------

    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.room.wake()
        self._thread.join(timeout)

    def submit(self, prompt: Prompt, emit: Emit, *, tenant: str = "", **options: Any) -> Request:
        """Queue one request; `options` are `CachedGenerator.stream`'s (`params`, `salt`, ...): an
        unknown one is a TypeError here. QueueFullError when its tenant's line or the room is full."""
        return self.submit_all([(prompt, emit, options)], tenant=tenant)[0]

    def submit_all(
        self, items: Iterable[tuple[Prompt, Emit, dict[str, Any]]], tenant: str = ""
    ) -> list[Request]:
        """Queue several requests of one tenant together, or none (QueueFullError): the branches of
        one HTTP request are refused as a whole, never half admitted."""
        requests = []
        for prompt, emit, options in items:
            request = Request(
                prompt, Options.of(**options), emit, next(self._ids), tenant, tokens=_known_tokens(prompt)
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

    def cancel(self, request: Request) -> None:
        request.cancel()

    @property
    def queued(self) -> int:
        return len(self.room)

    @property
    def active(self) -> int:
        return len(self._running) + len(self.serial.active)

    def graph_stats(self) -> dict[str, Any] | None:
        """The packed runner's CUDA-graph counters (`GraphedForwards.stats`); None where its forwards
        replay no graphs (serial engine, CPU, batch-invariant, other attention modes, --no-cuda-graphs)."""
        graphs = self.runner.packed.graphs if self.runner is not None else None
        return graphs.stats() if graphs is not None else None

    def kernel_stats(self) -> dict[str, Any] | None:
        """Whether the packed runner's attention reads short segments' keys in place with the CPU kernel
        (`kvblocks.engine.kernel`), and if not, why; None for the serial engine."""
        if self.runner is None:
            return None
        attention = self.runner.packed.attention
        return {"in_use": attention.direct, "reason": attention.direct_reason}

    @property
    def one_at_a_time(self) -> int:
        """Requests that took the serial path beside a packed one."""
        return self.intake.one_at_a_time if self.intake is not None else 0

    @property
    def _running(self) -> list[Sequence]:
        return self.scheduler.running if self.scheduler is not None else []

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
        return [s.request for s in list(self._running)] + list(self.serial.active)

    # ---- the loop -------------------------------------------------------------------------------

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
                self.step()
            except Exception as exc:  # a fault outside every per-request guard: a bug, contained
                self._contain(exc)
        self._shutdown()

    def step(self) -> None:
        """Admit; schedule → run → postprocess the packed batch; one stream step per serial request."""
        if not self.active and not (len(self.room) == 0 and self.promotions.run_one()):
            self.room.wait(0.5)
        if self.scheduler is not None:  # a lighter tenant's next request, moments away (`Scheduler.hold`)
            tenants, seconds = self.scheduler.hold(r.tenant for r in self.serial.active)
            if seconds > 0:
                self.room.wait_for(tenants, seconds)
        self._admit()
        self._step_packed()
        self.serial.step()

    def _admit(self) -> None:
        if self.scheduler is None:
            self.serial.admit(self.room)
        else:
            self._end(self.scheduler.admit(Counter(r.tenant for r in self._running_requests())))

    def _step_packed(self) -> None:
        if self.runner is None:
            return
        for s in list(self._running):
            if s.request.cancelled.is_set():
                self.report.cancelled()
                self._drop(s)
        step = self._schedule_batch()
        self._end(step.failed)
        start = time.perf_counter()
        outputs = self.runner.run(step.batch)
        seconds = time.perf_counter() - start
        self.ledger.ran(sum(n for _, n in step.batch), seconds)
        if step.batch:
            self._batches().turns.stepped(seconds)
        self._end([out for out in outputs if isinstance(out, Failure)])
        self._postprocess(step.batch, outputs)

    def _schedule_batch(self) -> Step:
        return self._batches().schedule()

    def _batches(self) -> Scheduler:
        """The packed path's scheduler (what only a packed engine's steps reach)."""
        if self.scheduler is None:
            raise RuntimeError("this engine runs no packed forwards")
        return self.scheduler

    # ---- the guard: every phase's faults end here -----------------------------------------------

    def _fail(self, s: Sequence, exc: BaseException, phase: str) -> None:
        """`s` ends with an error naming `phase` (its traceback on stderr, unless the request's own
        constraint gave out: a client error); its slots and lock go back."""
        if not isinstance(exc, ConstraintError):
            traceback.print_exception(exc)
        self.report.failed()
        self._drop(s)
        s.request.emit(EngineError(phase, exc))

    def _end(self, failed: list[Failure]) -> None:
        """The sequences the scheduler or the forward failed: each ends with its error (`_fail`), or,
        where the error is the client's own (`phase` None), with that error as it is."""
        for f in failed:
            if f.phase is not None:
                self._fail(f.sequence, f.error, f.phase)
                continue
            self._drop(f.sequence)
            self.report.failed()
            f.sequence.request.emit(f.error)

    def _contain(self, exc: Exception) -> None:
        """A fault outside any one request: fail the requests this step was serving, keep the thread."""
        traceback.print_exception(exc)
        self.metrics.inc("kvblocks_engine_errors_total")
        for request in list(self.serial.active):
            self.serial.fail(request, exc, "engine step")
        for s in list(self._running):
            self._fail(s, exc, "engine step")

    def _shutdown(self) -> None:
        for s in list(self._running):
            self._drop(s)
        for request in list(self.serial.active):
            self.serial.finish(request)
        stopping = RuntimeError("the server is shutting down")
        for request in self.room.items():
            request.emit(EngineError("admission", stopping))

    def _drop(self, s: Sequence) -> None:
        """A cancelled or failed sequence: its own slots go back, its lock is released."""
        self._batches().remove(s)
        self.slots.release(s)
        trace_ended(s.request, outcome="ended")
        if s.draft is not None:
            s.draft.end(s.sequence)

    # ---- the packed path: postprocessing -------------------------------------------------------

    def _postprocess(self, batch: Batch, outputs: list[torch.Tensor | Failure]) -> None:
        for (s, n), logits in zip(batch, outputs):
            if isinstance(logits, Failure) or s not in self._running:
                continue
            try:
                self.output.advance(s, n, logits)
            except Exception as exc:
                self._fail(s, exc, "sampling")


def _known_tokens(prompt: object) -> int:
    """How many token ids `prompt` holds where it is ids (flat, or id segments and KV blocks), for the
    load a router reads; 0 for text, which is tokenised later."""
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if is_segmented(prompt):
        parts = [p.content if isinstance(p, Block) else p for p in prompt]
        if all(isinstance(p, list | tuple) for p in parts):
            return sum(len(p) for p in parts)
    return 0


def _guarded(emit: Emit, request: Request) -> Emit:
    """`emit` as the engine thread calls it: a consumer whose callback raises loses its request
    (cancelled, the traceback on stderr), never the engine thread or the other requests."""

    def call(item: Piece | StoredBlock | BaseException) -> None:
        try:
            emit(item)
        except Exception:
            traceback.print_exc()
            request.cancelled.set()

    return call
