"""Per-tier metrics of the spill stack (host memory, disk, Redis), labelled `tier`, read at scrape
time from the cache's stats and the stack's `tier_sizes()`.

The Redis tier's own families (`kvblocks_redis_*`) stay as they were; these add one labelled family
per counter for every tier, LMCache-style (hits, restored tokens, writes, evictions, failures), and
gauges of what each tier holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# (family, help, the stats keys summed per tier as `<tier>_<key>`; absent keys count 0)
TIER_COUNTERS = (
    ("kvblocks_spill_tier_lookups", "Lookups that asked the tier.", ("lookups",)),
    ("kvblocks_spill_tier_hit_chunks", "Chunks found and verified in the tier.", ("hit_chunks",)),
    (
        "kvblocks_spill_tier_restored_tokens",
        "Prompt tokens restored from the tier (beyond what the device and the tiers above held).",
        ("hit_tokens",),
    ),
    ("kvblocks_spill_tier_written_chunks", "Chunks encoded and written into the tier.", ("written_chunks",)),
    ("kvblocks_spill_tier_written_bytes", "Bytes written into the tier.", ("written_bytes",)),
    (
        "kvblocks_spill_tier_promoted_chunks",
        "Chunks copied up into the tier from a lower one.",
        ("promoted_chunks",),
    ),
    (
        "kvblocks_spill_tier_demoted_chunks",
        "Chunks the tier above evicted, written into this one (write-back).",
        ("demoted_chunks",),
    ),
    ("kvblocks_spill_tier_evictions", "Records the tier evicted by its own size bound.", ("evictions",)),
    (
        "kvblocks_spill_tier_errors",
        "Outages: operations on the tier that failed (it is then skipped a while).",
        ("errors",),
    ),
    (
        "kvblocks_spill_tier_verify_failures",
        "Records refused (wrong size or type, or failed verification) and deleted: misses.",
        ("verify_failures", "rejected_size", "rejected_type"),
    ),
    (
        "kvblocks_spill_tier_write_drops",
        "Writes for the tier dropped (queue or retry queue full).",
        ("write_drops",),
    ),
    (
        "kvblocks_spill_tier_skipped_while_down",
        "Lookups that skipped the tier while it was down.",
        ("skipped_while_down",),
    ),
)
# (family, help, `tier_sizes()` field)
TIER_GAUGES = (
    ("kvblocks_spill_tier_used_bytes", "Bytes the tier holds (Redis: its used_memory).", "used_bytes"),
    (
        "kvblocks_spill_tier_capacity_bytes",
        "The tier's size bound (Redis: maxmemory; absent when none).",
        "capacity_bytes",
    ),
    ("kvblocks_spill_tier_records", "Records in the tier (Redis: keys in its database).", "records"),
)


def tier_families(stats: dict[str, int], spill: Any) -> Iterator[Metric]:
    """The labelled tier families for a cache whose `spill` is a `TierStack` (nothing otherwise)."""
    names = [t.name for t in getattr(spill, "tiers", ())]
    if not names:
        return
    for family, doc, keys in TIER_COUNTERS:
        metric = CounterMetricFamily(family, doc, labels=["tier"])
        for name in names:
            metric.add_metric([name], sum(stats.get(f"{name}_{k}", 0) for k in keys))
        yield metric
    sizes = spill.tier_sizes()
    up = GaugeMetricFamily(
        "kvblocks_spill_tier_up", "1 while the tier answers, 0 while it is down.", labels=["tier"]
    )
    for row in sizes:
        up.add_metric([row["name"]], 0 if row["health"] == "down" else 1)
    yield up
    for family, doc, field in TIER_GAUGES:
        metric = GaugeMetricFamily(family, doc, labels=["tier"])
        for row in sizes:
            if row[field] is not None:
                metric.add_metric([row["name"]], row[field])
        yield metric


def hit_labels(stats: dict[str, int], spill: Any) -> list[tuple[str, int, int]]:
    """(tier label, queried tokens, hit tokens) of each spill tier for the per-tier prefix-cache
    families: a lone tier is credited with every token promoted from the spill (`spill_hit_tokens`,
    as always); in a stack of several each tier with the tokens it restored."""
    names = [t.name for t in spill.tiers]
    chunk = spill.chunk_tokens
    if len(names) == 1:
        (name,) = names
        return [(name, stats[f"{name}_lookup_chunks"] * chunk, stats["spill_hit_tokens"])]
    return [(n, stats[f"{n}_lookup_chunks"] * chunk, stats[f"{n}_hit_tokens"]) for n in names]
