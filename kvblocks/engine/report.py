"""What the engine tells the outside about its requests: metrics and trace spans, one place for both."""

from __future__ import annotations

import time
from typing import Any

from kvblocks.engine.request import Request
from kvblocks.generate.decoding import GenerationResult
from kvblocks.telemetry import tracing
from kvblocks.telemetry.metrics import Metrics


class Reporter:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def observe(self, request: Request, tokens: int) -> float:
        """Time `tokens` new tokens of `request`: TTFT (queueing included, what the client waits for)
        or the gap since its last token. Returns the time."""
        now = time.perf_counter()
        if request.last_token_at:
            self.metrics.observe("kvblocks_inter_token_seconds", now - request.last_token_at)
        else:
            self.metrics.observe("kvblocks_time_to_first_token_seconds", now - request.submitted)
            trace_first_token(request)
        request.last_token_at = now
        request.tokens += tokens
        return now

    def record(self, request: Request, r: GenerationResult) -> None:
        """A finished request's counters and the end of its trace."""
        m = self.metrics
        m.finished(r.finish_reason, time.perf_counter() - request.submitted)
        m.inc("kvblocks_prompt_tokens_total", r.prompt_tokens)
        m.inc("kvblocks_cached_prompt_tokens_total", r.cached_tokens)
        m.inc("kvblocks_generation_tokens_total", len(r.token_ids))
        if r.blocks is not None:
            for tier, n in r.blocks.reused_by_tier.items():
                m.inc("kvblocks_block_reused_tokens_total", n, tier=tier)
            m.inc("kvblocks_block_recomputed_tokens_total", r.blocks.recomputed_tokens)
            m.inc("kvblocks_block_fill_tokens_total", r.blocks.block_fill_tokens)
            m.inc("kvblocks_block_probe_tokens_total", r.blocks.probe_tokens)
        if r.spec is not None:
            m.inc("kvblocks_spec_drafted_tokens_total", r.spec.drafted)
            m.inc("kvblocks_spec_accepted_tokens_total", r.spec.accepted)
            m.inc("kvblocks_spec_rounds_total", r.spec.rounds)
            m.inc("kvblocks_spec_emitted_tokens_total", r.spec.emitted)
            m.inc("kvblocks_spec_tree_rounds_total", r.spec.tree_rounds)
        trace_ended(
            request,
            outcome="finished",
            finish_reason=r.finish_reason,
            prompt_tokens=r.prompt_tokens,
            cached_tokens=r.cached_tokens,
            completion_tokens=len(r.token_ids),
        )

    def cancelled(self) -> None:
        self.metrics.inc("kvblocks_requests_cancelled_total")

    def failed(self) -> None:
        self.metrics.inc("kvblocks_requests_failed_total")


# ---- traces (kvblocks.telemetry.tracing; each a no-op while tracing is off) ------------------------------


def trace_submitted(request: Request) -> None:
    if tracing.enabled():
        root = tracing.start("kvblocks.request", request_id=request.id, prompt_tokens=request.tokens or None)
        request.spans = {"request": root, "queue": tracing.start("queue", root)}


def trace_admitted(request: Request) -> None:
    """Out of the queue; the prefill starts (again, after a preemption before its first token)."""
    if request.spans:
        tracing.end(request.spans.pop("queue", None))
        if "decode" not in request.spans and "prefill" not in request.spans:
            request.spans["prefill"] = tracing.start("prefill", request.spans["request"])


def trace_first_token(request: Request) -> None:
    if request.spans and "decode" not in request.spans:
        tracing.end(request.spans.pop("prefill", None))
        root = request.spans["request"]
        request.spans["decode"] = tracing.start("decode", root)
        if request.options.params.constraint is not None:
            request.spans["constrained"] = tracing.start("constrained_decoding", root)


def trace_ended(request: Request, **attributes: Any) -> None:
    if request.spans:
        for phase in ("queue", "prefill", "constrained", "decode"):
            tracing.end(request.spans.pop(phase, None))
        tracing.end(request.spans.pop("request"), **attributes)
