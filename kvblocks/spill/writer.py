"""The stack's writer: one background thread behind a bounded queue writes records into the tiers.

Writes never block generation: a full queue drops (and counts) the job, and so does one whose bytes
(a chunk copied off the device, records moved between tiers) would take the bytes the writer holds,
queued and held, past `max_bytes`. Each job names the tiers it
targets; a target that is down, or fails, gets the job held for it (up to `retry_size` held jobs,
oldest dropped first), retried once that tier answers again. Jobs:
- `through`: the completed chunks of a prefix from a position on, read back out of the device pool
  when they run; only what a tier lacks is written (a STRLEN-like `sizes` first), so a job that
  repairs a tier which lost records (a FLUSHALL, a restart) writes just those;
- `record`: one chunk copied off the device as it is evicted (write-back);
- `state`: a recurrent-state snapshot taken where a chunk ends;
- `raw`: verified records moved between tiers as they are (a promotion up, a demotion down);
- `delete`: a record that failed verification, removed from the tier it was read from.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvblocks.spill.tier import TierUnavailable
from kvblocks.spill.tier_counters import TierSlot

log = logging.getLogger("kvblocks.spill")

# How many chunk keys the stack remembers having seen in its tiers (to rate-limit repairs).
CONFIRMED_KEYS = 4096
# Host bytes the writer's jobs may hold, queued and held together, before it drops new ones.
DEFAULT_MAX_BYTES = 1 << 30


@dataclass(slots=True)
class Job:
    kind: str  # through, record, state, raw, delete
    targets: tuple[int, ...]  # indexes of the tiers it writes into
    args: tuple[Any, ...]
    counter: str = "written_chunks"  # raw jobs: promoted_chunks or demoted_chunks
    ready: Any = field(default=None)  # a CUDA event the job waits on (its copy off the device)
    nbytes: int = 0  # what it holds in host memory until it runs


class Confirmed:
    """Chunk keys recently seen in the tiers, most recent last, at most CONFIRMED_KEYS of them."""

    def __init__(self, recheck_interval_s: float) -> None:
        self.recheck_interval_s = recheck_interval_s
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, keys: list[str]) -> None:
        now = time.monotonic()
        with self._lock:
            for key in keys:
                self._seen[key] = now
                self._seen.move_to_end(key)
            while len(self._seen) > CONFIRMED_KEYS:
                self._seen.popitem(last=False)

    def first_unseen(self, keys: list[str]) -> int | None:
        since = time.monotonic() - self.recheck_interval_s
        with self._lock:
            return next((i for i, k in enumerate(keys) if self._seen.get(k, -1e18) < since), None)


class Writer:
    """The queue, the thread and the held jobs; `run_job(job, slot)` writes one job into one tier."""

    def __init__(
        self,
        slots: list[TierSlot],
        run_job: Callable[[Job, TierSlot], None],
        *,
        queue_size: int,
        retry_size: int,
        retry_interval_s: float,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self._slots, self._run_job = slots, run_job
        self.retry_size, self.retry_interval_s, self.max_bytes = retry_size, retry_interval_s, max_bytes
        self._bytes = 0  # held by queued and held jobs
        self._bytes_lock = threading.Lock()
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._held: list[Job] = []  # each for one target; touched by the writer thread only
        self._thread = threading.Thread(target=self._loop, name="kvblocks-spill-writer", daemon=True)
        self._thread.start()

    def enqueue(self, job: Job) -> None:
        counter = "write_drops"
        if self._take(job.nbytes):
            try:
                self._queue.put_nowait(job)
                counter = "write_jobs"
            except queue.Full:
                self._give(job.nbytes)
        for t in job.targets:
            self._slots[t].count(**{counter: 1})

    def run_now(self, job: Job) -> None:
        """Run `job` on this thread (the writer's own: a demotion made by a write it runs)."""
        self._run(job)

    def pending_bytes(self) -> int:
        return self._bytes

    def _take(self, nbytes: int, force: bool = False) -> bool:
        with self._bytes_lock:
            if nbytes and not force and self._bytes + nbytes > self.max_bytes:
                return False
            self._bytes += nbytes
            return True

    def _give(self, nbytes: int) -> None:
        with self._bytes_lock:
            self._bytes -= nbytes

    def depth(self) -> int:
        return self._queue.qsize()

    def held(self, index: int) -> int:
        return sum(1 for job in list(self._held) if job.targets[0] == index)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until queued writes are done (or dropped, or held); True if the queue drained in time."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return self._queue.unfinished_tasks == 0

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=self.retry_interval_s)
            except queue.Empty:  # idle: held writes are retried once their tier may be back
                self._retry_held()
                continue
            try:
                if job is None:
                    return
                self._run(job)
                self._give(job.nbytes)
                self._retry_held()
            finally:
                self._queue.task_done()

    def _run(self, job: Job) -> None:
        """Run `job` for each target; one that meets a down tier or fails there is held for it."""
        if job.ready is not None:
            job.ready.synchronize()  # the device-to-host copy this job reads has landed
            job.ready = None
        for t in job.targets:
            slot, mine = self._slots[t], job if len(job.targets) == 1 else _for(job, t)
            if not slot.up():
                self._hold(mine)
                continue
            try:
                self._run_job(mine, slot)
            except TierUnavailable as exc:
                slot.count(write_errors=1)
                slot.mark_down(exc)
                self._hold(mine)
            except Exception:  # a bug must not end the writer: later writes would all be dropped
                slot.count(write_errors=1)
                log.exception(
                    "kvblocks: a spill write job failed in the %s tier; the writer goes on", slot.name
                )

    def _hold(self, job: Job) -> None:
        self._held.append(job)
        self._take(job.nbytes, force=True)
        self._slots[job.targets[0]].count(write_deferred=1)
        if len(self._held) > self.retry_size:
            dropped = self._held.pop(0)
            self._give(dropped.nbytes)
            self._slots[dropped.targets[0]].count(write_drops=1)

    def _retry_held(self) -> None:
        i = 0
        while i < len(self._held):
            job = self._held[i]
            slot = self._slots[job.targets[0]]
            if not slot.up():
                i += 1
                continue
            del self._held[i]
            self._give(job.nbytes)
            slot.count(write_retried=1)
            self._run(job)  # held again, at the end, if it fails


def _for(job: Job, target: int) -> Job:
    return Job(job.kind, (target,), job.args, job.counter, nbytes=job.nbytes)
