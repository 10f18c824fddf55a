"""`kvblocks serve`: an OpenAI-compatible HTTP sidecar over the engine.

The server speaks HTTP and JSON only: it validates requests, tokenises prompts (to reject bad ones
with a 4xx before they queue), hands token ids and options to the engine and relays pieces as JSON
or SSE. Routes live in `openai_routes` (the OpenAI API) and `cache_routes` (health, metrics, cache
inspection); what they share is `app.state.served`.
"""

from __future__ import annotations

import gc
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Match

from kvblocks.engine.frontend import Frontend
from kvblocks.generate import grammar, tools
from kvblocks.server import (
    block_routes,
    cache_routes,
    openai_routes,
    openapi,
    responses_routes,
    worker_routes,
)
from kvblocks.server.bounds import char_limit
from kvblocks.server.cost import measure
from kvblocks.server.errors import APIError, validation_error
from kvblocks.server.guard import GuardConfig, RequestGuard, error_response
from kvblocks.server.parsing import BodyParser
from kvblocks.server.response_store import EVICTION_REASONS
from kvblocks.server.state import Served, ServerConfig
from kvblocks.telemetry import tracing
from kvblocks.telemetry.history import History, sample_of
from kvblocks.telemetry.metrics import TenantHoldingsCollector


def create_app(engine: Frontend, config: ServerConfig) -> FastAPI:
    served = Served(engine, config)
    served.history = History(lambda: take_sample(served), config.history_interval_s, config.history_window_s)
    if config.vllm_metrics:
        engine.metrics.export_vllm(config.model_name, lambda: running_waiting(engine), engine.cache)
    engine.metrics.register(TenantHoldingsCollector(lambda: holdings(served)))

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await run_in_threadpool(warm_up, served)
        await run_in_threadpool(app.state.body_parser.start)
        served.history.start()
        yield
        served.history.stop()
        await run_in_threadpool(app.state.body_parser.stop)
        # Once requests are done (drained, see `serving.DrainingServer`): stop the engine (closing
        # streams commits their tokens) and flush the spill tier's write queue.
        await run_in_threadpool(engine.stop)
        if engine.cache is not None:
            await run_in_threadpool(engine.cache.close)
        await run_in_threadpool(tracing.shutdown)  # exports the spans still buffered

    app = FastAPI(
        title="kvblocks",
        version="0.1.0",
        description="OpenAI-compatible server with prefix reuse",
        lifespan=lifespan,
    )
    app.state.served = served
    app.state.body_parser = BodyParser()
    routers = [
        openai_routes.router,
        responses_routes.router,
        cache_routes.router,
        worker_routes.router,
        block_routes.router,
    ]
    for router in routers:
        app.include_router(router)
    app.state.routes = [route for router in routers for route in router.routes]  # for `Allow` on 405s
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    openapi.install(app, keyed=config.keys is not None, model_name=config.model_name)
    guard = GuardConfig(config.keys, config.max_body_bytes, config.read_timeout_s, served.admission)
    app.add_middleware(RequestGuard, config=guard)
    if config.cors is not None:  # outermost: preflights carry no API key, and errors get the headers too
        cors = config.cors
        app.add_middleware(
            CORSMiddleware, allow_origins=list(cors.origins), allow_methods=list(cors.methods),
            allow_headers=list(cors.headers), allow_credentials=cors.credentials,
            expose_headers=["Retry-After"],
        )  # fmt: skip
    return app


def take_sample(served: Served) -> dict:
    cache = served.engine.cache
    stats = None if cache is None else cache.stats()
    tenants = {} if cache is None else cache.tenant_counters()
    engine = served.engine
    return sample_of(stats, tenants, engine.active, engine.queued, engine.metrics.counters)


def holdings(served: Served) -> dict:
    """What `TenantHoldingsCollector` exports: stored responses and pins, per tenant."""
    store, pins = served.response_store(), served.pins
    return {
        "stored_bytes": store.bytes_by_tenant(),
        "stored_responses": store.entries_by_tenant(),
        "stored_evicted": {reason: store.evicted[reason] for reason in EVICTION_REASONS},
        "stored_refused": store.refused,
        "pinned_tokens": {} if pins is None else pins.pinned_by_tenant(),
        "pins_refused": {} if pins is None else dict(pins.refused),
    }


def running_waiting(engine: Frontend) -> tuple[int, int]:
    load = engine.load()
    return load.running, load.waiting


async def api_error(_: Request, exc: APIError):
    return exc.response()


async def invalid_request(_: Request, exc: RequestValidationError):
    """Query-parameter errors (bodies are validated by `errors.parse_request`)."""
    return validation_error(exc.errors()).response()


async def http_error(request: Request, exc: StarletteHTTPException):
    headers = exc.headers
    if exc.status_code == 405:
        allowed = allowed_methods(request)
        headers = {**(headers or {}), "Allow": ", ".join(sorted(allowed))}
    return error_response(exc.status_code, str(exc.detail), headers=headers)


def allowed_methods(request: Request) -> set[str]:
    """Every method some route serves at the request's path: Starlette's own `Allow` names only the
    first matching route's (GET but not DELETE on /v1/responses/{id})."""
    methods: set[str] = set()
    for route in request.app.state.routes:
        if route.matches(request.scope)[0] is not Match.NONE:
            methods |= route.methods
    return methods


def warm_up(served: Served) -> None:
    """Build once what the first tool or JSON request would otherwise wait for (about a second),
    the prompt length bounds (a second more: every token is decoded once; the chat template's
    cost per message, by rendering a few messages) and the system
    fingerprint (a hash of the weights when there is no cache namespace to take it from)."""
    tokenizer = served.engine.tokenizer
    grammar.ll_tokenizer(tokenizer)
    tools.template_supports_tools(tokenizer)
    parser = tools.get_parser(served.config.tool_parser or tools.detect_parser(tokenizer))

    def render(messages: list[dict]) -> list[int]:
        return served.engine.encode(tools.render_messages(tokenizer, messages, None, parser))

    served.template_cost = measure(tokenizer, None if served.engine.encoder_decoder else render)
    served.prompt_chars = char_limit(served.template_cost.token_bytes, served.engine.max_context)
    served.system_fingerprint()


def freeze_startup_objects() -> None:
    """Move everything alive at start (torch, transformers, the model: about a million objects)
    into the collector's permanent generation. A full collection scans every tracked object; with
    them it stalls the event loop for hundreds of milliseconds, without them only the trie's own
    nodes are scanned. Frozen objects are still freed by reference counting."""
    gc.collect()
    gc.freeze()
