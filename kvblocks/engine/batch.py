"""The batched engine: continuous batching of running requests over the shared KV pool.

`BatchEngine` has `Engine`'s interface (submit, load, metrics, start, stop) and the same emitted
pieces, but each loop iteration is one packed forward (`kvblocks.engine.paged`) over every running
request: decode tokens first, then chunks of prefill, under `max_batch_tokens`, for at most
`max_batch_size` requests; a step in which some request can get its first token leaves long
prefills out (head-of-line blocking is then the step in flight plus one short step). A request's
KV is a slot list: its locked cached prefix (the trie's own
slots, never copied) plus slots it reserves for its own tokens. When its prompt is computed, the
prompt's slots pass to the trie (`adopt`, no copy) so requests admitted later hit it; when it ends,
its reply's do. Waiting requests are admitted from the `WaitingRoom` in weighted fair order across
tenants; within a tenant's first few, longest cached prefix first, except that one passed over
`max_wait_steps` times goes first, and only while the pool has room for the uncached prompt plus a
watermark. When the pool runs out of slots, the youngest other running
request is preempted: its private slots are freed, it keeps its sampling and text state and resumes
later by prefilling what it had (mostly a cache hit of its own prompt).

With a `SpeculativeGenerator`, a request's prompt is prefilled up to its last token and each later
step is a draft/verify round: the drafter proposes (its own session, as on the one-request path),
the last token and the drafts are one multi-token segment of the packed forward with every row's
logits kept, `verify` accepts a prefix of them, and the rejected drafts' slots go back (rollback is
a shorter slot list). Same drafts, same rng order, same tokens as the one-request path.

Requests the packed path does not serve (prompt log-probabilities, prompts too large for the pool)
run as in `Engine`: one `CachedGenerator.stream` step per loop iteration, between the packed
forwards.

Every phase is guarded per request (`_fail_sequence`): a fault in admission, scheduling, sampling or
committing fails its own request; a failed packed forward is rerun one request at a time so that
only the request that cannot run fails; a failed prefix lookup is a miss (`match_or_miss`).
"""

from __future__ import annotations

import itertools
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvblocks.cache.radix import common_prefix_len
from kvblocks.cache.trie import Hit, PoolFullError
from kvblocks.engine import paged
from kvblocks.engine.admission import LimitsOf, RoomLimits, no_limits
from kvblocks.engine.loop import Engine, EngineError, Request, trace_admitted, trace_ended
from kvblocks.generate.generator import CachedGenerator, GenerationResult, Piece
from kvblocks.generate.params import GenerationParams
from kvblocks.generate.sampling import LogitsProcessor, choose, distribution, token_logprobs
from kvblocks.generate.text import StopTextAssembler
from kvblocks.specdec.generator import SpecStats, SpeculativeGenerator
from kvblocks.specdec.rejection import verify
from kvblocks.telemetry import tracing
from kvblocks.telemetry.metrics import Metrics

CHUNK = 64  # batch-invariant mode cuts prompts at every multiple of this many positions
LOOK = 32  # waiting requests per tenant that admission considers each step (never the whole line)
SERIAL = object()  # Request.prepared of a request on the one-request path
DEFERRED = object()  # admission stopped: the pool lacks room for the next request in fair order


def check_settings(
    max_batch_size: int,
    max_batch_tokens: int,
    invariant: bool,
    chunk: int = CHUNK,
    names: tuple[str, str] = ("max_batch_size", "max_batch_tokens"),
) -> None:
    """ValueError naming what is wrong with a batch size and token budget, under `names` (`kvblocks
    serve` checks its flags here before it loads the model)."""
    size, tokens = names
    if max_batch_size < 1 or max_batch_tokens < max_batch_size:
        raise ValueError(
            f"need {size} >= 1 and {tokens} >= {size}, got {max_batch_size} and {max_batch_tokens}"
        )
    if invariant and max_batch_tokens < max_batch_size + chunk:
        raise ValueError(
            f"batch-invariant batching cuts prompts every {chunk} tokens, so it needs {tokens} >= "
            f"{size} + {chunk}, got {max_batch_tokens} with {size} {max_batch_size}"
        )


@dataclass(eq=False)
class Sequence:
    """A request on the packed path: its tokens, its KV slots and its output state."""

    request: Request
    ids: list[int]
    params: GenerationParams
    salt: Any
    max_new_tokens: int
    text: StopTextAssembler
    rng: Any
    processor: LogitsProcessor | None
    cached_tokens: int = 0
    sequence: list[int] = field(default_factory=list)  # prompt + generated
    hit: Hit | None = None  # the locked resident prefix: slots[:start] are the trie's
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    start: int = 0  # slots from here on are this request's own (reserved)
    computed: int = 0  # positions of `sequence` whose KV is in `slots`
    generated: list[int] = field(default_factory=list)
    logprobs: list | None = None
    committed_prompt: bool = False
    admitted_at: int = 0
    waited: int = 0
    ttft_s: float = 0.0
    started: bool = False
    draft: Any = None  # speculative decoding: the request's DraftSession
    spec: Any = None  # its SpecStats
    gamma: int = 0
    proposal: tuple = ()  # this step's (drafts, q, tail_q), verified after the forward
    held_back: int = 0  # steps in a row this long prefill sat out for a request's first token


@dataclass(slots=True)
class _AdmissionStep:
    """What one admission pass has learnt: free slots left, cached lengths, requests looked at."""

    available: int
    counted_evictable: bool = False
    cached: dict[int, int] = field(default_factory=dict)
    seen: dict[int, Sequence] = field(default_factory=dict)


class BatchEngine(Engine):
    """`Engine` with packed forwards; the requests on the one-request path are `Engine`'s `_active`."""

    def __init__(
        self,
        generator: CachedGenerator,
        metrics: Metrics | None = None,
        max_active: int = 64,
        max_batch_size: int = 16,
        max_batch_tokens: int = 80,
        max_wait_steps: int = 64,
        join_min_tokens: int = 32,
        invariant: bool = False,
        chunk: int = CHUNK,
        watermark: float = 0.01,
        limits: RoomLimits | None = None,
        limits_of: LimitsOf = no_limits,
    ) -> None:
        if generator.cache is None or not paged.supports(generator.model):
            raise ValueError(
                "the batched engine needs a prefix cache and a model kvblocks.engine.paged supports"
            )
        check_settings(max_batch_size, max_batch_tokens, invariant, chunk)
        super().__init__(generator, metrics, max_active, limits, limits_of)
        # plain decoding, or draft/verify rounds as multi-token chunks of the packed forward
        self.speculative = type(generator) is SpeculativeGenerator
        if type(generator) is not CachedGenerator and not self.speculative:
            raise ValueError(
                f"the batched engine runs CachedGenerator or SpeculativeGenerator, not {type(generator)}"
            )
        self.cache = generator.cache
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_steps = max_wait_steps
        self.join_min_tokens = join_min_tokens
        self.watermark = max(1, int(watermark * self.cache.pool.capacity))
        self.invariant = invariant
        self.chunk = chunk
        scratch = self.cache.reserve(paged.MIN_ROWS - 1) if invariant else None  # held for the engine's life
        self.runner = paged.PagedRunner(generator.model, self.cache.pool, invariant, chunk, scratch)
        self._running: list[Sequence] = []
        self._step_no = 0
        self.preemptions = 0
        self.deferred = 0  # admissions put off because the pool lacked room for the prompt
        self.one_at_a_time = 0  # requests that took the one-request path

    # ---- what Engine reports, with the packed path's requests counted in ------------------------

    @property
    def active(self) -> int:
        return len(self._running) + len(self._active)

    def _running_requests(self) -> list[Request]:
        return [s.request for s in list(self._running)] + list(self._active)

    # ---- the loop --------------------------------------------------------------------------------

    def _cycle(self) -> None:
        if not (self._running or self._active):
            self.room.wait(0.5)
        self._admit()
        self._step_packed()
        for request in list(self._active):  # the one-request path: one step each, as in Engine
            self._step(request)

    def _contain(self, exc: Exception) -> None:
        super()._contain(exc)
        for s in list(self._running):
            self._fail_sequence(s, exc, "engine step")

    def _shutdown(self) -> None:
        for s in list(self._running):
            self._drop(s)
        super()._shutdown()

    def _prepared(self, request: Request) -> Sequence | None:
        """`request`'s packed-path state (made once), or None once it went to the one-request path
        or failed (a bad prompt or parameter: the client gets the error)."""
        if request.prepared is None:
            try:
                request.prepared = self._sequence(request) or SERIAL
            except Exception as exc:
                self.room.remove(request.tenant, request)
                self.metrics.inc("kvblocks_requests_failed_total")
                request.emit(exc)
                return None
        if request.prepared is SERIAL:
            if len(self._active) >= self.max_active:
                return None
            self.room.remove(request.tenant, request)
            self._start_serial(request)
            self.one_at_a_time += 1
            return None
        return request.prepared

    def _sequence(self, request: Request) -> Sequence | None:
        """The packed path's state for `request`, or None when it needs the one-request path."""
        options = dict(request.options)
        params = options.pop("params", None)
        salt = options.pop("salt", None)
        if options:
            return None
        if params is None:
            params = GenerationParams()
        if params.prompt_logprobs is not None:
            return None
        ids, max_new, rng, text, processor = self.generator.prepare(request.prompt, params)
        gamma = self.generator.max_gamma if self.speculative else 0
        if len(ids) + max_new + gamma > self.cache.pool.capacity - self.cache.pinned_tokens:
            return None  # it cannot fit in the pool beside the pinned prefixes: its own DynamicCache
        s = Sequence(
            request,
            ids,
            params,
            salt,
            max_new,
            text,
            rng,
            processor,
            sequence=list(ids),
            logprobs=None if params.logprobs is None else [],
        )
        if self.speculative:
            s.draft = self.generator.drafter.start(ids, salt)
            s.gamma = self.generator.gamma
            s.spec = SpecStats(s.gamma)
        return s

    # ---- admission ------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Tenants in fair order (`WaitingRoom.fair_order`); within a tenant's first `LOOK` waiting
        requests, one passed over `max_wait_steps` times goes first, then the longest cached prefix.
        A request is admitted only while the pool can take its uncached prompt plus `watermark` of
        the capacity (or when nothing runs); what the replies grow into later, preemption handles."""
        running = Counter(r.tenant for r in self._running_requests())
        step = _AdmissionStep(self.cache.pool.num_free)
        done: set[str] = set()
        while len(self._running) < min(self.max_batch_size, self.max_active):
            order = self.room.fair_order(running, done)
            if not order:
                break
            tenant = order[0]
            s = self._admit_from(tenant, step)
            if s is None:
                done.add(tenant)
            elif s is DEFERRED:
                break
            else:
                running[tenant] += 1
        for s in step.seen.values():
            if s not in self._running:
                s.waited += 1

    def _admit_from(self, tenant: str, step: _AdmissionStep):
        """Admit one waiting request of `tenant`: the Sequence, None when none of its first ones can
        start this step, or DEFERRED when the pool lacks room (nobody else jumps ahead then)."""
        candidates = []
        for request in self.room.heads(tenant, LOOK):
            s = self._prepared(request)
            if s is not None:
                candidates.append(s)
                step.seen[id(s)] = s
        for s in list(candidates):
            if id(s) in step.cached:
                continue
            try:
                step.cached[id(s)] = self.cache.cached_length(s.sequence, salt=s.salt)
            except Exception as exc:  # e.g. a namespace that cannot be keyed: this request only
                self.room.remove(tenant, s.request)
                candidates.remove(s)
                self._fail_sequence(s, exc, "admission")
        starved = [s for s in candidates if s.waited >= self.max_wait_steps]
        rest = sorted(
            (s for s in candidates if s.waited < self.max_wait_steps), key=lambda s: -step.cached[id(s)]
        )
        for s in starved + rest:
            cached = step.cached[id(s)]
            if s.waited < self.max_wait_steps and self._joins(s, cached):
                continue
            need = len(s.sequence) - cached + self.watermark
            if need > step.available and not step.counted_evictable:  # a tree walk, only when short
                step.available += self.cache.evictable_tokens()
                step.counted_evictable = True
            if need > step.available and self._running:  # admitted now, it would only preempt someone
                self.deferred += 1
                return DEFERRED
            self.room.remove(tenant, s.request)
            trace_admitted(s.request)
            try:
                with tracing.current(s.request.spans.get("prefill")):  # the lookup's span nests here
                    self._lock_prefix(s)
            except Exception as exc:
                self._fail_sequence(s, exc, "admission")
                continue
            step.available -= need - self.watermark
            s.admitted_at = self._step_no
            self._running.append(s)
            return s
        return None

    def _joins(self, s: Sequence, cached: int) -> bool:
        """Whether `s` waits for a running request that is computing a prompt `s` shares beyond what
        is cached (at least `join_min_tokens` more): once that prompt is committed, `s` hits it
        instead of computing it a second time."""
        ids = np.asarray(s.sequence)
        return any(
            common_prefix_len(np.asarray(r.ids), ids) - cached >= self.join_min_tokens
            for r in self._running
            if not r.committed_prompt and r.salt == s.salt
        )

    def _lock_prefix(self, s: Sequence) -> None:
        s.hit = self.cache.match_or_miss(s.sequence, salt=s.salt)
        if not s.started:
            s.cached_tokens = s.hit.length
            s.started = True
        s.slots = s.hit.slots.copy()
        s.start = s.computed = s.hit.length

    # ---- one packed forward ------------------------------------------------------------------------

    def _step_packed(self) -> None:
        """Schedule this step's tokens, run them as one packed forward, then emit what they yield."""
        self._step_no += 1
        for s in list(self._running):
            if s.request.cancelled.is_set():
                self.metrics.inc("kvblocks_requests_cancelled_total")
                self._drop(s)
        batch = self._schedule_batch()
        if not batch:
            return
        segments = [self._segments(s, n) for s, n in batch]
        outputs = self._forward(batch, segments)
        for (s, n), logits in zip(batch, outputs):
            if logits is None or s not in self._running:
                continue
            try:
                self._postprocess(s, n, logits)
            except Exception as exc:
                self._fail_sequence(s, exc, "sampling")

    def _schedule_batch(self) -> list[tuple[Sequence, int]]:
        """(request, tokens it feeds) for this step, under the token budget."""
        budget = self.max_batch_tokens
        batch: list[tuple[Sequence, int]] = []
        # decodes first (one token each), then prefills, fewest tokens left first: a short prompt is not
        # held behind a long one, which takes what budget is left every step
        order = sorted(self._running, key=lambda s: (len(s.sequence) - s.computed, s.admitted_at))
        # a request whose first token is one short step away gets that step without long prefills in
        # it (a long prefill sits out at most max_wait_steps steps in a row): head-of-line blocking
        # is then at most what remains of the step in flight
        urgent = any(not r.generated and 0 < len(r.sequence) - r.computed <= self.chunk for r in order)
        for s in order:
            long = len(s.sequence) - s.computed > self.chunk
            if urgent and long and s.held_back < self.max_wait_steps:
                s.held_back += 1
                continue
            if s not in self._running:  # preempted for an earlier one's slots
                continue
            try:
                take = self._plan(s, budget, batch)
            except Exception as exc:
                self._fail_sequence(s, exc, "scheduling")
                continue
            if take > 0:
                batch.append((s, take))
                budget -= take
        return batch

    def _plan(self, s: Sequence, budget: int, batch: list[tuple[Sequence, int]]) -> int:
        """Tokens `s` feeds this step with its slots reserved (and its drafts proposed); 0: none."""
        take = self._take_tokens(s, budget)
        if take <= 0:
            return 0
        s.held_back = 0
        if s.draft is not None and take == len(s.sequence) - s.computed:  # a draft/verify round
            room = min(s.gamma, budget - take)
            if not self._reserve(s, take + room, batch):  # slots first: drafting consumes the rng
                return 0
            take += self._propose(s, room)
            if len(s.slots) > s.computed + take:  # fewer drafts than room
                self.cache.release_slots(s.slots[s.computed + take :])
                s.slots = s.slots[: s.computed + take]
            return take
        return take if self._reserve(s, take, batch) else 0

    def _segments(self, s: Sequence, n: int) -> list[paged.Segment]:
        """The packed forward's segments for `n` tokens of `s`; the last one's logits are its output."""
        if s.proposal:  # the last token and the drafts, every row's logits kept for verification
            tokens = s.sequence + s.proposal[0]
            return [paged.Segment(tokens[s.computed :], s.slots[: s.computed + n], keep=n)]
        ends = (
            paged.chunk_ends(s.computed, s.computed + n, self.chunk) if self.invariant else [s.computed + n]
        )
        segments, begin = [], s.computed
        for end in ends:  # a request's later pieces read the K/V its earlier ones write
            segments.append(paged.Segment(s.sequence[begin:end], s.slots[:end]))
            begin = end
        return segments

    def _forward(self, batch: list[tuple[Sequence, int]], segments: list[list[paged.Segment]]) -> list:
        """Each request's output logits. When the packed forward fails, each request is run alone so
        the fault fails only the request it belongs to (None in its place); the others go on."""
        try:
            outputs = self.runner.forward([seg for group in segments for seg in group])
        except Exception as exc:
            if len(batch) == 1:
                self._fail_sequence(batch[0][0], exc, "forward")
                return [None]
            return [self._forward_alone(s, group) for (s, _), group in zip(batch, segments)]
        ends = list(itertools.accumulate(len(group) for group in segments))
        return [outputs[end - 1] for end in ends]

    def _forward_alone(self, s: Sequence, segments: list[paged.Segment]):
        try:
            return self.runner.forward(segments)[-1]
        except Exception as exc:
            self._fail_sequence(s, exc, "forward")
            return None

    def _postprocess(self, s: Sequence, n: int, logits) -> None:
        if s.proposal:
            self._verify(s, logits)
            return
        s.computed += n
        if s.computed == len(s.sequence):
            self._next_token(s, logits[-1])

    def _fail_sequence(self, s: Sequence, exc: BaseException, phase: str) -> None:
        """`s` ends with an error naming `phase` (its traceback on stderr); its slots and lock go back."""
        traceback.print_exception(exc)
        self.metrics.inc("kvblocks_requests_failed_total")
        self._drop(s)
        s.request.emit(EngineError(phase, exc))

    def _take_tokens(self, s: Sequence, budget: int) -> int:
        """How many of `s`'s uncomputed tokens this step takes: as many as the budget allows, or in
        batch-invariant mode up to the last of its prompt's fixed cuts the budget reaches."""
        left = len(s.sequence) - s.computed
        if s.draft is not None and left > 1:  # prefill stops before the last token: rounds feed it
            left -= 1
        if not self.invariant or left <= budget:
            return min(left, budget)
        reachable = [
            e for e in paged.chunk_ends(s.computed, len(s.sequence), self.chunk) if e - s.computed <= budget
        ]
        return reachable[-1] - s.computed if reachable else 0

    def _propose(self, s: Sequence, room: int) -> int:
        """Draft this round's tokens for speculative `s` (at most `room`); returns how many."""
        drafts, q, tail_q = self.generator.propose(s.draft, s.sequence, room, s.params.sampling, s.rng)
        s.proposal = (drafts, q, tail_q)
        return len(drafts)

    def _verify(self, s: Sequence, logits) -> None:
        """Accept a prefix of the drafts and one token of the target's; the rejected drafts' slots go
        back (rollback = a shorter slot list). Tokens are emitted one by one, as decoded ones are."""
        drafts, q, tail_q = s.proposal
        s.proposal = ()
        sampling = s.params.sampling
        n, token = verify(distribution(logits, sampling), drafts, q, sampling.greedy, s.rng, tail_q=tail_q)
        s.computed += 1 + n  # the fed token and the accepted drafts hold KV now
        if len(s.slots) > s.computed:
            self.cache.release_slots(s.slots[s.computed :])
            s.slots = s.slots[: s.computed]
        s.draft.rollback(len(s.sequence) + n)
        s.spec.record(len(drafts), n)
        s.gamma = self.generator.next_gamma(s.gamma, len(drafts), n)
        for t, row in zip([*drafts[:n], token], logits):
            if self._accept(s, t, row):
                return

    def _reserve(self, s: Sequence, n: int, batch: list[tuple[Sequence, int]]) -> bool:
        """Slots for `n` more positions of `s`; preempts the youngest other running request (not one
        already in this batch) while the pool is full. False when nothing can make room."""
        need = s.computed + n - len(s.slots)
        while need > 0:
            try:
                s.slots = np.concatenate([s.slots, self.cache.reserve(need)])
                return True
            except PoolFullError:
                taken = {id(t) for t, _ in batch}
                victims = [t for t in self._running if t is not s and id(t) not in taken]
                if not victims:
                    if not batch and len(self._running) == 1:  # alone, and pins fill the rest
                        self._drop(s)
                        self.metrics.inc("kvblocks_requests_failed_total")
                        s.request.emit(PoolFullError("the KV pool is full of pinned prefixes"))
                    return False
                self._preempt(max(victims, key=lambda t: t.admitted_at))
        return True

    def _preempt(self, s: Sequence) -> None:
        """Free `s`'s own slots and lock; it waits again, first in its tenant's line, with its output
        state, and resumes later."""
        self.preemptions += 1
        self._release(s)
        self._running.remove(s)
        s.computed = 0
        self.room.put_front(s.request.tenant, s.request)

    def _release(self, s: Sequence) -> None:
        if len(s.slots) > s.start:
            self.cache.release_slots(s.slots[s.start :])
        s.slots = s.slots[: s.start]
        if s.hit is not None:
            s.hit.release()
            s.hit = None

    # ---- tokens and pieces ----------------------------------------------------------------------

    def _next_token(self, s: Sequence, logits) -> None:
        row = logits if s.processor is None else s.processor(logits)
        token = choose(row, s.params.sampling, s.rng)
        if s.processor is not None:
            s.processor.accept(token)
        self._accept(s, token, logits)

    def _accept(self, s: Sequence, token: int, logits) -> bool:
        """Append `token` (chosen from `logits`), emit its piece; True when it ends the request."""
        request = s.request
        params = s.params
        now = self._observe(request, 1)
        if not s.generated:
            s.ttft_s = now - request.submitted
            self._commit_prompt(s)
        s.generated.append(token)
        s.sequence.append(token)
        logprobs = None
        if s.logprobs is not None:
            logprobs = token_logprobs(logits[None], [token], params.logprobs)
            s.logprobs.extend(logprobs)
        finish = None
        pending = ""
        if token in self.generator.eos_ids and not params.ignore_eos:
            finish = "stop"
        else:
            pending = s.text.push(token, may_stop=len(s.generated) > params.min_tokens)
            if s.text.stopped or (s.processor is not None and s.processor.done):
                finish = "stop"
            elif len(s.generated) >= s.max_new_tokens:
                finish = "length"
        if finish is None:
            request.emit(Piece(pending, [token], logprobs=logprobs))
            return False
        self._complete(s)
        result = GenerationResult(
            token_ids=s.generated,
            text=s.text.text,
            prompt_tokens=len(s.ids),
            cached_tokens=s.cached_tokens,
            ttft_s=s.ttft_s,
            total_s=now - request.submitted,
            finish_reason=finish,
            prompt_ids=s.ids,
            logprobs=s.logprobs,
            spec=s.spec,
        )
        piece = Piece(pending + s.text.flush(), [token], result, logprobs=logprobs)
        self._record(request, piece)
        request.emit(piece)
        return True

    def _commit_prompt(self, s: Sequence) -> None:
        """The prompt's slots pass to the trie as soon as it is computed; the request keeps them
        locked (a fresh lock over the whole prompt: the trie's slots from now on, which are other
        slots where another request stored the same tokens meanwhile)."""
        if s.committed_prompt:
            return
        s.committed_prompt = True
        n = min(s.computed, len(s.sequence))
        beyond = s.slots[n:]  # a speculative round's accepted drafts: still the request's own
        self.cache.adopt(s.sequence[:n], s.slots[:n], s.start, salt=s.salt)
        held = self.cache.hold(s.sequence[:n], salt=s.salt)
        s.hit.release()
        s.hit = held
        s.slots = np.concatenate([held.slots, beyond])
        s.start = len(held.slots)

    def _complete(self, s: Sequence) -> None:
        """The computed tokens (prompt and reply, not the last sampled one) pass to the trie."""
        self._running.remove(s)
        n = min(s.computed, len(s.sequence))
        kept = max(n, s.start)
        if len(s.slots) > kept:  # KV of drafts accepted past the token that ended it
            self.cache.release_slots(s.slots[kept:])
            s.slots = s.slots[:kept]
        if n > s.start:
            self.cache.adopt(s.sequence[:n], s.slots[:n], s.start, salt=s.salt)
            s.slots = s.slots[: s.start]  # all passed to the trie
        self._release(s)
        if s.draft is not None:
            s.draft.end(s.sequence)

    def _drop(self, s: Sequence) -> None:
        """A cancelled or failed request: its own slots go back, its lock is released."""
        if s in self._running:
            self._running.remove(s)
        self._release(s)
        trace_ended(s.request, outcome="ended")
        if s.draft is not None:
            s.draft.end(s.sequence)
