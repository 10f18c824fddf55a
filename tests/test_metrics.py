"""/metrics as Prometheus' own parser reads it: families, types, labels, and values that move with traffic."""

from __future__ import annotations

import httpx
import pytest
from conftest import IdTokenizer, tiny_llama
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from redis_server import RedisServer
from server_proc import start_server, stop_cleanly, tiny_model_dir, wait_idle

from kvblocks import CachedGenerator, KVCacheTrie, RedisTier
from kvblocks.telemetry.metrics import CacheCollector, Metrics
from kvblocks.telemetry.vllm_metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

MODEL = "tiny"


@pytest.fixture(scope="module")
def http():
    server = start_server(
        "--model", str(tiny_model_dir()), "--served-model-name", MODEL, "--capacity", "4096"
    )
    try:
        with server.client() as client:
            yield client
    finally:
        stop_cleanly(server)


def families(client: httpx.Client) -> dict:
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    return {f.name: f for f in text_string_to_metric_families(response.text)}


def value(fams: dict, family: str, sample: str, **labels: str) -> float:
    found = [s.value for s in fams[family].samples if s.name == sample and s.labels == labels]
    assert len(found) == 1, (family, sample, labels, fams[family].samples)
    return found[0]


def complete(client: httpx.Client, prompt: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_metrics_families_have_prometheus_types_and_tier_labels(http):
    fams = families(http)
    expected = {
        "kvblocks_requests": "counter",
        "kvblocks_prompt_tokens": "counter",
        "kvblocks_cached_prompt_tokens": "counter",
        "kvblocks_generation_tokens": "counter",
        "kvblocks_requests_cancelled": "counter",
        "kvblocks_time_to_first_token_seconds": "histogram",
        "kvblocks_inter_token_seconds": "histogram",
        "kvblocks_prefix_cache_queries": "counter",
        "kvblocks_prefix_cache_hit_tokens": "counter",
        "kvblocks_prefix_cache_queried_tokens": "counter",
        "kvblocks_prefix_cache_evicted_tokens": "counter",
        "kvblocks_prefix_cache_resident_tokens": "gauge",
        "kvblocks_prefix_cache_capacity_tokens": "gauge",
    }
    assert {name: fams[name].type for name in expected} == expected
    assert {tuple(s.labels.items()) for s in fams["kvblocks_prefix_cache_hit_tokens"].samples} == {
        (("tier", "device"),)
    }
    assert (
        value(fams, "kvblocks_prefix_cache_capacity_tokens", "kvblocks_prefix_cache_capacity_tokens") == 4096
    )
    assert not any("redis" in name for name in fams)  # no spill tier configured, no Redis series
    bounds = [
        s.labels["le"] for s in fams["kvblocks_time_to_first_token_seconds"].samples if "le" in s.labels
    ]
    assert bounds[-1] == "+Inf" and len(bounds) == 13


def test_metrics_count_requests_cached_tokens_and_latencies(http):
    wait_idle(http)
    before = families(http)
    prompts = ["The prefix cache keeps", "The prefix cache keeps", "An unrelated prompt about tiers"]
    usages = [complete(http, p) for p in prompts]
    wait_idle(http)
    after = families(http)

    def moved(family: str, sample: str, **labels: str) -> float:
        return value(after, family, sample, **labels) - value(before, family, sample, **labels)

    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert cached > 0  # the repeated prompt hit the cache
    assert moved("kvblocks_requests", "kvblocks_requests_total") == len(prompts)
    assert moved("kvblocks_prompt_tokens", "kvblocks_prompt_tokens_total") == prompt_tokens
    assert moved("kvblocks_cached_prompt_tokens", "kvblocks_cached_prompt_tokens_total") == cached
    assert moved("kvblocks_generation_tokens", "kvblocks_generation_tokens_total") == generated
    assert moved("kvblocks_prefix_cache_queries", "kvblocks_prefix_cache_queries_total") == len(prompts)
    hits = "kvblocks_prefix_cache_hit_tokens"
    assert moved(hits, f"{hits}_total", tier="device") == cached
    queried = "kvblocks_prefix_cache_queried_tokens"
    assert moved(queried, f"{queried}_total", tier="device") == prompt_tokens

    ttft = "kvblocks_time_to_first_token_seconds"
    assert moved(ttft, f"{ttft}_count") == len(prompts)
    assert moved(ttft, f"{ttft}_sum") > 0
    assert value(after, ttft, f"{ttft}_bucket", le="+Inf") == value(after, ttft, f"{ttft}_count")
    cumulative = [s.value for s in after[ttft].samples if s.name == f"{ttft}_bucket"]
    assert cumulative == sorted(cumulative)
    itl = "kvblocks_inter_token_seconds"
    assert moved(itl, f"{itl}_count") == generated - len(prompts)

    counters = http.get("/v1/cache/stats").json()["counters"]
    assert type(counters["kvblocks_requests_total"]) is int  # a count, not prometheus_client's float
    assert counters["kvblocks_requests_total"] == value(after, "kvblocks_requests", "kvblocks_requests_total")
    assert counters["kvblocks_prompt_tokens_total"] == value(
        after, "kvblocks_prompt_tokens", "kvblocks_prompt_tokens_total"
    )


def test_vllm_named_metrics_equal_the_servers_own_counters_after_real_requests(http):
    wait_idle(http)
    for prompt in ["A shared system prompt, then a question", "A shared system prompt, then a question"]:
        complete(http, prompt)
    wait_idle(http)
    fams = families(http)
    own = http.get("/v1/cache/stats").json()

    def vllm(family: str, sample: str | None = None, **labels: str) -> float:
        return value(fams, family, sample or family, model_name=MODEL, **labels)

    def kvb(family: str, sample: str, **labels: str) -> float:
        return value(fams, family, sample, **labels)

    assert (
        vllm("vllm:prompt_tokens", "vllm:prompt_tokens_total")
        == own["counters"]["kvblocks_prompt_tokens_total"]
    )
    generated = own["counters"]["kvblocks_generation_tokens_total"]
    assert vllm("vllm:generation_tokens", "vllm:generation_tokens_total") == generated
    queried, hits = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"
    assert vllm(queried, f"{queried}_total") == own["cache"]["queried_tokens"]
    assert vllm(hits, f"{hits}_total") == own["cache"]["hit_tokens"] > 0
    assert fams[queried].type == fams[hits].type == "counter"
    assert vllm("vllm:num_requests_running") == 0 and vllm("vllm:num_requests_waiting") == 0
    c = own["cache"]  # the pool's share held by requests: resident tokens no request locks count as free
    held = c["capacity_tokens"] - c["free_tokens"] - (c["resident_tokens"] - c["locked_tokens"])
    assert vllm("vllm:kv_cache_usage_perc") == held / c["capacity_tokens"] < 0.01
    finished = sum(vllm("vllm:request_success", "vllm:request_success_total", finished_reason=r)
                   for r in ("stop", "length"))  # fmt: skip
    assert finished == own["counters"]["kvblocks_requests_total"]
    assert vllm("vllm:request_success", "vllm:request_success_total", finished_reason="length") >= 2
    for name, mirrored in (
        ("vllm:time_to_first_token_seconds", "kvblocks_time_to_first_token_seconds"),
        ("vllm:inter_token_latency_seconds", "kvblocks_inter_token_seconds"),
        ("vllm:e2e_request_latency_seconds", "kvblocks_e2e_request_latency_seconds"),
    ):
        assert fams[name].type == "histogram"
        assert vllm(name, f"{name}_count") == kvb(mirrored, f"{mirrored}_count") > 0
        assert vllm(name, f"{name}_sum") == pytest.approx(kvb(mirrored, f"{mirrored}_sum"))
    assert vllm("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == finished


def test_vllm_histograms_use_vllms_buckets():
    metrics = Metrics()
    metrics.export_vllm("m", lambda: (0, 0), None)
    fams = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    for name, buckets in (
        ("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
        ("vllm:inter_token_latency_seconds", ITL_BUCKETS),
        ("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS),
    ):
        bounds = [float(s.labels["le"]) for s in fams[name].samples if s.name.endswith("_bucket")]
        assert bounds == [*buckets, float("inf")]
    assert buckets[-1] == 7680.0 and TTFT_BUCKETS[0] == 0.001 and ITL_BUCKETS[0] == 0.01


def test_vllm_metrics_are_off_with_no_vllm_metrics():
    server = start_server("--model", str(tiny_model_dir()), "--capacity", "1024", "--no-vllm-metrics")
    try:
        with server.client() as client:
            assert not any(name.startswith("vllm:") for name in families(client))
    finally:
        stop_cleanly(server)


def test_metrics_objects_keep_separate_registries_and_print_large_values_exactly():
    a, b = Metrics(), Metrics()
    a.inc("kvblocks_prompt_tokens_total", 123_456_789_012)
    b.inc("kvblocks_prompt_tokens_total", 5)
    a.observe("kvblocks_time_to_first_token_seconds", 0.02)
    parsed = {f.name: f for f in text_string_to_metric_families(a.render().decode())}
    assert value(parsed, "kvblocks_prompt_tokens", "kvblocks_prompt_tokens_total") == 123_456_789_012
    assert a.counters["kvblocks_prompt_tokens_total"] == 123_456_789_012
    assert b.counters["kvblocks_prompt_tokens_total"] == 5
    assert a.samples()["kvblocks_time_to_first_token_seconds_count"] == 1
    assert b.samples()["kvblocks_time_to_first_token_seconds_count"] == 0
    with pytest.raises(KeyError):
        a.inc("kvblocks_no_such_counter_total")


def test_a_spilling_cache_reports_its_redis_tier_and_writer_counters(tmp_path):
    server = RedisServer(tmp_path / "redis").start()  # fails, not skips, without Redis
    model, chunk = tiny_llama(), 8
    prompt = " ".join(str(t) for t in range(3, 43))  # 40 tokens: four whole chunks before the last one
    tiers = [RedisTier(server.url, chunk_tokens=chunk) for _ in range(2)]
    try:
        writer = KVCacheTrie.for_model(model, capacity_tokens=1000, spill=tiers[0])
        CachedGenerator(model, IdTokenizer(), writer).generate(prompt, max_new_tokens=2)
        tiers[0].flush(timeout_s=5)
        reader = KVCacheTrie.for_model(model, capacity_tokens=1000, spill=tiers[1])  # cold: only Redis has it
        result = CachedGenerator(model, IdTokenizer(), reader).generate(prompt, max_new_tokens=2)
        scraped = []
        for cache in (writer, reader):
            metrics = Metrics()
            metrics.register(CacheCollector(cache))
            scraped.append({f.name: f for f in text_string_to_metric_families(metrics.render().decode())})
    finally:
        for tier in tiers:
            tier.close()
        server.stop()
    wrote, read = scraped
    written = value(wrote, "kvblocks_redis_written_chunks", "kvblocks_redis_written_chunks_total")
    assert wrote["kvblocks_redis_written_chunks"].type == "counter" and written >= 4
    hits, queried = "kvblocks_prefix_cache_hit_tokens", "kvblocks_prefix_cache_queried_tokens"
    assert result.cached_tokens == 4 * chunk
    assert value(read, hits, f"{hits}_total", tier="redis") == result.cached_tokens
    assert value(read, hits, f"{hits}_total", tier="device") == 0
    assert value(read, queried, f"{queried}_total", tier="redis") % chunk == 0
    assert value(read, queried, f"{queried}_total", tier="redis") >= result.cached_tokens
    quiet = ("errors", "verify_failures", "write_drops", "rejected_size", "rejected_type", "write_retried")
    for name in (f"kvblocks_redis_{what}" for what in quiet):
        assert value(read, name, f"{name}_total") == 0
