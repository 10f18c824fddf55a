"""Prometheus metrics through prometheus_client: the engine's request counters and latency histograms,
and a collector that reads the prefix cache's stats at scrape time.

Each `Metrics` owns a `CollectorRegistry` (never the process-wide default), so several engines or apps
in one process do not clash. Counters only go up; rates (hit rate, tokens/s) are for the reader to
compute from deltas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvblocks.blocks.report import TIERS as BLOCK_TIERS
from kvblocks.telemetry.tier_metrics import hit_labels, tier_families
from kvblocks.telemetry.vllm_metrics import VllmCollector, VllmHistograms

if TYPE_CHECKING:
    from kvblocks.adapters.hf_trie import KVCacheTrie
    from kvblocks.seq2seq.cache import Seq2SeqCache

__all__ = ["CONTENT_TYPE_LATEST", "CacheCollector", "Metrics", "Seq2SeqCollector", "TenantHoldingsCollector"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# Named as exposed: prometheus_client's Counter keeps `_total` for the sample and names the family
# without it (it also adds a `_created` gauge per counter and histogram, the time it was made).
COUNTERS = {
    "kvblocks_requests_total": "Finished generation requests.",
    "kvblocks_requests_failed_total": "Requests that failed inside the engine.",
    "kvblocks_requests_cancelled_total": "Requests abandoned by their client (disconnects).",
    "kvblocks_requests_rejected_total": "Requests refused because their tenant's queue or the server was full.",
    "kvblocks_engine_errors_total": "Faults in an engine step outside any one request (the step's requests failed).",
    "kvblocks_prompt_tokens_total": "Prompt tokens of finished requests.",
    "kvblocks_cached_prompt_tokens_total": "Prompt tokens served from the prefix cache.",
    "kvblocks_generation_tokens_total": "Generated tokens.",
    "kvblocks_block_reused_tokens_total": "Prompt tokens whose KV came from a KV block at a new position "
    "(blended), by the tier the block's KV came from: device pool, redis, or fill (computed by the request).",
    "kvblocks_block_recomputed_tokens_total": "Prompt tokens recomputed in requests that reused KV blocks.",
    "kvblocks_block_fill_tokens_total": "Tokens computed to store KV blocks the block store did not hold "
    "(by requests and by POST /v1/blocks).",
    "kvblocks_block_probe_tokens_total": "Tokens a blend ran through the first two layers to choose what to "
    "recompute.",
    "kvblocks_block_promotions_total": "Requests whose KV blocks, marked in exact mode on the batched engine, "
    "were stored when the engine was idle, by outcome: done, dropped (too many waiting) or failed.",
    "kvblocks_spec_drafted_tokens_total": "Speculative draft tokens proposed.",
    "kvblocks_spec_accepted_tokens_total": "Speculative draft tokens accepted.",
    "kvblocks_spec_rounds_total": "Speculative draft/verify rounds (target calls).",
    "kvblocks_spec_emitted_tokens_total": "Tokens speculative rounds committed (accepted drafts plus the target's own); "
    "divided by the rounds, tokens per target forward.",
    "kvblocks_spec_tree_rounds_total": "Speculative rounds that verified a draft tree wider than a chain "
    "(drafted tokens count a tree's nodes, accepted ones its accepted path).",
}
# Counters with labels, and every value each label takes (exported at 0 from the start).
LABELLED = {
    "kvblocks_block_reused_tokens_total": ("tier", BLOCK_TIERS),
    "kvblocks_block_promotions_total": ("outcome", ("done", "dropped", "failed")),
}
HISTOGRAMS = {
    "kvblocks_time_to_first_token_seconds": "Time from request arrival to its first token, queueing included.",
    "kvblocks_inter_token_seconds": "Time between consecutive tokens of a stream.",
    "kvblocks_e2e_request_latency_seconds": "Time from request arrival to its last token, queueing included.",
}


class Metrics:
    """The engine's counters and histograms, plus any collector registered beside them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._counters = {name: _counter(name, doc, self.registry) for name, doc in COUNTERS.items()}
        self._histograms = {
            name: Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=self.registry)
            for name, doc in HISTOGRAMS.items()
        }
        self.vllm: VllmHistograms | None = None

    def export_vllm(
        self, model_name: str, load: Callable[[], tuple[int, int]], cache: KVCacheTrie | None
    ) -> None:
        """Export vLLM's names beside kvblocks' own (`kvblocks.telemetry.vllm_metrics`), labelled `model_name`."""
        self.vllm = VllmHistograms(self.registry, model_name)
        self.register(VllmCollector(model_name, lambda: self.counters, load, cache))

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        counter = self._counters[name]
        (counter.labels(**labels) if labels else counter).inc(value)
        if name == "kvblocks_requests_cancelled_total" and self.vllm is not None:
            self.vllm.finished("abort")

    def observe(self, name: str, value: float) -> None:
        self._histograms[name].observe(value)
        if self.vllm is not None:
            self.vllm.observe(name, value)

    def finished(self, reason: str, e2e_s: float) -> None:
        """A request ended with `reason` (stop, length) `e2e_s` after it arrived."""
        self.inc("kvblocks_requests_total")
        self.observe("kvblocks_e2e_request_latency_seconds", e2e_s)
        if self.vllm is not None:
            self.vllm.finished(reason)

    def register(self, collector: Collector) -> None:
        """Add a collector (anything with `collect()`) to this registry, read at every scrape."""
        self.registry.register(collector)

    @property
    def counters(self) -> dict[str, int | float]:
        """The engine's counter values by their exposed name (`kvblocks_requests_total`), a labelled
        counter's summed over its labels; whole counts as ints, so that `/v1/cache/stats` shows `2`,
        not prometheus_client's `2.0`."""
        totals: dict[str, float] = {}
        for counter in self._counters.values():
            for family in counter.collect():
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        return {name: int(v) if v.is_integer() else v for name, v in totals.items()}

    def samples(self) -> dict[str, float]:
        """Every sample in the registry by name, labels left out: histograms' `_count` and `_sum` included."""
        return {s.name: s.value for family in self.registry.collect() for s in family.samples if not s.labels}

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format (`CONTENT_TYPE_LATEST`)."""
        return generate_latest(self.registry)


def _counter(name: str, doc: str, registry: CollectorRegistry) -> Counter:
    if name not in LABELLED:
        return Counter(name, doc, registry=registry)
    label, values = LABELLED[name]
    counter = Counter(name, doc, [label], registry=registry)
    for value in values:
        counter.labels(value)
    return counter


# The cache's stats as exposed: (family name, help, key in `KVCacheTrie.stats()`). Counter families
# are named without `_total`: prometheus_client appends it to the sample.
CACHE_COUNTERS = (
    ("kvblocks_prefix_cache_queries", "Prefix-cache lookups.", "queries"),
    ("kvblocks_prefix_cache_inserted_tokens", "Tokens stored in the device pool.", "inserted_tokens"),
    ("kvblocks_prefix_cache_evicted_tokens", "Tokens evicted from the device pool.", "evicted_tokens"),
    (
        "kvblocks_prefix_cache_lookup_errors",
        "Lookups that failed and were served as misses.",
        "lookup_errors",
    ),
)
CACHE_GAUGES = (
    ("kvblocks_prefix_cache_resident_tokens", "Tokens resident in the device pool.", "resident_tokens"),
    ("kvblocks_prefix_cache_resident_bytes", "KV bytes resident in the device pool.", "resident_bytes"),
    ("kvblocks_prefix_cache_capacity_tokens", "Device pool capacity in tokens.", "capacity_tokens"),
    ("kvblocks_prefix_cache_pinned_tokens", "Pinned tokens.", "pinned_tokens"),
    ("kvblocks_prefix_cache_locked_tokens", "Tokens locked by running requests.", "locked_tokens"),
)
REDIS_COUNTERS = (
    ("kvblocks_redis_errors", "Redis operations that failed (read or write).", "redis_errors"),
    ("kvblocks_redis_verify_failures", "Redis values rejected by verification.", "redis_verify_failures"),
    ("kvblocks_redis_written_chunks", "Chunks written to Redis.", "redis_written_chunks"),
    ("kvblocks_redis_write_drops", "Writes dropped (queue or retry queue full).", "redis_write_drops"),
    (
        "kvblocks_redis_rejected_size",
        "Redis values refused unread: not the size of a record.",
        "redis_rejected_size",
    ),
    (
        "kvblocks_redis_rejected_type",
        "Redis keys of another type where a record belongs.",
        "redis_rejected_type",
    ),
    ("kvblocks_redis_deleted_invalid", "Invalid Redis values deleted.", "redis_deleted_invalid"),
    ("kvblocks_redis_write_retried", "Writes retried after Redis was down.", "redis_write_retried"),
    ("kvblocks_redis_repair_jobs", "Device hits that queued a rewrite of chunks.", "redis_repair_jobs"),
)

# recurrent and hybrid models only (the stats have "snapshots")
SNAPSHOT_COUNTERS = (
    ("kvblocks_state_snapshots_stored", "Recurrent-state snapshots stored in the pool.", "snapshots_stored"),
    (
        "kvblocks_state_snapshot_misses",
        "Lookups cut short because no snapshot ended where the cached prefix did.",
        "snapshot_misses",
    ),
)
SNAPSHOT_GAUGES = (
    ("kvblocks_state_snapshots", "Recurrent-state snapshots resident in the pool.", "snapshots"),
    ("kvblocks_state_snapshot_bytes", "Bytes of the resident recurrent-state snapshots.", "snapshot_bytes"),
)

KV_EVENT_COUNTERS = (
    ("kvblocks_kv_events_batches", "KV event batches published.", "kv_events_batches"),
    ("kvblocks_kv_events_stored_blocks", "Blocks reported stored (BlockStored).", "kv_events_stored_blocks"),
    (
        "kvblocks_kv_events_removed_blocks",
        "Blocks reported removed (BlockRemoved).",
        "kv_events_removed_blocks",
    ),
    (
        "kvblocks_kv_events_shared_blocks",
        "Blocks reported held by the Redis tier.",
        "kv_events_shared_blocks",
    ),
    (
        "kvblocks_kv_events_dropped_jobs",
        "Cache changes dropped by a full events queue.",
        "kv_events_dropped_jobs",
    ),
    (
        "kvblocks_kv_events_resyncs",
        "Full snapshots published (a subscriber joined, or after drops).",
        "kv_events_resyncs",
    ),
    ("kvblocks_kv_events_replays", "Replay requests answered.", "kv_events_replays"),
)


class CacheCollector(Collector):
    """The prefix cache's stats as counters and gauges, read at scrape time (one `stats()` call, so
    one consistent snapshot); queried and hit tokens are labelled by tier: `device`, and each spill
    tier's name (`host`, `disk`, `redis`) when the cache spills, whose own families are `tier_metrics`'. Redis and KV-event counters appear when the cache has that tier or publisher."""

    def __init__(self, cache: KVCacheTrie) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        s = self.cache.stats()
        spill = self.cache.spill
        spills, redis = spill is not None, "redis_lookups" in s
        queried = CounterMetricFamily(
            "kvblocks_prefix_cache_queried_tokens", "Prompt tokens looked up, per tier.", labels=["tier"]
        )
        hits = CounterMetricFamily(
            "kvblocks_prefix_cache_hit_tokens", "Prompt tokens served from cache, per tier.", labels=["tier"]
        )
        queried.add_metric(["device"], s["queried_tokens"])
        hits.add_metric(["device"], s["hit_tokens"] - s["spill_hit_tokens"])
        for tier, asked, hit in hit_labels(s, spill) if spills else ():
            queried.add_metric([tier], asked)
            hits.add_metric([tier], hit)
        yield queried
        yield hits
        events = "kv_events_batches" in s
        stateful = "snapshots" in s
        yield from stat_families(
            s,
            CACHE_COUNTERS
            + (REDIS_COUNTERS if redis else ())
            + (KV_EVENT_COUNTERS if events else ())
            + (SNAPSHOT_COUNTERS if stateful else ()),
            CACHE_GAUGES + (SNAPSHOT_GAUGES if stateful else ()),
        )
        policy = GaugeMetricFamily(
            "kvblocks_eviction_policy_info", "The pool's eviction policy (value 1).", labels=["policy"]
        )
        policy.add_metric([self.cache.eviction_policy], 1)
        yield policy
        yield from tier_families(s, spill)
        label = None if not spills else spill.tiers[0].name if len(spill.tiers) == 1 else "spill"
        yield from tenant_families(self.cache.tenant_counters(), label)


# encoder-decoder models only: the encoder's work and the source records (`Seq2SeqCache.stats()`);
# the decoder trie is the cache `CacheCollector` reads, so `kvblocks_prefix_cache_*` count decoder prefixes
ENCODER_COUNTERS = (
    ("kvblocks_encoder_runs", "Encoder forwards (one per source not served from the cache).", "encoder_runs"),
    ("kvblocks_encoder_computed_tokens", "Source tokens the encoder computed.", "encoder_tokens"),
    (
        "kvblocks_encoder_reused_sources",
        "Requests whose source's encoder output and cross-attention K/V came from the cache.",
        "encoder_reused",
    ),
    (
        "kvblocks_encoder_reused_tokens",
        "Source tokens whose encoder output and cross-attention K/V came from the cache.",
        "encoder_reused_tokens",
    ),
    ("kvblocks_source_records_stored", "Source records stored whole in the source pool.", "sources_stored"),
    (
        "kvblocks_source_cache_evicted_tokens",
        "Source tokens evicted from the source pool.",
        "source_evicted_tokens",
    ),
)
SOURCE_GAUGES = (
    ("kvblocks_source_records", "Source records resident whole in the source pool.", "source_records"),
    (
        "kvblocks_source_cache_resident_tokens",
        "Source tokens resident in the source pool (padding included).",
        "source_resident_tokens",
    ),
    ("kvblocks_source_cache_capacity_tokens", "Source pool capacity in tokens.", "source_capacity_tokens"),
)


class Seq2SeqCollector(Collector):
    """An encoder-decoder model's encoder work and source records, read at scrape time beside the
    decoder trie's `CacheCollector`."""

    def __init__(self, cache: Seq2SeqCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        yield from stat_families(self.cache.stats(), ENCODER_COUNTERS, SOURCE_GAUGES)


def stat_families(stats: dict[str, int], counters: tuple, gauges: tuple) -> Iterator[Metric]:
    """One counter or gauge family per (family name, help, stats key) row."""
    for name, doc, key in counters:
        yield CounterMetricFamily(name, doc, value=stats[key])
    for name, doc, key in gauges:
        yield GaugeMetricFamily(name, doc, value=stats[key])


def tenant_families(tenants: dict[str, dict[str, int]], spill_label: str | None) -> Iterator[Metric]:
    """Per-tenant lookups, hits (per tier) and evictions, labelled `tenant` ("" is the default tenant);
    spill hits are labelled `spill_label` (the lone spill tier's name, or "spill" for a stack)."""
    queried = CounterMetricFamily(
        "kvblocks_tenant_queried_tokens", "Prompt tokens looked up, per tenant.", labels=["tenant"]
    )
    hits = CounterMetricFamily(
        "kvblocks_tenant_hit_tokens",
        "Prompt tokens served from cache, per tenant and tier.",
        labels=["tenant", "tier"],
    )
    evicted = CounterMetricFamily(
        "kvblocks_tenant_evicted_tokens",
        "Tokens evicted from the device pool, per tenant.",
        labels=["tenant"],
    )
    for tenant, c in sorted(tenants.items()):
        queried.add_metric([tenant], c["queried_tokens"])
        hits.add_metric([tenant, "device"], c["hit_tokens"] - c["spill_hit_tokens"])
        if spill_label is not None:
            hits.add_metric([tenant, spill_label], c["spill_hit_tokens"])
        evicted.add_metric([tenant], c["evicted_tokens"])
    yield from (queried, hits, evicted)


class TenantHoldingsCollector(Collector):
    """What the server holds per tenant outside the engine, read at scrape time from `read()`:
    {"stored_bytes": {tenant: bytes}, "stored_responses": {tenant: entries}, "stored_evicted":
    {reason: entries}, "stored_refused": entries, "pinned_tokens": {tenant: tokens},
    "pins_refused": {tenant: hints}}."""

    def __init__(self, read: Callable[[], dict]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        held = self.read()
        for name, doc, key in (
            ("kvblocks_tenant_stored_response_bytes", "Stored responses bytes, per tenant.", "stored_bytes"),
            ("kvblocks_tenant_stored_responses", "Stored responses, per tenant.", "stored_responses"),
            ("kvblocks_tenant_pinned_tokens", "Tokens pinned by cache_control, per tenant.", "pinned_tokens"),
        ):
            family = GaugeMetricFamily(name, doc, labels=["tenant"])
            for tenant, value in sorted(held[key].items()):
                family.add_metric([tenant], value)
            yield family
        refused = CounterMetricFamily(
            "kvblocks_tenant_pins_refused",
            "cache_control hints not honoured: over the tenant's share of the pin cap, or the cap.",
            labels=["tenant"],
        )
        for tenant, value in sorted(held["pins_refused"].items()):
            refused.add_metric([tenant], value)
        yield refused
        evicted = CounterMetricFamily(
            "kvblocks_stored_responses_evicted",
            "Stored /v1/responses dropped before being deleted, by reason: expired, count_cap (the "
            "tenant's entry cap), own_budget (the tenant's byte budget), server_budget (the server's).",
            labels=["reason"],
        )
        for reason, value in held["stored_evicted"].items():
            evicted.add_metric([reason], value)
        yield evicted
        yield CounterMetricFamily(
            "kvblocks_stored_responses_refused",
            "/v1/responses not stored (answered with store: false): larger than a tenant's budget.",
            value=held["stored_refused"],
        )
