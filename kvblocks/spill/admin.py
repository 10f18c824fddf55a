"""What an operator sees of and does to a stack's tiers: counters, sizes, and dropping records."""

from __future__ import annotations

import itertools
from typing import Any

from kvblocks.spill.tier import TierUnavailable
from kvblocks.spill.tier_counters import TierSlot
from kvblocks.spill.writer import Writer


def tier_stats(slots: list[TierSlot], writer: Writer) -> dict[str, int]:
    """Every tier's counters as `<tier>_<counter>`, with the writer's queue depth (one queue,
    shared) and the writes held for that tier."""
    out: dict[str, int] = {}
    for slot in slots:
        out |= slot.stats() | {
            f"{slot.name}_queue_depth": writer.depth(),
            f"{slot.name}_held_writes": writer.held(slot.index),
            f"{slot.name}_queue_bytes": writer.pending_bytes(),
        }
    return out


def tier_sizes(slots: list[TierSlot]) -> list[dict[str, Any]]:
    """Each tier in order: name, health, used and capacity bytes, records (None where the tier
    cannot say; a tier within its quiet window after an outage is not asked)."""
    out = []
    for slot in slots:
        row: dict[str, Any] = {"name": slot.name, "used_bytes": None, "capacity_bytes": None, "records": None}
        if not slot.up():
            out.append(row | {"health": "down"})
            continue
        try:
            health = slot.tier.health()
            records = getattr(slot.tier, "records", None)
            row |= {
                "health": health.state,
                "used_bytes": slot.tier.used_bytes(),
                "capacity_bytes": slot.tier.capacity_bytes(),
                "records": None if records is None else records(),
            }
        except TierUnavailable as exc:
            slot.mark_down(exc)
            row["health"] = "down"
        out.append(row)
    return out


def clear_tiers(slots: list[TierSlot], prefix: str, batch: int = 500) -> int:
    """Delete every record whose key starts with `prefix` from `slots`' tiers; how many went.
    RuntimeError when a tier fails midway."""
    deleted = 0
    for slot in slots:
        try:
            keys = slot.tier.scan(prefix)
            while chunk := list(itertools.islice(keys, batch)):
                deleted += slot.tier.delete(chunk)
        except TierUnavailable as exc:
            slot.mark_down(exc)
            raise RuntimeError(f"the {slot.name} tier failed while deleting records: {exc}") from exc
    return deleted
