"""OpenTelemetry traces: a span per request, children for queue, match, spill-tier fetch, prefill,
decode and constrained decoding, cache attributes without tenant data.

In process with the SDK's in-memory exporter (a host tier and a real Redis server behind the trie),
then through
`kvblocks serve --otlp-traces-endpoint` against a small OTLP/HTTP receiver on loopback.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import httpx
import pytest
import torch
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from server_proc import start_server, stop_cleanly, tiny_model_dir
from tiny_models import tiny_model

from kvblocks import CachedGenerator, GenerationParams, KVCacheTrie, Scope
from kvblocks.engine.batch import BatchEngine
from kvblocks.generate.text import IdTokenizer
from kvblocks.spill.host import HostTier
from kvblocks.spill.redis_tier import redis_store
from kvblocks.spill.stack import TierStack
from kvblocks.telemetry import tracing

TENANT = "acme-payroll"
PROMPT = list(range(3, 3 + 96))


class Anything:
    """A constraint that allows every token and never ends: it only marks the request constrained."""

    def start(self):
        return self

    def mask(self, logits: torch.Tensor) -> None:
        pass

    def advance(self, token: int) -> None:
        pass

    def done(self) -> bool:
        return False


@pytest.fixture
def exporter():
    memory = InMemorySpanExporter()
    tracing.configure(exporter=memory)
    yield memory
    tracing.shutdown()


@pytest.fixture(scope="module")
def redis_url(module_redis_server):
    return module_redis_server.url


def run(engine: BatchEngine, params: GenerationParams, salt=None) -> None:
    done = threading.Event()
    engine.submit(PROMPT, lambda item: done.set() if getattr(item, "result", None) else None,
                  params=params, salt=salt)  # fmt: skip
    assert done.wait(60)


def engine_for(model, cache: KVCacheTrie) -> BatchEngine:
    return BatchEngine(CachedGenerator(model, IdTokenizer(), cache), max_batch_size=2).start()


def cache_for(model, redis_url: str) -> KVCacheTrie:
    """A trie over a host-memory tier of its own and the shared Redis, as one process has."""
    stack = TierStack([HostTier(16 << 20), redis_store(redis_url)], chunk_tokens=16)
    return KVCacheTrie.for_model(model, capacity_tokens=1024, spill=stack)


def test_a_request_restored_from_redis_has_its_phases_as_nested_spans(exporter, redis_url):
    model = tiny_model("llama", torch.float32)
    salt = Scope(TENANT, "")
    # both caches first: the namespace covers the model's config, which the packed path's attention
    # dispatcher changes once an engine is built
    first, second = cache_for(model, redis_url), cache_for(model, redis_url)
    writer = engine_for(model, first)
    run(writer, GenerationParams(max_new_tokens=2), salt)
    writer.stop()
    writer.generator.cache.close()  # its chunks are in Redis now
    exporter.clear()
    reader = engine_for(model, second)  # as a second process: an empty pool, the same Redis
    try:
        run(reader, GenerationParams(max_new_tokens=4, constraint=Anything()), salt)
    finally:
        reader.stop()
        reader.generator.cache.close()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {
        "kvblocks.request",
        "queue",
        "prefill",
        "match",
        "spill.fetch",
        "decode",
        "constrained_decoding",
    } <= set(spans)
    root = spans["kvblocks.request"]
    for phase in ("queue", "prefill", "decode", "constrained_decoding"):
        assert spans[phase].parent.span_id == root.context.span_id, phase
    assert spans["match"].parent.span_id == spans["prefill"].context.span_id
    fetch = spans["spill.fetch"]
    assert fetch.parent.span_id == spans["match"].context.span_id
    # the reader's own host tier is empty: every token past the device's came from Redis
    restored = fetch.attributes["kvblocks.spill_tokens"]
    assert restored >= 64 and fetch.attributes["kvblocks.device_tokens"] + restored <= len(PROMPT)
    assert fetch.attributes["kvblocks.redis_tokens"] == restored
    assert fetch.attributes["kvblocks.host_tokens"] == 0
    assert spans["match"].attributes["kvblocks.cached_tokens"] >= 64
    assert root.attributes["kvblocks.cached_tokens"] >= 64
    assert root.attributes["kvblocks.finish_reason"] == "length"
    assert root.attributes["kvblocks.completion_tokens"] == 4
    values = [str(v) for s in spans.values() for v in s.attributes.values()]
    assert not any(TENANT in v for v in values), "a span names the tenant"


def test_tracing_off_records_nothing_and_costs_no_spans():
    assert not tracing.enabled()
    assert tracing.start("kvblocks.request") is None
    with tracing.child("match") as span:
        assert span is None


class Receiver(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: keeps the span names of every export it is sent."""

    names: ClassVar[list[str]] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest.FromString(body)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                Receiver.names += [s.name for s in scope.spans]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_serve_exports_its_spans_over_otlp_http():
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}/v1/traces"
    server = start_server("--model", str(tiny_model_dir()), "--served-model-name", "tiny",
                          "--otlp-traces-endpoint", endpoint)  # fmt: skip
    try:
        r = httpx.post(
            f"{server.url}/v1/completions", json={"prompt": "hello there", "max_tokens": 3}, timeout=60
        )
        assert r.status_code == 200
    finally:
        stop_cleanly(server)  # the shutdown flushes what the batch processor still holds
        receiver.shutdown()
    assert {"kvblocks.request", "queue", "prefill", "match", "decode"} <= set(Receiver.names), Receiver.names
