"""What the stack keeps about each tier: its counters (named `<tier>_<counter>` in stats and metrics)
and its quiet window after an outage.

The counter names are those the Redis tier has always reported (`redis_hit_chunks`, ...), now kept
for every tier alike; a tier's own counters (`Tier.counters`: evictions, ...) are added beside them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass

from kvblocks.spill.tier import Tier, TierUnavailable


@dataclass(slots=True)
class TierCounters:
    lookups: int = 0
    lookup_chunks: int = 0
    hit_chunks: int = 0
    hit_tokens: int = 0
    read_bytes: int = 0
    errors: int = 0
    verify_failures: int = 0
    rejected_size: int = 0
    rejected_type: int = 0
    deleted_invalid: int = 0
    skipped_while_down: int = 0
    write_jobs: int = 0
    write_drops: int = 0
    written_chunks: int = 0
    written_bytes: int = 0
    write_skipped_present: int = 0
    write_skipped_evicted: int = 0
    write_errors: int = 0
    write_deferred: int = 0
    write_retried: int = 0
    repair_jobs: int = 0
    state_lookups: int = 0
    state_hits: int = 0
    written_states: int = 0
    promoted_chunks: int = 0
    demoted_chunks: int = 0


# The counters a tier gained with the stack: reported for every tier but Redis' counter list
# (`kvblocks.telemetry.metrics.REDIS_COUNTERS`) is unchanged.
STACK_COUNTERS = ("promoted_chunks", "demoted_chunks")


class TierSlot:
    """One tier in a stack: the tier, its position, its counters and its down window."""

    def __init__(self, tier: Tier, index: int, retry_interval_s: float) -> None:
        self.tier, self.index, self.name = tier, index, tier.name
        self.retry_interval_s = retry_interval_s
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._down_until = 0.0

    def up(self) -> bool:
        """False within `retry_interval_s` of the tier's last outage: it is not asked meanwhile."""
        return time.monotonic() >= self._down_until

    def mark_down(self, exc: TierUnavailable | None = None) -> None:
        self.count(errors=1)
        self._down_until = time.monotonic() + self.retry_interval_s

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + d)

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = asdict(self.counters)
        own = self.tier.counters()
        return {f"{self.name}_{k}": v for k, v in (out | own).items()}
