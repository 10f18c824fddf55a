"""`kvblocks serve`: the socket bound first, the checks that need no model, then the model, cache,
engine and app."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from kvblocks.cli.args import MAX_SCHEMA_DEPTH
from kvblocks.cli.build import (
    batch_invariant,
    batch_size,
    build_engine,
    build_generator,
    check_kv_mode,
    cuda_graphs,
    load_stack,
    packed_note,
    quantized_note,
    serve_dtype,
)
from kvblocks.errors import UserError


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything heavy is imported or loaded, so a busy port
    fails in a moment rather than after a minute of loading. OSError when the address is taken."""
    sock = socket.socket(family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restarts reuse TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def cors_config(args: argparse.Namespace):
    """`--allowed-origins` and its companions, or None (no CORS)."""
    if not args.allowed_origins:
        return None
    from kvblocks.server.state import CorsConfig

    if args.allow_credentials and "*" in args.allowed_origins:
        raise UserError("--allow-credentials needs explicit --allowed-origins, not '*' (browsers refuse it)")
    return CorsConfig(
        tuple(args.allowed_origins), tuple(m.upper() for m in args.allowed_methods),
        tuple(args.allowed_headers), args.allow_credentials,
    )  # fmt: skip


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        raise UserError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from exc
    # what can be refused without the model is refused before torch is imported
    keys = load_api_keys(args)
    if args.max_body_bytes < 1024:
        raise UserError(f"--max-body-bytes must be at least 1024, got {args.max_body_bytes}")
    if args.read_timeout <= 0:
        raise UserError(f"--read-timeout must be positive, got {args.read_timeout:g}")
    if args.drain_timeout < 0:
        raise UserError(f"--drain-timeout must be 0 or more, got {args.drain_timeout:g}")
    for flag, seconds in (
        ("--header-timeout", args.header_timeout),
        ("--keep-alive-timeout", args.keep_alive_timeout),
    ):
        if seconds <= 0:
            raise UserError(f"{flag} must be positive, got {seconds:g}")
    for flag, cap in (
        ("--max-connections", args.max_connections),
        ("--max-connections-per-client", args.max_connections_per_client),
    ):
        if cap < 0:
            raise UserError(f"{flag} must be 0 (no cap) or more, got {cap}")
    cors = cors_config(args)
    if not 1024 <= args.store_max_bytes_per_tenant <= args.store_max_bytes:
        raise UserError("need 1024 <= --store-max-bytes-per-tenant <= --store-max-bytes")
    if args.store_ttl <= 0:
        raise UserError(f"--store-ttl must be positive, got {args.store_ttl:g}")
    from kvblocks import models
    from kvblocks.engine.batch import check_settings
    from kvblocks.engine.frontend import Frontend
    from kvblocks.generate.grammar import GrammarLimits
    from kvblocks.server import ServerConfig, create_app, freeze_startup_objects
    from kvblocks.server.cost import CountCaps
    from kvblocks.server.serving import ConnectionLimits, serve

    size = batch_size(args)
    try:  # batch invariance only matters where requests are batched
        check_settings(size, args.max_batch_tokens, batch_invariant(args) and size > 1,
                       names=("--max-batch-size", "--max-batch-tokens"))  # fmt: skip
    except ValueError as exc:
        raise UserError(
            f"{exc}{'; or pass --no-batch-invariant' if 'invariant' in str(exc) else ''}"
        ) from exc
    cuda_graphs(args)  # refused off CUDA before the model loads
    if args.otlp_traces_endpoint:
        from kvblocks.telemetry import tracing

        try:
            tracing.configure(args.otlp_traces_endpoint)
        except tracing.TracingUnavailable as exc:
            raise UserError(str(exc)) from exc
    counts = ("max_messages", "max_input_items", "max_content_parts")
    schemas = ("max_schema_bytes", "max_schema_depth")
    for flag in ("max_waiting", "max_waiting_per_tenant", "max_prompts", "max_branches", *counts, *schemas):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    from kvblocks.server.schemas import INPUT_ITEMS_CEILING, MESSAGES_CEILING

    for flag, value, ceiling in (
        ("--max-messages", args.max_messages, MESSAGES_CEILING),
        ("--max-input-items", args.max_input_items, INPUT_ITEMS_CEILING),
    ):
        if value > ceiling:
            raise UserError(
                f"{flag} must be at most {ceiling} (the request schema's own ceiling), got {value}"
            )
    if not 0 < args.grammar_timeout <= 600:
        raise UserError(f"--grammar-timeout must be in (0, 600] seconds, got {args.grammar_timeout}")
    if args.max_schema_depth > MAX_SCHEMA_DEPTH:
        raise UserError(
            f"--max-schema-depth must be at most {MAX_SCHEMA_DEPTH} (the compile thread's stack grows with it), "
            f"got {args.max_schema_depth}"
        )
    if args.history_interval <= 0 or args.history_window < args.history_interval:
        raise UserError("need --history-interval > 0 and --history-window >= --history-interval")
    if args.kv_events_replay_endpoint and not args.kv_events_endpoint:
        raise UserError("--kv-events-replay-endpoint needs --kv-events-endpoint")
    if args.kv_event_block_size < 1:
        raise UserError(f"--kv-event-block-size must be at least 1, got {args.kv_event_block_size}")
    for flag, value in (("--max-blocks", args.max_blocks), ("--max-block-tokens", args.max_block_tokens)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    if args.kv_events_endpoint and args.no_cache:
        raise UserError("--kv-events-endpoint reports what the cache holds: drop --no-cache")
    serve_dtype(args)  # the last check before the model loads: it reads the model's config
    publisher = None
    if args.kv_events_endpoint:
        from kvblocks.telemetry.kv_events import KVEventPublisher

        try:
            publisher = KVEventPublisher(
                args.kv_events_endpoint,
                replay_endpoint=args.kv_events_replay_endpoint,
                block_size=args.kv_event_block_size,
            )
        except ValueError as exc:
            raise UserError(f"KV events: {exc}") from exc
    try:  # the port and events address are bound first, so a busy one fails before a long model load
        model, tokenizer, cache = load_stack(args)
    except BaseException:
        if publisher is not None:
            publisher.close()
        sock.close()
        raise
    if publisher is not None:
        if not hasattr(cache, "attach_events"):
            publisher.close()
            raise UserError("--kv-events-endpoint: KV events are not published for encoder-decoder models")
        cache.attach_events(publisher)
    gen = build_generator(args, model, tokenizer, None if args.no_cache else cache)
    check_kv_mode(gen, args.kv_mode, args.blend_recompute)
    name = models.served_name(args.served_model_name, args.model)
    engine = build_engine(args, gen, keys).start()
    config = ServerConfig(
        name,
        keys,
        args.default_max_tokens,
        args.max_body_bytes,
        args.read_timeout,
        lenient=args.lenient,
        tool_parser=args.tool_parser,
        max_prompts=args.max_prompts,
        max_branches=args.max_branches,
        caps=CountCaps(args.max_messages, args.max_input_items, args.max_content_parts),
        drain_timeout_s=args.drain_timeout,
        vllm_metrics=args.vllm_metrics,
        history_interval_s=args.history_interval,
        history_window_s=args.history_window,
        kv_mode=args.kv_mode,
        blend_recompute=args.blend_recompute,
        stored_bytes_per_tenant=args.store_max_bytes_per_tenant,
        stored_bytes=args.store_max_bytes,
        stored_ttl_s=args.store_ttl,
        max_blocks=args.max_blocks,
        max_block_tokens=args.max_block_tokens,
        cors=cors,
        quantization=args.quantization,
        grammar=GrammarLimits(
            max_bytes=args.max_schema_bytes,
            max_depth=args.max_schema_depth,
            compile_timeout_s=args.grammar_timeout,
        ),
    )
    frontend = Frontend(engine)
    app = create_app(frontend, config)
    stats = cache.stats()
    print(
        f"kvblocks: serving {name} in {args.dtype}{quantized_note(model)} on http://{args.host}:{args.port} "
        f"(cache {stats['capacity_tokens']} tokens, {stats['capacity_bytes'] / 2**20:.0f} MiB"
        f"{', redis ' + args.redis if args.redis else ''}{', draft ' + args.draft if args.draft else ''}"
        f"{', KV events on ' + args.kv_events_endpoint if args.kv_events_endpoint else ''}"
        f"{', API key required' if keys else ''}"
        f"{packed_note(frontend)})",
        file=sys.stderr,
        flush=True,
    )
    freeze_startup_objects()
    limits = ConnectionLimits(
        args.header_timeout, args.keep_alive_timeout, args.max_connections_per_client, args.max_connections
    )
    serve(app, sock, args.log_level, limits)  # lifespan stops the engine
    return 0


def load_api_keys(args: argparse.Namespace):
    """--api-keys FILE ($KVBLOCKS_API_KEYS_FILE), else --api-key KEY ($KVBLOCKS_API_KEY), else None."""
    from kvblocks.server.auth import KEYS_FILE_ENV, ApiKeys, permission_warning

    path = args.api_keys or os.environ.get(KEYS_FILE_ENV) or None
    key = args.api_key or os.environ.get("KVBLOCKS_API_KEY") or None
    if path and key:
        raise UserError("give --api-keys FILE or --api-key KEY, not both")
    try:
        if path:
            keys = ApiKeys.load(path)
            warning = permission_warning(path)
            if warning:
                print(warning, file=sys.stderr, flush=True)
            return keys
        return ApiKeys.single_admin(key) if key else None
    except ValueError as exc:
        raise UserError(str(exc)) from exc
