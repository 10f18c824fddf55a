"""The scheduler: which waiting requests start running, and which tokens each running one feeds.

It knows no tensors. Waiting requests are admitted from the `WaitingRoom` in weighted fair order
across tenants; within a tenant's first `LOOK`, one passed over `max_wait_steps` times goes first,
then the longest cached prefix, and only while the pool has room for the uncached prompt plus a
watermark (`AdmissionPass.can_admit` before `admit_one`). Each step feeds decode tokens first, then chunks of
prefill, fewest tokens left first, under `max_batch_tokens` (`full_batch_tokens` while every batch
place is taken and nobody waits); a step in which some request can get its first token leaves long
prefills out (head-of-line blocking is then the step in flight plus one short step). Tenants share
in tokens: while another tenant has work, a tenant's prefill takes at most its weighted share of a
step, a tenant starts no request beyond its weighted share of the batch places, and a tenant holding
every batch place gives one up to a tenant under its share. On the CPU, where a step's time is mostly
fixed, a lighter tenant's first-token step holds no decode of a tenant twice as busy, and `hold`
says how long the loop waits for a lighter tenant's next request before a step (`Turnarounds`). When the
pool runs out of slots, the busiest tenant's youngest other running request is the preemption
victim: it waits again, first in its tenant's line, and resumes later.

The step flows one way: the loop calls `admit` and `schedule`, which reserve the slots (and
propose the drafts of speculative rounds) through the scheduler's own collaborators and hand back
what failed on the way (`Failure`) for the loop to end; nothing here calls back into the loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass
from enum import Enum

from kvblocks.cache.radix import common_prefix_len
from kvblocks.cache.trie import PoolFullError
from kvblocks.engine import speculative
from kvblocks.engine.admission import WaitingRoom
from kvblocks.engine.ledger import TenantLedger
from kvblocks.engine.report import trace_admitted
from kvblocks.engine.request import Request
from kvblocks.engine.sequence import Sequence
from kvblocks.engine.slots import SlotManager
from kvblocks.engine.turnaround import Turnarounds
from kvblocks.telemetry import tracing

# batch-invariant mode cuts prompts at every multiple of this many positions: the CPU kernel's width
# (`kernel.MAX_WIDTH`), so every prompt row is attended by one kernel, and one cut is a short step
CHUNK = 16
NEAR = 64  # a first token "one short step away": at most this many prompt tokens left (head-of-line rule)
FULL_BATCH_TOKENS = 256  # the server's budget while the batch is full and nobody waits
RECENT_S = 2.0  # a tenant served this lately still has work in `prefill_shares` (see there)
LOOK = 32  # waiting requests per tenant that admission considers each step (never the whole line)

Batch = list[tuple[Sequence, int]]  # (sequence, tokens it feeds) of one step
Sequences = Callable[[Request], Sequence | None]  # a waiting request's packed-path state (`SequenceFactory`)


def chunk_ends(start: int, stop: int, chunk: int) -> list[int]:
    """Where a prompt computed from `start` to `stop` is cut in batch-invariant mode: at every
    multiple of `chunk` and at `stop`, the same cuts whatever `start` is (a query row then always
    reads the same keys, however the budget falls)."""
    return [*range((start // chunk + 1) * chunk, stop, chunk), stop]


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_batch_size: int = 16
    max_batch_tokens: int = 80
    full_batch_tokens: int = 0  # the budget while the batch is full and nobody waits (0 or less: none)
    max_active: int = 64
    max_wait_steps: int = 64
    join_min_tokens: int = 32
    invariant: bool = False
    chunk: int = CHUNK
    watermark: int = 1  # free slots admission keeps beyond a prompt's uncached tokens
    # a tenant's prefill in a step while another tenant waits on that step (`prefill_shares`; 0: none)
    contended_prefill: int = 0


@dataclass(frozen=True, slots=True)
class Failure:
    """A sequence that failed in `phase` (admission, scheduling, forward), handed back for the loop
    to end (the scheduler has already taken its own out of `running`, their slots and lock given
    back). `phase` None: `error` is the client's own, sent as it is."""

    sequence: Sequence
    error: BaseException
    phase: str | None


@dataclass(frozen=True, slots=True)
class Step:
    """What one step feeds (`batch`, under the token budget) and who failed while it was planned."""

    batch: Batch
    failed: list[Failure]


class Admitted(Enum):
    """What admitting from one tenant's line gave."""

    ONE = "one"  # a request of the tenant started running
    NONE = "none"  # none of its first ones can start this step
    DEFERRED = "deferred"  # the pool lacks room for the next in order: nobody else jumps ahead of it


class Scheduler:
    """Its collaborators: the waiting `room`, the `slots` of running sequences, the `sequences`
    factory for waiting requests and the speculative `rounds` (None: one token a step). It calls
    nothing back in the loop: what failed comes back with its results (`Failure`)."""

    def __init__(
        self,
        room: WaitingRoom,
        slots: SlotManager,
        limits: BatchLimits,
        sequences: Sequences,
        rounds: speculative.Rounds | None = None,
        elsewhere: Callable[[], int] = lambda: 0,
        turns: Turnarounds | None = None,
    ) -> None:
        self.room = room
        self.turns = turns or Turnarounds()  # lighter tenants' next requests, which `hold` waits for
        self.elsewhere = elsewhere  # requests running off the packed path (their locks come back)
        self.slots = slots
        self.limits = limits
        self.sequences = sequences
        self.rounds = rounds
        self.failed: list[Failure] = []  # this call's, handed back by `admit` and `schedule`
        self.running: list[Sequence] = []
        self.step_no = 0
        self.deferred = 0  # admissions put off because the pool lacked room for the prompt
        self.preemptions = 0
        self.prompted: set[str] = set()  # tenants with prompt tokens in the last step scheduled
        self.ended: set[str] = set()  # tenants a request of which finished since the last step scheduled

    # ---- admission ------------------------------------------------------------------------------

    def admit(self, running: Counter[str]) -> list[Failure]:
        """Tenants in fair order (`WaitingRoom.fair_order`, `running` counting each tenant's running
        requests); returns the sequences that failed on the way in."""
        admission = AdmissionPass(self)
        done: set[str] = set()
        while True:
            order = self.room.fair_order(running, done, self.places, RECENT_S)
            if not order:
                break
            tenant = order[0]
            if len(self.running) >= self.places and not self._make_place(tenant, running):
                break
            admitted = admission.admit_from(tenant)
            if admitted is Admitted.NONE:
                done.add(tenant)
            elif admitted is Admitted.DEFERRED:
                break
            else:
                running[tenant] += 1
        for s in admission.seen.values():
            if s not in self.running:
                s.waited += 1
        return self._handed_back()

    def _make_place(self, tenant: str, running: Counter[str]) -> bool:
        """With every place taken, preempt a decoding request of the tenant holding the most places
        per unit of weight, when `tenant` would still hold no more per weight than it after the
        swap: a tenant cannot keep the whole batch while another waits (`max_running` or not), and
        two tenants at their shares never take places from each other. Only a request whose prompt
        is committed is taken (it resumes by recomputing just its reply); False: nobody is."""
        weight = self.room.limits_of
        rich = max(self.running, key=lambda s: running[s.request.tenant] / weight(s.request.tenant).weight)
        owner = rich.request.tenant
        if (
            owner == tenant
            or (running[tenant] + 1) / weight(tenant).weight > (running[owner] - 1) / weight(owner).weight
        ):
            return False
        taken = [s for s in self.running if s.request.tenant == owner and s.committed_prompt]
        if not taken:
            return False
        self.preempt(max(taken, key=lambda s: s.admitted_at))
        running[owner] -= 1
        return True

    def admit_one(self, s: Sequence) -> bool:
        """Out of the waiting room into `running`, its cached prefix locked; False when that failed."""
        self.room.remove(s.request.tenant, s.request)
        trace_admitted(s.request)
        try:
            with tracing.current(s.request.spans.get("prefill")):  # the lookup's span nests here
                self.slots.lock_prefix(s)
        except Exception as exc:
            self.fail(s, exc, "admission")
            return False
        s.admitted_at = self.step_no
        self.running.append(s)
        self.turns.arrived(s.request.tenant, s.request.submitted)
        return True

    # ---- one step's tokens ----------------------------------------------------------------------

    def schedule(self) -> Step:
        """(sequence, tokens it feeds) for this step, under the token budget, their slots reserved
        (and drafts proposed); and the sequences that failed on the way."""
        self.step_no += 1
        budget = self.budget()
        batch: Batch = []
        # decodes first (one token each), then prefills, fewest tokens left first: a short prompt is not
        # held behind a long one, which takes what budget is left every step
        order = sorted(self.running, key=lambda s: (s.left, s.admitted_at))
        urgent = first_in_line(order, self.room.ledger)
        # on the CPU a step's time is mostly fixed: a first token's step holds no busier decodes either
        yielding = (
            self.busier_than({urgent}) if urgent is not None and self.limits.contended_prefill else set()
        )
        shares = self.prefill_shares(budget)
        ended, self.ended = self.ended, set()
        if self.limits.contended_prefill > 0 and ended:
            shares |= dict.fromkeys(self.busier_than(ended), 0)
        for s in order:
            if urgent is not None and held_back(s, urgent, self.limits.max_wait_steps, yielding):
                continue
            if s not in self.running:  # preempted for an earlier one's slots
                continue
            tenant, prefill = s.request.tenant, s.left > 1
            allowed = min(budget, shares.get(tenant, budget)) if prefill else budget
            try:
                take = self._planned(s, allowed, batch)
            except Exception as exc:
                self.fail(s, exc, "scheduling")
                continue
            if take > 0:
                batch.append((s, take))
                budget -= take
                if prefill and tenant in shares:
                    shares[tenant] -= take
        for s, take in batch:  # the work of this step, charged to whom it is for
            self.room.ledger.charge(s.request.tenant, take)
        self.prompted = {s.request.tenant for s, _ in batch if not s.generated}
        return Step(batch, self._handed_back())

    def prefill_shares(self, budget: int) -> dict[str, int]:
        """Prefill tokens each tenant may take this step when more than one has prefill to do or
        requests waiting or was served within `RECENT_S`: its weighted share of what the decodes
        leave of `budget` (at least one token), so a tenant flooding with long prompts takes whole
        steps only while nobody else has work. An interactive client's next request comes within
        moments of its last reply, and arrives during the step in flight: that step is bounded too.
        With `contended_prefill` (the CPU default: a step's time grows with its rows), a tenant served
        more (recent work per weight) than one with no prefill in the step takes at most that many
        tokens (one cut): the lighter tenant's next request or token waits for this step, which
        stays a short one. Empty: one tenant alone, no bound."""
        prefilling = {s.request.tenant for s in self.running if s.left > 1}
        tenants = self.room.tenants() | prefilling | self.room.ledger.recent(RECENT_S)
        if len(tenants) < 2:
            return {}
        weights = {t: self.room.limits_of(t).weight for t in tenants}
        left = budget - sum(1 for s in self.running if s.left == 1)
        least = self.limits.chunk if self.limits.invariant else 1  # a cut within reach: progress
        shares = {t: max(least, int(left * w / sum(weights.values()))) for t, w in weights.items()}
        waiting = tenants - prefilling  # no prefill in this step: their next token or request waits on it
        if self.limits.contended_prefill > 0 and waiting:
            usage = {t: self.room.ledger.usage(t) for t in tenants}
            lightest = min(usage[t] for t in waiting)
            cap = max(least, self.limits.contended_prefill)
            shares = {t: min(share, cap) if usage[t] > lightest else share for t, share in shares.items()}
        return shares

    def busier_than(self, ended: set[str]) -> set[str]:
        """The running tenants served at least twice as much (recent work per weight) as the least
        served of `ended`: in the step after that tenant's reply ended they prefill nothing, so the
        step in flight when its next request arrives (an interactive client sends it within moments)
        is a short one. Twice: tenants about as busy never hold each other's prefill back."""
        usage = self.room.ledger.usage
        least = min(usage(t) for t in ended)
        return {s.request.tenant for s in self.running if twice_as_busy(usage(s.request.tenant), least)}

    def finished(self, s: Sequence) -> None:
        """`s` ended with its reply (`remove`, and its tenant's next request is likely moments away)."""
        self.remove(s)
        tenant = s.request.tenant
        self.ended.add(tenant)
        if all(r.request.tenant != tenant for r in self.running):
            self.turns.reply_ended(tenant)

    def hold(self, elsewhere: Iterable[str] = ()) -> tuple[set[str], float]:
        """The tenants whose next request the engine waits for before its next step, and for how
        long (`Turnarounds.due`), with `contended_prefill` on (the CPU, where a step's time is mostly
        fixed): only tenants with nothing running whose every tenant with work, packed or `elsewhere`
        (the serial runner's), is at least twice as busy (`busier_than`'s measure). Nobody has work:
        no hold (an idle engine starts a step the moment a request comes)."""
        busy = {s.request.tenant for s in self.running} | set(elsewhere)
        if self.limits.contended_prefill <= 0 or not busy:
            return set(), 0.0
        usage = self.room.ledger.usage
        least = min(usage(t) for t in busy)
        lighter = [t for t in self.turns.ended if t not in busy and twice_as_busy(least, usage(t))]
        return self.turns.due(lighter)

    def budget(self) -> int:
        """This step's token budget: `max_batch_tokens`, or `full_batch_tokens` when larger and every
        batch place is taken with nobody waiting. Then no request can start before a running one
        ends, so a longer step holds back no first token, and the linear layers run on more rows at
        once (SmolLM2's cost a row falls by a quarter from 80 rows to 256)."""
        limits = self.limits
        full = len(self.running) >= self.places and not len(self.room)
        return max(limits.max_batch_tokens, limits.full_batch_tokens) if full else limits.max_batch_tokens

    @property
    def places(self) -> int:
        """How many requests may run at once (admission fills them; a full batch has none free)."""
        return min(self.limits.max_batch_size, self.limits.max_active)

    def _planned(self, s: Sequence, budget: int, batch: Batch) -> int:
        """Tokens `s` feeds this step with their slots reserved (and its drafts proposed); 0: none."""
        take = self.take_tokens(s, budget)
        if take <= 0:
            return 0
        s.held_back = 0
        if s.draft is None or take != s.left:
            return take if self._reserve(s, s.computed + take, batch) else 0
        assert self.rounds is not None, "only speculative rounds start drafts"
        room = min(speculative.room(s), budget - take)  # a draft/verify round
        if not self._reserve(s, s.computed + take + room, batch):  # slots first: drafting consumes the rng
            return 0
        take += speculative.propose(self.rounds, s, room, len(self.running) - 1)
        self.slots.trim(s, s.computed + take)  # fewer drafts than room
        return take

    def _reserve(self, s: Sequence, end: int, batch: Batch) -> bool:
        """`reserve`; when nothing can make room and `s` runs alone, nothing off the packed path
        running either (the serial runner's requests hold locked prefixes until they end), pinned
        prefixes fill the rest of the pool: `s` fails."""
        if self.reserve(s, end, batch):
            return True
        if not batch and self.running == [s] and not self.elsewhere():
            self.fail(s, PoolFullError("the KV pool is full of pinned prefixes"), None)
        return False

    def take_tokens(self, s: Sequence, budget: int) -> int:
        """How many of `s`'s uncomputed tokens this step takes: as many as the budget allows, or in
        batch-invariant mode up to the last of its prompt's fixed cuts the budget reaches."""
        left = s.left
        if s.draft is not None and left > 1:  # prefill stops before the last token: rounds feed it
            left -= 1
        if not self.limits.invariant or left <= budget:
            return min(left, budget)
        cuts = chunk_ends(s.computed, len(s.sequence), self.limits.chunk)
        reachable = [end for end in cuts if end - s.computed <= budget]
        return reachable[-1] - s.computed if reachable else 0

    # ---- preemption -----------------------------------------------------------------------------

    def reserve(self, s: Sequence, end: int, batch: Batch) -> bool:
        """Slots up to position `end` of `s`, preempting a `victim` while the pool is full; False
        when no victim is left."""
        while True:
            try:
                self.slots.reserve(s, end)
                return True
            except PoolFullError:
                victim = self.victim(s, batch)
                if victim is None:
                    return False
                self.preempt(victim)

    def victim(self, s: Sequence, batch: Batch) -> Sequence | None:
        """Whom to preempt for `s`'s slots: the youngest other running request not in this batch of
        the tenant with the most recent work per weight (the flooder's, not the newcomer's)."""
        taken = {id(t) for t, _ in batch}
        victims = [t for t in self.running if t is not s and id(t) not in taken]
        usage = {t: self.room.ledger.usage(t) for t in {v.request.tenant for v in victims}}
        return max(victims, key=lambda t: (usage[t.request.tenant], t.admitted_at)) if victims else None

    def preempt(self, s: Sequence) -> None:
        """Free `s`'s own slots and lock; it waits again, first in its tenant's line, with its output
        state, and resumes later by prefilling what it had (mostly a hit of its own prompt)."""
        self.preemptions += 1
        self.slots.release(s)
        self.running.remove(s)
        s.computed = 0
        self.room.put_front(s.request.tenant, s.request)

    def remove(self, s: Sequence) -> None:
        if s in self.running:
            self.running.remove(s)

    def fail(self, s: Sequence, error: BaseException, phase: str | None) -> None:
        """`s` stops running now (its own slots and lock go back, so the rest of this call plans
        without it); the loop ends it when the call returns."""
        self.remove(s)
        self.slots.release(s)
        self.failed.append(Failure(s, error, phase))

    def _handed_back(self) -> list[Failure]:
        failed, self.failed = self.failed, []
        return failed


def twice_as_busy(busy: float, light: float) -> bool:
    """Whether a tenant of `busy` recent work is at least twice as busy as one of `light` (plus a
    token: tenants about as busy never hold each other back)."""
    return busy >= 2 * light + 1


def first_in_line(order: list[Sequence], ledger: TenantLedger) -> str | None:
    """The least served tenant (recent work per weight) with a first token one short step away,
    or None when no request has one."""
    near = {s.request.tenant for s in order if not s.generated and 0 < s.left <= NEAR}
    return min(near, key=lambda t: (ledger.usage(t), t)) if near else None


def held_back(s: Sequence, urgent: str, max_wait_steps: int, yielding: Set[str] = frozenset()) -> bool:
    """The head-of-line rule: with a first token of tenant `urgent` one short step away, a long
    prefill sits the step out, and so does any prefill of a tenant served more than `urgent`
    (a victim's first token does not wait behind a flooder's short prompts), and any decode of a
    `yielding` tenant (at least twice as busy: its rows would make the step longer than the
    victim's step alone); each at most `max_wait_steps` steps in a row."""
    if s.held_back >= max_wait_steps:
        return False
    if s.left <= 1:
        if s.request.tenant not in yielding:
            return False
        s.held_back += 1
        return True
    if s.left > NEAR or s.request.tenant != urgent:
        s.held_back += 1
        return True
    return False


class AdmissionPass:
    """One admission pass over the waiting room: what it has learnt (free slots left, cached
    lengths, requests looked at) and how it picks each tenant's next request."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.available = scheduler.slots.free
        self.counted_evictable = False
        self.cached: dict[int, int] = {}
        self.seen: dict[int, Sequence] = {}

    def admit_from(self, tenant: str) -> Admitted:
        """Admit one waiting request of `tenant` (see `Admitted`)."""
        candidates = self.candidates(tenant)
        limits = self.scheduler.limits
        starved = [s for s in candidates if s.waited >= limits.max_wait_steps]
        rest = sorted(
            (s for s in candidates if s.waited < limits.max_wait_steps),
            key=lambda s: -self.cached[id(s)],
        )
        for s in starved + rest:
            cached = self.cached[id(s)]
            if s.waited < limits.max_wait_steps and self.joins(s, cached):
                continue
            need = len(s.sequence) - cached + limits.watermark
            if not self.can_admit(need):
                self.scheduler.deferred += 1
                return Admitted.DEFERRED
            if self.scheduler.admit_one(s):
                self.available -= need - limits.watermark
                return Admitted.ONE
        return Admitted.NONE

    def candidates(self, tenant: str) -> list[Sequence]:
        """The packed-path heads of `tenant`'s line, with their cached lengths known."""
        scheduler, candidates = self.scheduler, []
        for request in scheduler.room.heads(tenant, LOOK):
            s = scheduler.sequences(request)
            if s is None:
                continue
            self.seen[id(s)] = s
            if id(s) not in self.cached:
                try:
                    self.cached[id(s)] = scheduler.slots.cached_length(s)
                except Exception as exc:  # e.g. a namespace that cannot be keyed: this request only
                    scheduler.room.remove(tenant, s.request)
                    scheduler.fail(s, exc, "admission")
                    continue
            candidates.append(s)
        return candidates

    def can_admit(self, need: int) -> bool:
        """Whether `need` slots (an uncached prompt plus the watermark) are free or evictable; with
        nothing running a request is admitted anyway (preemption and eviction make its room)."""
        if need > self.available and not self.counted_evictable:
            self.available += self.scheduler.slots.evictable()
            self.counted_evictable = True
        return need <= self.available or not self.scheduler.running

    def joins(self, s: Sequence, cached: int) -> bool:
        """Whether `s` waits for a running request that is computing a prompt `s` shares beyond what
        is cached (at least `join_min_tokens` more): once that prompt is committed, `s` hits it
        instead of computing it a second time."""
        ids = s.token_array()
        return any(
            common_prefix_len(r.token_array()[: len(r.ids)], ids) - cached
            >= self.scheduler.limits.join_min_tokens
            for r in self.scheduler.running
            if not r.committed_prompt and r.salt == s.salt
        )
