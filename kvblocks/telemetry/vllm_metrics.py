"""The same quantities under vLLM's metric names, units, `model_name` label and histogram buckets, so
dashboards, router scorers and autoscaling rules written for vLLM read kvblocks unchanged.

Counters and gauges are derived at scrape time from kvblocks' own counters, the cache's stats and the
engine's load (one source of truth, so the two names can never disagree); the latency histograms and
the per-reason request counter are observed as requests finish. The device pool is vLLM's local
prefix cache; the Redis tier is its "external" (connector) cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvblocks.adapters.hf_trie import KVCacheTrie

__all__ = ["VllmCollector", "VllmHistograms"]

# vLLM v1's buckets (vllm/v1/metrics/loggers.py), so histogram_quantile over both agrees
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

# kvblocks' histogram -> the vLLM histogram observed with it
MIRRORED = {
    "kvblocks_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "kvblocks_inter_token_seconds": "vllm:inter_token_latency_seconds",
    "kvblocks_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
}


class VllmHistograms:
    """vLLM's request histograms and `vllm:request_success` (by `finished_reason`: stop, length, abort)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        labels = ["model_name"]
        self._histograms = {
            "vllm:time_to_first_token_seconds": Histogram(
                "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                labels, registry=registry, buckets=TTFT_BUCKETS),
            "vllm:inter_token_latency_seconds": Histogram(
                "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                labels, registry=registry, buckets=ITL_BUCKETS),
            "vllm:e2e_request_latency_seconds": Histogram(
                "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                labels, registry=registry, buckets=REQUEST_LATENCY_BUCKETS),
        }  # fmt: skip
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        # every series present at 0 before the first request, as in vLLM (rate() needs a starting point)
        for histogram in self._histograms.values():
            histogram.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)

    def observe(self, kvblocks_name: str, value: float) -> None:
        name = MIRRORED.get(kvblocks_name)
        if name is not None:
            self._histograms[name].labels(self.model_name).observe(value)

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()


class VllmCollector(Collector):
    """vLLM's counters and gauges, read at scrape time from kvblocks' counters, the cache and the load.

    `counters` gives kvblocks' counter values by name; `load` gives (running, waiting)."""

    def __init__(
        self,
        model_name: str,
        counters: Callable[[], dict[str, float]],
        load: Callable[[], tuple[int, int]],
        cache: KVCacheTrie | None,
    ) -> None:
        self.model_name = model_name
        self.counters = counters
        self.load = load
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        label = [self.model_name]
        running, waiting = self.load()
        yield _gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", label, running
        )
        yield _gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", label, waiting
        )
        c = self.counters()
        yield _counter("vllm:prompt_tokens", "Number of prefill tokens processed.", label,
                       c["kvblocks_prompt_tokens_total"])  # fmt: skip
        yield _counter("vllm:generation_tokens", "Number of generation tokens processed.", label,
                       c["kvblocks_generation_tokens_total"])  # fmt: skip
        if self.cache is not None:
            yield from self._cache_families(label)

    def _cache_families(self, label: list[str]) -> Iterator[Metric]:
        s = self.cache.stats()
        yield _gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", label, kv_usage(s)
        )
        yield _counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            label,
            s["queried_tokens"],
        )
        yield _counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                       label, s["hit_tokens"] - s["spill_hit_tokens"])  # fmt: skip
        if self.cache.spill is not None:  # asked of the first tier, whichever answers
            queried = s[f"{self.cache.spill.tiers[0].name}_lookup_chunks"] * self.cache.spill.chunk_tokens
            yield _counter("vllm:external_prefix_cache_queries",
                           "External prefix cache queries from KV connector cross-instance cache sharing, "
                           "in terms of number of queried tokens.", label, queried)  # fmt: skip
            yield _counter("vllm:external_prefix_cache_hits",
                           "External prefix cache hits from KV connector cross-instance cache sharing, "
                           "in terms of number of cached tokens.", label, s["spill_hit_tokens"])  # fmt: skip


def kv_usage(stats: dict[str, int]) -> float:
    """The fraction of the pool held by requests, as vLLM counts it: cached tokens no request holds
    can be evicted at will, so they count as free."""
    capacity = stats["capacity_tokens"]
    held = capacity - stats["free_tokens"] - (stats["resident_tokens"] - stats["locked_tokens"])
    return max(0, held) / capacity if capacity else 0.0


def _gauge(name: str, doc: str, label: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(label, value)
    return family


def _counter(name: str, doc: str, label: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(label, value)
    return family
