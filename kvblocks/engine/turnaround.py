"""Turnarounds: how soon a tenant's next request follows its last reply, and how long the engine
holds its next step for that request.

On a CPU most of a step's time is a fixed cost (every weight is read once, however few rows the
step has: on the 2-core VM a SmolLM2 step takes about 145 ms plus 8 ms a row), so bounding a busier
tenant's tokens in a step cannot make the step short. An interactive client sends its next request
moments after its reply ends (its own turn, the HTTP hop and tokenizing: tens of milliseconds), so
it arrives just after the next step started and waits for nearly all of it: a flooder's step of
one prefill cut and its decodes cost the victim a whole step before its own (about 2.5x its idle
time to first token). When a tenant with nothing running came back that quickly last time, and
every tenant with work is busier than it (`Scheduler.hold`), the engine waits for its next request
up to that turnaround and a half (`WAIT_SLACK_S` more), never more than `WAIT_SHARE` of a step:
the busier tenants lose at most that fraction of a step per reply, the lighter one no step at all.
A tenant that does not come back in time costs that once; its slower turnaround is what is learnt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

WAIT_SHARE = 0.25  # the most of a step the engine waits for a lighter tenant's next request
WAIT_SLACK_S = 0.005  # beyond 1.5x the tenant's last turnaround (the event loop's jitter)
STEP_MEMORY = 0.8  # a timed step's weight in `step_s`, per later step
MAX_TENANTS = 4096  # turnarounds kept (the oldest dropped first)


class Turnarounds:
    """Reply ends and the next requests that followed them, per tenant (engine thread only)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock  # the clock of `Request.submitted`
        self.ended: dict[str, float] = {}  # tenant -> when its last reply ended (no request since)
        self.gaps: dict[str, float] = {}  # tenant -> its last turnaround, seconds
        self.step_s = 0.0  # the engine's recent step time (0: none timed yet)

    def reply_ended(self, tenant: str) -> None:
        """`tenant`'s reply ended and it has nothing else running: its next request may be moments away."""
        self.ended[tenant] = self.clock()

    def arrived(self, tenant: str, submitted: float) -> None:
        """A request of `tenant` submitted at `submitted` starts: its turnaround is learnt."""
        ended = self.ended.pop(tenant, None)
        if ended is None or submitted < ended:
            return
        self.gaps.pop(tenant, None)
        if len(self.gaps) >= MAX_TENANTS:
            del self.gaps[next(iter(self.gaps))]
        self.gaps[tenant] = submitted - ended

    def stepped(self, seconds: float) -> None:
        """A step took `seconds`: what `WAIT_SHARE` is a share of."""
        self.step_s = seconds if not self.step_s else STEP_MEMORY * self.step_s + (1 - STEP_MEMORY) * seconds

    def due(self, candidates: Iterable[str]) -> tuple[set[str], float]:
        """Which of `candidates` (tenants whose reply ended) to wait for and how long: each whose
        last turnaround was at most `WAIT_SHARE` of a step, until 1.5x it (plus `WAIT_SLACK_S`, at
        most that share) has passed since its reply ended. A reply end older than a step is forgotten, its tenant's
        turnaround learnt as at least that long (no wait for it until it comes back sooner)."""
        now, cap = self.clock(), WAIT_SHARE * self.step_s
        for tenant in [t for t, ended in self.ended.items() if now - ended > self.step_s]:
            self.arrived(tenant, now)
        waits = {}
        for tenant in candidates:
            gap, ended = self.gaps.get(tenant), self.ended.get(tenant)
            if gap is None or ended is None or gap > cap:
                continue
            left = ended + min(1.5 * gap + WAIT_SLACK_S, cap) - now
            if left > 0:
                waits[tenant] = left
        return set(waits), max(waits.values(), default=0.0)
