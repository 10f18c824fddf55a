"""The serial runner: one `CachedGenerator.stream` step per request per loop step.

It serves every request of an engine without a packed path, and the requests the packed path does
not serve (prompt log-probabilities, raw logits, prompts too large for the pool, KV blocks stored
ahead of use: `CachedGenerator.store_steps`, whose one answer is a `StoredBlock`). Each stream
holds its own transformers cache and commits to the trie itself when it closes, except where
`shares_kv` is False: the batch-invariant engine (`BatchEngine`), where these kernels round
otherwise than the packed forwards (in half precision, and in float32 where the BLAS picks other
kernels by shape) and a prefix they stored would change the bits of a later packed request on it;
there a serial request reads the trie's prefixes but keeps its KV.

A prompt's KV block work (fills, blend probe and recompute: `kvblocks.blocks.prefill`) runs one
forward of at most `block_chunk` tokens (the engine's per-step budget) per step, before its first
token, so one request's blocks never hold the loop for more than a step's worth of tokens; the
tokens are charged to its tenant (`charge`: the engine's `TenantLedger`, which the fair order reads).

With `cut` (the batched engine on a CPU, where a step's time grows with its rows and whoever arrives
waits for the step in flight), all of a prompt's work, its plain prefill included, runs in forwards
of at most `cut` tokens, and while `contended(tenant)` (another tenant with work was served less)
one such forward a step for all of that tenant's requests together, none where the tenant's prompt
work had its cut of the step's packed batch (`prompted`): the other tenant's next token waits for
one short forward, not for a step's worth per request. The forwards depend on the request alone,
never on the contention, so its bits do not either.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from kvblocks.blocks.report import StoredBlock
from kvblocks.engine.admission import WaitingRoom
from kvblocks.engine.report import Reporter, trace_admitted, trace_ended
from kvblocks.engine.request import EngineError, Request
from kvblocks.generate.generator import CachedGenerator, Working
from kvblocks.telemetry import tracing

if TYPE_CHECKING:
    from kvblocks.blocks.segments import Block


class SerialRunner:
    def __init__(
        self,
        generator: CachedGenerator,
        report: Reporter,
        max_active: int,
        block_chunk: int,
        charge: Callable[[str, float], None],
    ) -> None:
        self.generator = generator
        self.report = report
        self.max_active = max_active
        self.block_chunk = block_chunk
        self.charge = charge  # (tenant, tokens) of KV block work computed for it
        self.active: list[Request] = []
        self.shares_kv = True  # whether the KV its streams compute enters the trie
        self.cut: int | None = None  # the width of every prompt forward (None: `block_chunk`, blocks only)
        self.contended: Callable[[str], bool] = lambda tenant: False  # see the module's docstring
        self.prompting: set[Request] = set()  # requests whose next step is prompt work
        # tenants whose prompt work already ran in this loop step's other forwards (the packed batch)
        self.prompted: Callable[[], set[str]] = set

    def has_room(self) -> bool:
        return len(self.active) < self.max_active

    def admit(self, room: WaitingRoom) -> None:
        """Start waiting requests while there is room, each the head of the least served tenant's line."""
        while self.has_room():
            request = self._next_waiting(room)
            if request is None:
                return
            room.remove(request.tenant, request)
            self.start(request)

    def _next_waiting(self, room: WaitingRoom) -> Request | None:
        running = Counter(r.tenant for r in self.active)
        for tenant in room.fair_order(running):
            heads = room.heads(tenant, 1)
            if heads:
                return heads[0]
        return None

    def start(self, request: Request) -> None:
        """Its stream starts on the next `step` (its errors surface there)."""
        trace_admitted(request)
        o = request.options
        chunk = self.cut or self.block_chunk
        if o.store_block:  # the block routes queue a block's text or ids (`BlockRequest`)
            block = cast("Block | str | Sequence[int]", request.prompt)
            request.stream = self.generator.store_steps(block, o.salt, chunk)
        else:
            own: dict[str, Any] = (
                {} if self.shares_kv else {"share_kv": False}
            )  # a generator of its own may not take it
            if self.cut is not None:
                own["prompt_chunk"] = self.cut
            request.stream = self.generator.stream(
                request.prompt, o.params, salt=o.salt, output_logits=o.output_logits, block_chunk=chunk, **own
            )
        self.active.append(request)
        self.prompting.add(request)

    def step(self) -> None:
        """A stream step of each request; with `cut`, a tenant's prompt work is one forward of the
        step while it is `contended`, whatever its number of requests (the first in line goes)."""
        worked = set(self.prompted())  # tenants whose prompt work ran a forward this step
        for request in list(self.active):
            if request in self.prompting and request.tenant in worked and self.contended(request.tenant):
                continue
            self._advance(request, worked)

    def _advance(self, request: Request, worked: set[str]) -> None:
        if request.cancelled.is_set():
            self.report.cancelled()
            self.finish(request)
            return
        assert request.stream is not None, "`start` gave it its stream; `finish` takes it from the active"
        try:
            with tracing.current(request.spans.get("prefill")):  # the lookup nests under the prefill
                piece = next(request.stream)
        except StopIteration:
            self.finish(request)
            return
        except Exception as exc:  # a failed request must not take the loop down; the client gets it
            self.report.failed()
            self.finish(request)
            request.emit(exc)
            return
        if request in self.prompting:
            worked.add(request.tenant)
        if isinstance(piece, Working):  # a forward of prompt work: nothing to say to the client yet
            self.charge(request.tenant, piece.tokens)
            return
        self.prompting.discard(request)  # its last prompt forward gave this piece
        if isinstance(piece, StoredBlock):  # a block stored ahead of use: its one answer
            self.report.metrics.inc("kvblocks_block_fill_tokens_total", piece.tokens - piece.held)
            self.finish(request)
            request.emit(piece)
            return
        self.report.observe(request, len(piece.token_ids))
        if piece.result is not None:
            self.report.record(request, piece.result)
            self.finish(request)
        request.emit(piece)

    def fail(self, request: Request, exc: BaseException, phase: str) -> None:
        """`request` ends with an error naming `phase`; whatever it held goes back."""
        self.report.failed()
        self.finish(request)
        request.emit(EngineError(phase, exc))

    def finish(self, request: Request) -> None:
        """Close its stream (which commits its tokens and releases its locks), then forget it: in this
        order, so that a request no longer active holds nothing."""
        if request.stream is not None:
            stream, request.stream = request.stream, None
            try:
                stream.close()
            except Exception:  # the commit failed: the reply stands, the cache does without it
                traceback.print_exc()
                self.report.metrics.inc("kvblocks_engine_errors_total")
        if request in self.active:
            self.active.remove(request)
        self.prompting.discard(request)
        trace_ended(request, outcome="ended")  # spans a result did not close: cancelled or failed
