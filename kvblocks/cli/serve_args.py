"""`kvblocks serve`'s parser: its flags in groups (access, connections, requests, batching, ...)."""

from __future__ import annotations

import argparse

from kvblocks.cli.args import (
    GRAMMAR_TIMEOUT_S,
    MAX_SCHEMA_DEPTH,
    SCHEMA_BYTES,
    SCHEMA_DEPTH,
    TOOL_PARSERS,
    add_draft_args,
    add_model_args,
)
from kvblocks.cli.serve import cmd_serve


def _serve_access_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("access", "who may call the server and how it is named")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    g.add_argument(
        "--api-key",
        default=None,
        help="one admin key: require 'Authorization: Bearer KEY' (or set KVBLOCKS_API_KEY)",
    )
    g.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help='tenants file {"keys": [{"key": ..., "tenant": ..., "role": "tenant"}]}: each key\'s requests '
        'use and see only its tenant\'s cache; "role": "router" also reads load and metrics, "admin" '
        "everything (or set KVBLOCKS_API_KEYS_FILE)",
    )
    g.add_argument(
        "--served-model-name", default=None, help="model id clients send (default: the model's name)"
    )
    g.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")


def _serve_connection_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connections", "bodies, timeouts and connections")
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 << 20,
        help="largest request body; larger ones get a 413 (default 4 MiB)",
    )
    g.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a request body must arrive within this time, else 408 (default 30)",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, refuse new work (503, /health 503) and let requests in flight finish for up to "
        "this long before the engine stops and the Redis writes are flushed (default 30); streams still "
        "running then end with a server_shutting_down error event",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a request's headers must arrive within this long of the connection opening (or of the "
        "first byte after an idle keep-alive), else the connection is closed (default 10)",
    )
    g.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="an idle keep-alive connection is closed after this long (default 30; keep it above "
        "the clients' own pool expiry, httpx's is 5)",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        metavar="N",
        help="connections served at once in all; one more gets a 503 with Retry-After and is "
        "closed (default 1024; 0: no cap, keep it below the process's open-file limit)",
    )
    g.add_argument(
        "--max-connections-per-client",
        type=int,
        default=256,
        metavar="N",
        help="connections served at once from one client address (default 256; 0: no cap). "
        "Behind a router or proxy every request comes from its address: raise this to "
        "--max-connections or set 0",
    )


def _serve_browser_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("browsers (CORS)")
    g.add_argument(
        "--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
        help="browser origins (e.g. https://app.example.com, or '*') allowed to call the server: CORS "
        "headers and preflights (default: none, the server sends no CORS headers)",
    )  # fmt: skip
    g.add_argument(
        "--allowed-methods", nargs="+", default=["GET", "POST", "DELETE", "OPTIONS"], metavar="METHOD",
        help="methods a browser origin may use (default GET POST DELETE OPTIONS)",
    )  # fmt: skip
    g.add_argument(
        "--allowed-headers", nargs="+", default=["*"], metavar="HEADER",
        help="request headers a browser origin may send (default: any)",
    )  # fmt: skip
    g.add_argument(
        "--allow-credentials", action="store_true",
        help="let browsers send cookies and HTTP auth with CORS requests (not needed for API keys)",
    )  # fmt: skip


def _serve_request_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("requests", "what a request gets when it does not say, and its KV blocks")
    g.add_argument(
        "--default-max-tokens", type=int, default=256, help="max_tokens when a chat request omits it"
    )
    g.add_argument(
        "--lenient",
        action="store_true",
        help="ignore unknown request arguments with a logged warning instead of refusing them with a 400",
    )
    g.add_argument(
        "--tool-parser",
        default=None,
        choices=TOOL_PARSERS,
        help="how tool calls are written by the model (default: detected from its chat template)",
    )
    g.add_argument(
        "--kv-mode",
        default="exact",
        choices=("exact", "blend", "concat"),
        help="how KV blocks (kvblocks_block parts, prompt_blocks) are reused when a request gives no "
        "kv_mode: exact (only as a prefix, output unchanged), blend (re-positioned, a share recomputed) "
        "or concat (re-positioned, nothing recomputed); docs/BLOCKS.md",
    )
    g.add_argument(
        "--blend-recompute",
        type=float,
        default=0.15,
        help="share of each block's tokens kv_mode blend recomputes when a request gives no "
        "blend_recompute (default 0.15)",
    )
    g.add_argument(
        "--max-blocks",
        type=int,
        default=64,
        metavar="N",
        help="KV blocks (kvblocks_block parts, prompt_blocks with block: true) one request may mark "
        "(default 64); more is a 400 before the request is queued",
    )
    g.add_argument(
        "--max-block-tokens",
        type=int,
        default=None,
        metavar="T",
        help="tokens all KV blocks of one request may hold together (default: the model's context); "
        "more is a 400 before the request is queued",
    )
    g.add_argument("--no-cache", action="store_true", help="no prefix reuse: prefill every prompt in full")


def _serve_store_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("stored responses", "/v1/responses entries kept with store: true")
    g.add_argument(
        "--store-max-bytes-per-tenant",
        type=int,
        default=64 << 20,
        metavar="BYTES",
        help="bytes of stored /v1/responses one tenant may keep; its own oldest go first (default 64 MiB)",
    )
    g.add_argument(
        "--store-max-bytes",
        type=int,
        default=512 << 20,
        metavar="BYTES",
        help="bytes of stored /v1/responses all tenants may keep; the tenant most over its share of it "
        "loses its oldest first (default 512 MiB)",
    )
    g.add_argument(
        "--store-ttl",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="how long a stored /v1/responses entry is kept (default 3600)",
    )


def _serve_batch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batching", "the packed engine's forwards")
    g.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        metavar="N",
        help="requests per packed forward (continuous batching over the KV pool; default 16 where the model "
        "has a packed path, else 1); 1: one request per forward with a private cache each",
    )
    g.add_argument(
        "--max-batch-tokens",
        type=int,
        default=80,
        metavar="T",
        help="tokens per packed forward: decode tokens first, then prefill chunks (default 80: a short request "
        "waits at most about one short step behind a long prompt; larger prefills long prompts faster)",
    )
    g.add_argument(
        "--full-batch-tokens",
        type=int,
        default=256,  # scheduler.FULL_BATCH_TOKENS (not imported: the CLI starts without torch)
        metavar="T",
        help="tokens per packed forward while every batch place is taken and nobody waits (default 256): no "
        "request can start then, so longer steps delay no first token and run the linear layers on more rows "
        "at once; at most --max-batch-tokens turns it off",
    )
    g.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --max-batch-size above 1: every request's logits are bit-identical to what it gets alone, "
        "whatever it shares a forward with (prompts cut every 16 tokens, no matrix product under 4 rows; "
        "default on with --device cpu, where it is proven; off elsewhere, where it is not; "
        "both modes read a shared system prompt once per layer for all requests (cascade attention), "
        "the invariant one in blocks cut at fixed positions: --no-batch-invariant cuts exactly where the "
        "shared prompt ends, about 1.1-1.2x faster decode under agents sharing a long prompt)",
    )


def _serve_kernel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("kernels", "how the packed engine runs its layers")
    g.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --max-batch-size above 1 on a CUDA device: replay packed forwards of up to 256 rows "
        "(decode steps, short prompts) from CUDA graphs captured once per padded shape, instead of "
        "launching each kernel from Python (default on with --device cuda; refused elsewhere)",
    )
    g.add_argument(
        "--packed-weights",
        choices=("all", "head", "none"),
        default="all",
        help="with --max-batch-size above 1 on a CPU: which linear layers run on a copy of their weights "
        "reordered once for oneDNN (every layer's weights read once per step at about 3x the speed in "
        "float32, 1.2x in bfloat16, at the cost of the linear weights' size in memory once more): all "
        "(default), head (the output head only) or none; the copy's size is printed at start",
    )


def _serve_limit_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("limits", "bounds on one request and on the queue; more is refused by name")
    g.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        metavar="N",
        help="requests waiting for the engine, all tenants together; more get 429 with Retry-After (default 1024)",
    )
    g.add_argument(
        "--max-waiting-per-tenant",
        type=int,
        default=256,
        metavar="N",
        help="requests one tenant may have waiting (a keys-file entry's max_waiting overrides it; default 256)",
    )
    g.add_argument(
        "--max-prompts",
        type=int,
        default=128,
        metavar="N",
        help="prompts in one completions request; more is a 400 (default 128)",
    )
    g.add_argument(
        "--max-branches",
        type=int,
        default=256,
        metavar="N",
        help="generations one request may start (prompts x best_of, or n); more is a 400 (default 256)",
    )
    g.add_argument(
        "--max-messages",
        type=int,
        default=2048,
        metavar="N",
        help="messages in one chat request (a Responses conversation included); more is a 400 (default "
        "2048, as OpenAI; at most 16384)",
    )
    g.add_argument(
        "--max-input-items",
        type=int,
        default=2048,
        metavar="N",
        help="items in one /v1/responses input; more is a 400 (default 2048, at most 16384)",
    )
    g.add_argument(
        "--max-content-parts",
        type=int,
        default=8192,
        metavar="N",
        help="content parts over all the messages or input items of one request; more is a 400 "
        "(default 8192)",
    )


def _serve_schema_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("structured output", "bounds on a JSON schema and its grammar")
    g.add_argument(
        "--max-schema-bytes",
        type=int,
        default=SCHEMA_BYTES,
        metavar="N",
        help="size of a response_format / text.format JSON schema (or the forced tools' schemas together) "
        f"as JSON; more is a 400 before compiling (default {SCHEMA_BYTES})",
    )
    g.add_argument(
        "--max-schema-depth",
        type=int,
        default=SCHEMA_DEPTH,
        metavar="N",
        help="levels of such a schema: nesting plus $ref hops on its longest non-repeating path; more is "
        f"a 400 before compiling (default {SCHEMA_DEPTH}, at most {MAX_SCHEMA_DEPTH})",
    )
    g.add_argument(
        "--grammar-timeout",
        type=float,
        default=GRAMMAR_TIMEOUT_S,
        metavar="S",
        help="seconds a grammar may take to compile; longer is a 400 naming the field "
        f"(default {GRAMMAR_TIMEOUT_S:g})",
    )


def _serve_telemetry_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("telemetry", "history, metrics, KV events and traces")
    g.add_argument("--history-interval", type=float, default=5.0, metavar="SECONDS",
                   help="seconds between the samples of /v1/cache/history (default 5)")  # fmt: skip
    g.add_argument("--history-window", type=float, default=6 * 3600, metavar="SECONDS",
                   help="how far back /v1/cache/history reaches (default 6 h)")  # fmt: skip
    g.add_argument(
        "--vllm-metrics",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also export /metrics under vLLM's names (vllm:prefix_cache_hits, vllm:num_requests_running, "
        "...) with its model_name label and buckets, for dashboards and autoscalers made for vLLM (default on)",
    )
    g.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="tcp://HOST:PORT",
        help="publish KV events in vLLM's format (ZMQ PUB, msgpack) on this address, which the server "
        "binds, for cache-aware routers (vllm-router --policy kv_aware --kv-event-source URL=ENDPOINT)",
    )
    g.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="tcp://HOST:PORT",
        help="serve missed KV event batches on this address (vllm-router --kv-event-replay-source)",
    )
    g.add_argument(
        "--kv-event-block-size",
        type=int,
        default=16,
        metavar="TOKENS",
        help="tokens per block in KV events; match the router's --kv-event-block-size (default 16)",
    )
    g.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export OpenTelemetry traces over OTLP/HTTP, e.g. http://127.0.0.1:4318/v1/traces: a span per "
        "request with queue, match, spill.fetch, prefill, decode and constrained_decoding children "
        "(needs pip install 'kvblocks[tracing]')",
    )


SERVE_GROUPS = (
    _serve_access_args,
    _serve_connection_args,
    _serve_browser_args,
    _serve_request_args,
    _serve_store_args,
    _serve_batch_args,
    _serve_kernel_args,
    _serve_limit_args,
    _serve_schema_args,
    _serve_telemetry_args,
)


def add_serve_parser(sub) -> None:
    sv = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server with prefix reuse",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /metrics and cache inspection.",
    )
    add_model_args(sv)
    add_draft_args(sv)
    for add in SERVE_GROUPS:
        add(sv)
    sv.set_defaults(func=cmd_serve)
