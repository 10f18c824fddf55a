"""`kvblocks serve`: an OpenAI-compatible HTTP sidecar over the engine.

The server speaks HTTP and JSON only: it validates requests, tokenises prompts (to reject bad ones
with a 4xx before they queue), hands token ids to the engine and relays pieces as JSON or SSE.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvblocks.auth import ApiKeys, Principal
from kvblocks.engine import Engine
from kvblocks.explain import explain
from kvblocks.generator import CachedGenerator, Piece
from kvblocks.guard import GuardConfig, RequestGuard, error_response, principal_of
from kvblocks.namespace import Scope
from kvblocks.text import PromptError

# ---- errors ----------------------------------------------------------------------------------


class APIError(Exception):
    """An OpenAI-style error: status, message, type, param, code."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


# ---- request schemas -------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-(1 << 63), lt=1 << 64)] | None = None  # what torch accepts
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    cache_salt: Annotated[str, Field(max_length=256)] | None = None

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] = 16


class ExplainRequest(_Strict):
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    cache_salt: str | None = None


# ---- app -------------------------------------------------------------------------------------


@dataclass(slots=True)
class ServerConfig:
    """`keys` None: an open server (every caller is an admin of the default tenant)."""

    model_name: str
    keys: ApiKeys | None = None
    default_max_tokens: int = 256
    max_body_bytes: int = 4 << 20
    read_timeout_s: float = 30.0


def scope_of(request: Request, cache_salt: str | None) -> Scope:
    """The request's place in the cache: its key's tenant, refined by its own cache_salt."""
    return Scope(principal_of(request.scope).tenant, cache_salt or "")


def caller(request: Request) -> Principal:
    return principal_of(request.scope)


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    gen: CachedGenerator = engine.generator
    cache = gen.cache
    started = time.time()

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        # uvicorn re-raises SIGTERM after its graceful shutdown, so code after `uvicorn.run()` never
        # runs: stop the engine (closing streams commits their tokens) and flush the spill tier here.
        await run_in_threadpool(engine.stop)
        if cache is not None:
            await run_in_threadpool(cache.close)

    app = FastAPI(
        title="kvblocks",
        version="0.1.0",
        description="OpenAI-compatible server with prefix reuse",
        lifespan=lifespan,
    )

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message, where = "request body is not valid JSON", None
        return APIError(400, f"{where}: {message}" if where else message, param=where).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), code=None).response()

    app.add_middleware(
        RequestGuard, config=GuardConfig(config.keys, config.max_body_bytes, config.read_timeout_s)
    )

    def check_model(name: str) -> None:
        if name != config.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{config.model_name}'",
                           param="model", code="model_not_found")  # fmt: skip

    async def encode(prompt) -> list[int]:
        try:
            return await run_in_threadpool(gen.encode, prompt)
        except PromptError as exc:
            raise APIError(400, str(exc), param="prompt") from exc

    def budget(ids: list[int], requested: int | None) -> int:
        room = (gen.max_context or 1 << 30) - len(ids)
        wanted = requested if requested is not None else min(config.default_max_tokens, room)
        if wanted > room:
            raise APIError(
                400,
                f"max_tokens is {wanted} but the prompt has {len(ids)} tokens and the model's context is "
                f"{gen.max_context}; at most {room} tokens can be generated",
                param="max_tokens",
            )
        return wanted

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": config.model_name}

    @app.get("/v1/models")
    async def list_models():
        card = {"id": config.model_name, "object": "model", "created": int(started), "owned_by": "kvblocks"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = await encode(messages)
        limit = budget(ids, body.max_completion_tokens or body.max_tokens)
        return await respond(request, body, ids, limit, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        ids = await encode(body.prompt)
        limit = budget(ids, body.max_tokens)
        return await respond(request, body, ids, limit, chat=False)

    async def respond(request: Request, body: _Sampling, ids: list[int], limit: int, chat: bool):
        options = dict(
            max_new_tokens=limit,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=body.stop,
            seed=body.seed,
            salt=scope_of(request, body.cache_salt),
        )
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        events = submit(ids, options, watch=None if body.stream else request)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                sse(events, rid, chat, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        result = None
        try:
            async for piece in events:
                result = piece.result
        finally:
            await events.aclose()
        if result is None:  # the client went away; nobody reads this
            return JSONResponse({"error": {"message": "client closed the request"}}, status_code=499)
        created = int(time.time())
        choice: dict[str, Any] = {"index": 0, "finish_reason": result.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": result.text}
            obj = "chat.completion"
        else:
            choice["text"] = result.text
            obj = "text_completion"
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": config.model_name,
            "choices": [choice],
            "usage": usage(result),
        }

    def submit(ids: list[int], options: dict, watch: Request | None = None) -> AsyncIterator[Piece]:
        """Queue a request; its pieces as an async iterator. With `watch`, a client that goes away
        cancels the request at the engine's next step (streams are cancelled by Starlette itself
        when their writes fail)."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        handle = engine.submit(ids, lambda item: loop.call_soon_threadsafe(inbox.put_nowait, item), **options)

        async def watch_disconnect(request: Request) -> None:
            # The body was read already: the next message this request receives is its disconnect.
            while (await request.receive())["type"] != "http.disconnect":
                pass
            handle.cancelled.set()
            inbox.put_nowait(None)

        async def events() -> AsyncIterator[Piece]:
            watcher = None if watch is None else asyncio.create_task(watch_disconnect(watch))
            try:
                while True:
                    item = await inbox.get()
                    if item is None:  # the client went away
                        return
                    if isinstance(item, BaseException):
                        raise APIError(500, f"generation failed: {item}", type_="server_error")
                    yield item
                    if item.result is not None:
                        return
            finally:
                handle.cancelled.set()  # a no-op once finished; frees the slot and its locks otherwise
                if watcher is not None:
                    watcher.cancel()

        return events()

    async def sse(
        events: AsyncIterator[Piece], rid: str, chat: bool, include_usage: bool
    ) -> AsyncIterator[str]:
        created = int(time.time())
        base = {"id": rid, "created": created, "model": config.model_name}
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
                if text:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return "data: " + json.dumps({**base, "object": obj, "choices": [choice]}) + "\n\n"

        try:
            if chat:
                yield chunk(None, None, first=True)
            async for piece in events:
                if piece.result is None:
                    if piece.text:
                        yield chunk(piece.text, None)
                    continue
                yield chunk(piece.text, piece.result.finish_reason)
                if include_usage:
                    yield (
                        "data: "
                        + json.dumps({**base, "object": obj, "choices": [], "usage": usage(piece.result)})
                        + "\n\n"
                    )
            yield "data: [DONE]\n\n"
        except APIError as exc:
            yield "data: " + json.dumps({"error": {"message": exc.message, "type": exc.type}}) + "\n\n"
        finally:
            await events.aclose()

    def usage(result) -> dict:
        return {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(result.token_ids),
            "total_tokens": result.prompt_tokens + len(result.token_ids),
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
        }

    # ---- cache inspection ------------------------------------------------------------------

    @app.get("/v1/cache/stats")
    async def cache_stats(request: Request):
        who = caller(request)
        if not who.admin:  # a tenant sees its own counters only, nothing of the others' traffic
            own = None if cache is None else await run_in_threadpool(lambda: cache.stats(tenant=who.tenant))
            return {"model": config.model_name, "tenant": who.tenant, "cache": own}
        stats = None if cache is None else await run_in_threadpool(cache.stats)
        return {
            "model": config.model_name,
            "uptime_s": time.time() - started,
            "engine": {"active": engine.active, "queued": engine.queued},
            "cache": stats,
            "counters": dict(engine.metrics.counters),
        }

    @app.get("/v1/cache/prefixes")
    async def cache_prefixes(
        request: Request,
        limit: Annotated[int, Query(ge=1, le=1000)] = 10,
        tree: bool = False,
        max_nodes: Annotated[int, Query(ge=1, le=5000)] = 200,
    ):
        if cache is None:
            return {"prefixes": [], "tree": []}
        who = caller(request)
        tenant = None if who.admin else who.tenant
        # Built and serialised off the event loop: on a large trie both take a while (FastAPI's
        # own encoder would run on the loop), and /health must not wait for them.
        body = await run_in_threadpool(
            lambda: json.dumps(inspect_prefixes(gen, tenant, limit, tree, max_nodes), ensure_ascii=False)
        )
        return Response(body, media_type="application/json")

    @app.post("/v1/cache/explain")
    async def cache_explain(body: ExplainRequest, request: Request):
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        prompt = (
            body.prompt
            if body.messages is None
            else [{"role": m.role, "content": m.text()} for m in body.messages]
        )
        ids = await encode(prompt)
        if cache is None:
            raise APIError(400, "this server runs without a prefix cache")
        result = await run_in_threadpool(
            lambda: explain(
                cache,
                gen.tokenizer,
                ids,
                salt=scope_of(request, body.cache_salt),
                all_tenants=caller(request).admin,
            )
        )
        return result.as_dict()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            engine.metrics.render(cache_metrics(cache)), media_type="text/plain; version=0.0.4"
        )

    return app


def freeze_startup_objects() -> None:
    """Move everything alive at start (torch, transformers, the model: about a million objects)
    into the collector's permanent generation. A full collection scans every tracked object; with
    them it stalls the event loop for hundreds of milliseconds, without them only the trie's own
    nodes are scanned. Frozen objects are still freed by reference counting."""
    gc.collect()
    gc.freeze()


def preview(head: str, tail: str, elided: bool) -> str:
    return f"{head} … {tail}" if elided else head


def inspect_prefixes(
    gen: CachedGenerator, tenant: str | None, limit: int, tree: bool, max_nodes: int
) -> dict:
    """The most-hit prefixes and the trie's shape with text previews: all of them (tenant None,
    an admin) or one tenant's, which then sees neither the text nor the namespace keys of others."""
    decode = gen.tokenizer.decode
    top = []
    for p in gen.cache.top_prefixes(limit, tenant=tenant):
        ids = p.pop("token_ids")
        p["preview"] = preview(
            decode(ids[:48], skip_special_tokens=False),
            decode(ids[-48:], skip_special_tokens=False),
            len(ids) > 96,
        )
        top.append(p)
    nodes = gen.cache.tree(max_nodes, tenant=tenant) if tree else []
    for node in nodes:
        node["preview"] = decode(node.pop("run_ids"), skip_special_tokens=False)
    return {"prefixes": top, "tree": nodes}


def cache_metrics(cache) -> dict[str, tuple[str, dict[str, str], float]]:
    """Cache counters and gauges for /metrics, hit and queried tokens labelled by tier."""
    if cache is None:
        return {}
    s = cache.stats()
    device_hits = s["hit_tokens"] - s["spill_hit_tokens"]
    out = {
        "kvblocks_prefix_cache_queries_total": ("Prefix-cache lookups.", {}, s["queries"]),
        'kvblocks_prefix_cache_queried_tokens_total{tier="device"}': (
            "Prompt tokens looked up, per tier.", {"tier": "device"}, s["queried_tokens"]),
        'kvblocks_prefix_cache_hit_tokens_total{tier="device"}': (
            "Prompt tokens served from cache, per tier.", {"tier": "device"}, device_hits),
        "kvblocks_prefix_cache_inserted_tokens_total": ("Tokens stored in the device pool.", {}, s["inserted_tokens"]),
        "kvblocks_prefix_cache_evicted_tokens_total": ("Tokens evicted from the device pool.", {}, s["evicted_tokens"]),
        "kvblocks_prefix_cache_resident_tokens": ("Tokens resident in the device pool.", {}, s["resident_tokens"]),
        "kvblocks_prefix_cache_resident_bytes": ("KV bytes resident in the device pool.", {}, s["resident_bytes"]),
        "kvblocks_prefix_cache_capacity_tokens": ("Device pool capacity in tokens.", {}, s["capacity_tokens"]),
        "kvblocks_prefix_cache_pinned_tokens": ("Pinned tokens.", {}, s["pinned_tokens"]),
        "kvblocks_prefix_cache_locked_tokens": ("Tokens locked by running requests.", {}, s["locked_tokens"]),
    }  # fmt: skip
    if "redis_lookups" in s:
        chunk = cache.spill.chunk_tokens
        out |= {
            'kvblocks_prefix_cache_queried_tokens_total{tier="redis"}': (
                "Prompt tokens looked up, per tier.", {"tier": "redis"}, s["redis_lookup_chunks"] * chunk),
            'kvblocks_prefix_cache_hit_tokens_total{tier="redis"}': (
                "Prompt tokens served from cache, per tier.", {"tier": "redis"}, s["spill_hit_tokens"]),
            "kvblocks_redis_errors_total": ("Redis operations that failed (read or write).", {}, s["redis_errors"]),
            "kvblocks_redis_verify_failures_total": (
                "Redis values rejected by verification.", {}, s["redis_verify_failures"]),
            "kvblocks_redis_written_chunks_total": ("Chunks written to Redis.", {}, s["redis_written_chunks"]),
            "kvblocks_redis_write_drops_total": ("Chunk writes dropped (queue full or Redis down).", {}, s["redis_write_drops"]),
        }  # fmt: skip
    return out
