"""Optional OpenTelemetry traces: a span per request, with children for where its time went.

`kvblocks serve --otlp-traces-endpoint URL` (vLLM's flag) exports, per request, `kvblocks.request`
with the children `queue` (waiting for admission), `match` (the prefix lookup, with `spill.fetch`
inside it when the spill tiers are asked), `prefill` (admission to the first token), `decode` (first
token to the end) and, under a grammar, `constrained_decoding`. Attributes say what the cache gave:
cached tokens per tier and the namespace id (a hash: no tenant name, salt or prompt text).

Off by default, where it costs one attribute read per call and imports nothing: OpenTelemetry is
imported only by `configure`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_tracer: Any = None  # an opentelemetry Tracer once configure() ran
_trace: Any = None  # the opentelemetry.trace module, likewise
_provider: Any = None


class TracingUnavailable(RuntimeError):
    """OpenTelemetry's SDK (and, for an endpoint, its OTLP exporter) is not installed."""


def configure(endpoint: str | None = None, exporter: Any = None) -> None:
    """Export spans to an OTLP/HTTP `endpoint` (e.g. http://127.0.0.1:4318/v1/traces), or to
    `exporter` (tests give the SDK's InMemorySpanExporter, which is exported synchronously)."""
    global _tracer, _trace, _provider
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as exc:
        raise TracingUnavailable("traces need OpenTelemetry: pip install 'kvblocks[tracing]'") from exc
    provider = TracerProvider(resource=Resource.create({"service.name": "kvblocks"}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise TracingUnavailable(
                "--otlp-traces-endpoint needs the OTLP exporter: pip install 'kvblocks[tracing]'"
            ) from exc
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    _provider, _trace, _tracer = provider, trace, provider.get_tracer("kvblocks")


def shutdown() -> None:
    """Flush what is buffered and stop tracing (spans after this are not recorded)."""
    global _tracer, _trace, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _trace = _provider = None


def enabled() -> bool:
    return _tracer is not None


def start(name: str, parent: Any = None, **attributes) -> Any:
    """A started span (None when tracing is off), child of `parent` if given."""
    if _tracer is None:
        return None
    context = None if parent is None else _trace.set_span_in_context(parent)
    return _tracer.start_span(name, context=context, attributes=_clean(attributes))


def end(span: Any, **attributes) -> None:
    if span is not None:
        span.set_attributes(_clean(attributes))
        span.end()


def annotate(span: Any, **attributes) -> None:
    if span is not None:
        span.set_attributes(_clean(attributes))


def current(span: Any):
    """Make `span` the current span inside a `with` block (nothing while tracing is off or `span`
    is None), so spans opened inside nest under it."""
    if _tracer is None or span is None:
        return contextlib.nullcontext()
    return _trace.use_span(span, end_on_exit=False)


@contextlib.contextmanager
def child(name: str, parent: Any = None, **attributes) -> Iterator[Any]:
    """A span around a block: a child of `parent`, else of the current span; it is the current
    span inside the block, so spans opened deeper (a Redis fetch in a lookup) nest under it."""
    if _tracer is None:
        yield None
        return
    span = start(name, parent if parent is not None else _trace.get_current_span(), **attributes)
    with _trace.use_span(span, end_on_exit=True):
        yield span


def _clean(attributes: dict) -> dict:
    return {f"kvblocks.{k}": v for k, v in attributes.items() if v is not None}
