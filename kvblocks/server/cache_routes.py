"""Routes outside the OpenAI API: health, metrics and cache inspection (per tenant, off the loop)."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from kvblocks.blocks.explain import explain_blocks as block_explanation
from kvblocks.blocks.segments import flatten
from kvblocks.engine.admission import QueueFullError
from kvblocks.generate.params import GenerationParams
from kvblocks.server import kv_blocks
from kvblocks.server.bounds import check_chars, tokenizing
from kvblocks.server.cost import chat_estimate
from kvblocks.server.errors import APIError, parse_request
from kvblocks.server.guard import error_response
from kvblocks.server.openapi import answers, json_body
from kvblocks.server.schemas import ExplainRequest
from kvblocks.server.state import Served, caller, require_engine_view, scope_of, served
from kvblocks.telemetry.history import tenant_view
from kvblocks.telemetry.metrics import CONTENT_TYPE_LATEST

router = APIRouter()


HEALTH_GENERATE_TIMEOUT_S = 20.0
HEALTH_PROMPT = "ping"
HEALTH_TENANT = "kvblocks:health"  # its own line at the tokenising gate, behind no tenant's burst


@router.get("/health", responses=answers(503))
async def health(request: Request):
    """200 while the server takes work; 503 with the reason while it drains or its engine cannot
    serve, so routers and orchestrators move traffic away."""
    s = served(request)
    problem = unhealthy(s)
    if problem is not None:
        return unavailable(problem)
    return {"status": "ok", "model": s.config.model_name}


@router.get("/health_generate", responses=answers(503))
async def health_generate(request: Request):
    """SGLang's deep check: one token generated through the engine within a time limit. Public, so
    one probe runs at a time and callers within a second of it share its answer: a flood of
    anonymous checks costs the engine at most one token per second."""
    s = served(request)
    probe = getattr(request.app.state, "generation_probe", None)
    if probe is None:
        probe = request.app.state.generation_probe = GenerationProbe()
    problem = await probe.check(s)
    if problem is not None:
        return unavailable(problem)
    return {"status": "ok", "model": s.config.model_name}


class GenerationProbe:
    """The last `/health_generate` answer and when it was taken; one generation in flight at most."""

    def __init__(self, fresh_s: float = 1.0) -> None:
        self.fresh_s = fresh_s
        self._lock = asyncio.Lock()
        self._at = -float("inf")
        self._answer: str | None = None

    async def check(self, s: Served) -> str | None:
        async with self._lock:
            if time.monotonic() - self._at >= self.fresh_s:
                self._answer = unhealthy(s) or await generate_one(s)
                self._at = time.monotonic()
            return self._answer


def unhealthy(s: Served) -> str | None:
    if s.admission.draining:
        return "the server is shutting down"
    return s.engine.health_problem()


def unavailable(reason: str) -> Response:
    return error_response(503, reason, type_="server_error", code="unhealthy")


async def generate_one(s: Served) -> str | None:
    """None once the engine generated a token for a short prompt, else why it did not."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def emit(item) -> None:
        if isinstance(item, BaseException) or item.result is not None:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(item))

    ids = await tokenizing(s.tokenize_gate, HEALTH_TENANT, s.engine.encode, HEALTH_PROMPT)
    try:
        handle = s.engine.submit(ids, emit, params=GenerationParams(max_new_tokens=1, temperature=0.0))
    except QueueFullError as exc:
        return f"the engine cannot take the check: {exc}"
    try:
        item = await asyncio.wait_for(done, HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        return f"the engine generated no token within {HEALTH_GENERATE_TIMEOUT_S:g} s"
    finally:
        handle.cancelled.set()
    if isinstance(item, BaseException):
        return f"generation failed: {type(item).__name__}: {item}"
    return None


@router.get("/metrics", response_class=PlainTextResponse, responses=answers(403))
async def metrics(request: Request):
    require_engine_view(request)
    s = served(request)
    body = await run_in_threadpool(s.engine.metrics.render)  # the cache collector takes the trie's lock
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/cache/stats")
async def cache_stats(request: Request):
    s, who = served(request), caller(request)
    if not who.admin:  # a tenant sees its own counters only, nothing of the others' traffic
        own = (
            None
            if s.engine.cache is None
            else await run_in_threadpool(lambda: s.engine.full_cache.stats(tenant=who.tenant))
        )
        return {"model": s.config.model_name, "tenant": who.tenant, "cache": own}
    stats = None if s.engine.cache is None else await run_in_threadpool(s.engine.full_cache.stats)
    spill = None if s.engine.cache is None else s.engine.cache.spill
    return {
        "model": s.config.model_name,
        "uptime_s": time.time() - s.started,
        "engine": s.engine.stats(),
        "cache": stats,
        # each spill tier, fastest first: name, health, used and capacity bytes, records
        "spill_tiers": None if spill is None else await run_in_threadpool(spill.tier_sizes),
        "counters": s.engine.metrics.counters,
    }


@router.get("/v1/cache/history", responses=answers(400))
async def cache_history(request: Request, since: Annotated[float, Query(gt=0)] = 3600.0):
    """Samples of the last `since` seconds, oldest first; a tenant's key gets its own counters only."""
    s, who = served(request), caller(request)
    samples = s.history.since(time.time() - since)
    if not who.admin:
        samples = [tenant_view(sample, who.tenant) for sample in samples]
    return {"model": s.config.model_name, "interval_s": s.history.interval_s, "samples": samples}


@router.get("/v1/cache/prefixes", responses=answers(400))
async def cache_prefixes(
    request: Request,
    limit: Annotated[int, Query(ge=1, le=1000)] = 10,
    tree: bool = False,
    max_nodes: Annotated[int, Query(ge=1, le=5000)] = 200,
):
    s, who = served(request), caller(request)
    if s.engine.cache is None:
        return {"prefixes": [], "tree": []}
    tenant = None if who.admin else who.tenant

    def listing() -> str:
        # Built and serialised off the event loop (FastAPI's own encoder would run on it), with
        # the collector paused: see gc_paused.
        with gc_paused():
            listed = s.engine.inspect(tenant, limit, tree, max_nodes)
            return json.dumps(listed, ensure_ascii=False)

    return Response(await run_in_threadpool(listing), media_type="application/json")


@router.post("/v1/cache/explain", openapi_extra=json_body(ExplainRequest), responses=answers(400))
async def cache_explain(request: Request):
    s = served(request)
    body = await parse_request(request, ExplainRequest, s.config.lenient)
    if sum(p is not None for p in (body.prompt, body.messages, body.prompt_blocks)) != 1:
        raise APIError(400, "give exactly one of 'prompt', 'messages' or 'prompt_blocks'", param="prompt")
    if body.prompt_blocks is not None or kv_blocks.has_block_parts(body):
        return await explain_blocks(s, request, body)
    if body.messages is None:
        prompt = body.prompt
        if isinstance(prompt, str):
            check_chars(s.prompt_chars, len(prompt), s.engine.max_context, "prompt")
    else:
        chat_estimate(s, body)
        prompt = [{"role": m.role, "content": m.text()} for m in body.messages]
    if s.engine.encoder_decoder:
        return await explain_seq2seq(s, request, body, prompt)
    try:
        ids = await tokenizing(s.tokenize_gate, caller(request).tenant, s.engine.encode, prompt)
    except ValueError as exc:
        raise APIError(400, str(exc), param="prompt") from exc
    if s.engine.cache is None:
        raise APIError(400, "this server runs without a prefix cache")
    if body.decoder_prompt is not None:
        raise APIError(400, "decoder_prompt is for encoder-decoder models only", param="decoder_prompt")
    salt, everyone = scope_of(request, body.cache_salt), caller(request).admin
    result = await run_in_threadpool(
        lambda: s.engine.explain(ids, salt=salt, all_tenants=everyone, prompt_logprobs=body.echo_logprobs)
    )
    return result.as_dict()


async def explain_blocks(s: Served, request: Request, body: ExplainRequest) -> dict:
    """A prompt with KV blocks: the exact prefix explanation of its ids (tokenised segment by
    segment, as a request is), and per block what the block store holds and `kv_mode` would reuse."""
    if s.engine.encoder_decoder or s.engine.cache is None:
        why = "an encoder-decoder model" if s.engine.encoder_decoder else "a server without a prefix cache"
        raise APIError(400, f"KV blocks cannot be explained on {why}", param="prompt_blocks")
    tokenize_gate, tenant = s.tokenize_gate, caller(request).tenant
    if body.messages is None:
        segments = await tokenizing(tokenize_gate, tenant, kv_blocks.completion_block_segments, s, body)
    else:
        chat_estimate(s, body)
        roles = [{"role": m.role} for m in body.messages]
        segments = await tokenizing(tokenize_gate, tenant, kv_blocks.marked_segments, s, body.messages, roles)
    ids, spans = flatten(s.engine.tokenizer, segments)
    mode, share = kv_blocks.kv_mode_of(s, body, True)
    salt, everyone = scope_of(request, body.cache_salt), caller(request).admin

    def both() -> dict:
        exact = s.engine.explain(ids, salt=salt, all_tenants=everyone)
        per_block = block_explanation(s.engine.cache, ids, spans, exact.cached_tokens, salt, mode, share)
        return exact.as_dict() | {"kv_mode": mode, "blend_recompute": share, "blocks": per_block}

    return await run_in_threadpool(both)


async def explain_seq2seq(s: Served, request: Request, body: ExplainRequest, prompt) -> dict:
    """An encoder-decoder request: whether its source's record is held (the encoder then does not
    run), and the decoder-prefix explanation under that source."""
    if s.engine.full_cache is None or body.messages is not None:
        why = (
            "this server runs without a prefix cache" if s.engine.full_cache is None else "chat is not served"
        )
        raise APIError(400, f"{why} (an encoder-decoder model: give 'prompt' and 'decoder_prompt')")
    try:
        source = await tokenizing(s.tokenize_gate, caller(request).tenant, s.engine.encode_source, prompt)
        ids = s.engine.encode(s.engine.decoder_ids(body.decoder_prompt or []))
    except ValueError as exc:
        raise APIError(400, str(exc), param="prompt") from exc
    scope = s.engine.full_cache.scope(source, scope_of(request, body.cache_salt))
    everyone = caller(request).admin
    decoder = await run_in_threadpool(
        lambda: s.engine.explain(ids, salt=scope, all_tenants=everyone).as_dict()
    )
    held = s.engine.full_cache.holds(source, scope)
    return decoder | {"source": {"tokens": len(source), "cached": held, "encoder_would_run": not held}}


_gc_pause_lock = threading.Lock()
_gc_pause = {"depth": 0, "was_enabled": True}


@contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic garbage collection while the block runs (nested and concurrent use are fine).

    A listing of a large trie allocates thousands of dicts; they trigger full collections, and
    a full collection over 100k trie nodes holds the GIL for about 130 ms, stalling the event
    loop. Paused, the listing's objects are freed by reference counting when it ends and the
    collector runs as it would have without the listing.
    """
    with _gc_pause_lock:
        _gc_pause["depth"] += 1
        if _gc_pause["depth"] == 1:
            _gc_pause["was_enabled"] = gc.isenabled()
            gc.disable()
    try:
        yield
    finally:
        with _gc_pause_lock:
            _gc_pause["depth"] -= 1
            if _gc_pause["depth"] == 0 and _gc_pause["was_enabled"]:
                gc.enable()
