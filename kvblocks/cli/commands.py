"""`kvblocks` command line."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

from kvblocks.cli.tiers import add_tier_args, spill_stack
from kvblocks.errors import UserError


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="a pulled model's name (kvblocks models list), a local transformers model path or a hub id "
        "(default: SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (default: bfloat16 on a CPU with native BF16 where `kvblocks serve` runs its batch-invariant "
        "packed engine, else float32), float32, bfloat16, float16 or float64",
    )
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0 (default: cpu)")
    p.add_argument(
        "--capacity",
        default="1GiB",
        help="device KV pool size: tokens (e.g. 200000) or bytes with a unit (e.g. 512MiB, 2GiB); default 1GiB",
    )
    p.add_argument(
        "--eviction",
        choices=EVICTION_POLICIES,
        default="gdsf",
        help="what leaves a full pool first: gdsf (frequency x recompute cost, aged; default) or lru "
        "(least recently used); see BENCHMARKS.md",
    )
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=256,
        metavar="N",
        help="recurrent and hybrid models (mamba, lfm2, qwen3_next, ...): snapshot the recurrent state every N "
        "tokens, besides prompt and reply ends, the last-but-one prompt token and branch points (default "
        "256; 0: only those); a prefix is reused up to its last snapshot. Ignored by attention-only models",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--redis", default=None, metavar="URL", help="spill tier, e.g. redis://127.0.0.1:6379/0")
    p.add_argument(
        "--redis-chunk-tokens",
        type=int,
        default=64,
        help="tokens per spill chunk, in every tier (default 64)",
    )
    p.add_argument(
        "--redis-secret-file",
        default=None,
        metavar="F",
        help="deployment secret (16+ bytes) that keys and seals Redis records; processes share only "
        "with the same secret (default $KVBLOCKS_REDIS_SECRET; none: Redis is trusted)",
    )
    p.add_argument(
        "--redis-ttl",
        type=float,
        default=DEFAULT_REDIS_TTL_S,
        metavar="SECONDS",
        help=f"lifetime of a Redis record (default {DEFAULT_REDIS_TTL_S:g}, a day; 0: never expires)",
    )
    add_tier_args(p)


TOOL_PARSERS = (
    "hermes",
    "llama3_json",
    "mistral",
)  # kvblocks.generate.tools.PARSERS, without importing it here
EVICTION_POLICIES = ("gdsf", "lru")  # kvblocks.cache.eviction.POLICIES, without importing the package here
DEFAULT_REDIS_TTL_S = 24 * 3600.0  # kvblocks.spill.redis_tier.DEFAULT_TTL_S, without importing torch here
# kvblocks.generate.grammar.GrammarLimits' defaults, without importing torch here; the stack of the
# compile thread grows with the depth (32 KB a level), so the depth has a ceiling
SCHEMA_BYTES, SCHEMA_DEPTH, GRAMMAR_TIMEOUT_S, MAX_SCHEMA_DEPTH = 128 << 10, 128, 5.0, 4096

DRAFT_HELP = (
    "drafter: a model path, self:K (the target's first K layers), lookup[:N] (n-gram prompt lookup) or trie"
)


def add_draft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", default=None, help=f"speculative decoding with this {DRAFT_HELP}")
    p.add_argument(
        "--gamma", "--speculative-num-steps", type=int, default=4,
        help="drafts per round (default 4); with a draft tree, its depth",
    )  # fmt: skip
    p.add_argument(
        "--adaptive-gamma", action="store_true", help="grow gamma on full acceptance, shrink on rejection"
    )
    p.add_argument(
        "--draft-tree-width", "--speculative-eagle-topk", type=int, default=1, metavar="W",
        help="draft trees: up to W branches per node (default 1: a chain); every continuation the trie holds, "
        "several prompt-lookup matches, a draft model's top-W, verified in one forward",
    )  # fmt: skip
    p.add_argument(
        "--draft-tree-tokens", "--speculative-num-draft-tokens", type=int, default=None, metavar="N",
        help="draft trees: at most N nodes a round (default 2 x gamma); adapted per request to its "
        "acceptance and to the batch unless --draft-tree-fixed",
    )  # fmt: skip
    p.add_argument(
        "--draft-tree-fixed", action="store_true", help="draft trees keep their size (no adapting)"
    )


def tree_shape(args: argparse.Namespace):
    """The `TreeShape` the draft-tree flags ask for, or None for chains."""
    width, tokens = getattr(args, "draft_tree_width", 1), getattr(args, "draft_tree_tokens", None)
    if width < 1:
        raise UserError(f"--draft-tree-width must be >= 1, got {width}")
    if width == 1 and tokens is None:
        return None
    tokens = 2 * args.gamma if tokens is None else tokens
    if tokens < args.gamma:
        raise UserError(
            f"--draft-tree-tokens ({tokens}) must be at least --gamma, the tree's depth ({args.gamma})"
        )
    from kvblocks.specdec import TreeShape

    return TreeShape(budget=tokens, depth=args.gamma, width=width, adaptive=not args.draft_tree_fixed)


def parse_capacity(text: str) -> dict[str, int]:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    t = text.strip().lower()
    for unit, scale in units.items():
        if t.endswith(unit):
            number = t[: -len(unit)].strip()
            try:
                return {"capacity_bytes": int(float(number) * scale)}
            except ValueError:
                break
    if t.isdigit() and int(t) > 0:
        return {"capacity_tokens": int(t)}
    raise UserError(f"--capacity must be a token count or a size like 512MiB, got '{text}'")


def load_stack(args: argparse.Namespace):
    """(model, tokenizer, cache) from the common model arguments."""
    import torch

    from kvblocks import KVCacheTrie, UnsupportedModelError, models

    torch.set_num_threads(max(1, args.threads))
    capacity = parse_capacity(args.capacity)
    spill = spill_stack(args)
    try:
        model, tokenizer = models.load(args.model, args.dtype, args.device)
        if getattr(
            model.config, "is_encoder_decoder", False
        ):  # a Seq2SeqCache: source records + decoder trie
            from kvblocks.seq2seq import Seq2SeqCache

            cache = Seq2SeqCache.for_model(
                model, **capacity, spill=spill, source_spill=spill_stack(args), eviction=args.eviction
            )
        else:
            cache = KVCacheTrie.for_model(
                model, **capacity, spill=spill, eviction=args.eviction, snapshot_every=args.snapshot_every
            )
    except (models.ModelLoadError, UnsupportedModelError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    return model, tokenizer, cache


DEFAULT_BATCH_SIZE = 16  # kvblocks serve without --max-batch-size, where the model has a packed path


def batch_invariant(args: argparse.Namespace) -> bool:
    """--batch-invariant as given, else on where it is proven (the CPU) and off elsewhere."""
    on_cpu = args.device.split(":")[0] == "cpu"
    if args.batch_invariant and not on_cpu:
        raise UserError(
            f"--batch-invariant is proven on CPU only: on {args.device} a request's rows are not "
            "bit-identical alone and in a batch (BENCHMARKS.md, GPU); drop the flag"
        )
    return on_cpu if args.batch_invariant is None else args.batch_invariant


HALF_DTYPES = ("bfloat16", "float16")


def serve_dtype(args: argparse.Namespace) -> str:
    """--dtype of `kvblocks serve`, `auto` decided (`models.default_dtype`, then float32 wherever a
    half dtype would not keep the server's guarantees); an explicit half dtype is refused there by
    name. Sets `args.dtype` (drafters load in it too)."""
    from kvblocks import models

    asked = args.dtype
    if asked != "auto" and asked not in models.DTYPES:
        raise UserError(f"unknown --dtype '{asked}'; choose auto or one of {', '.join(models.DTYPES)}")
    dtype = models.default_dtype(args.device) if asked == "auto" else asked
    why = half_refusal(args, dtype) if dtype in HALF_DTYPES else None
    if why is not None and asked != "auto":
        raise UserError(f"--dtype {asked}: {why}; use --dtype float32")
    if why is not None:
        print(f"kvblocks: --dtype auto: float32, as {dtype} {why}", file=sys.stderr, flush=True)
        dtype = "float32"
    args.dtype = dtype
    return dtype


def half_refusal(args: argparse.Namespace, dtype: str) -> str | None:
    """Why a half dtype would not keep cached = uncached and batched = alone in this configuration
    (None: it keeps both). Only the batch-invariant packed engine does: its rows round the same
    whatever else runs (fixed cuts, at least `MIN_ROWS` rows per product), so a request rounds as
    it would alone and uncached; one request per forward rounds by the shapes a cache hit leaves."""
    import torch
    from transformers import AutoConfig

    from kvblocks import models
    from kvblocks.engine.attention.dispatch import SUPPORTED
    from kvblocks.engine.attention.probes import probe_blocks_invariance, probe_row_invariance

    if args.device.split(":")[0] != "cpu":
        return f"is not exact on {args.device}: a request's rows differ alone and in a batch (BENCHMARKS.md, GPU)"
    for flag, serial in (
        ("--no-cache", args.no_cache),
        ("--max-batch-size 1", batch_size(args) == 1),
        ("--no-batch-invariant", not batch_invariant(args)),
    ):
        if serial:
            return f"is exact only in the batch-invariant packed engine, which {flag} turns off"
    if args.draft:  # a round is one segment, not cut where the engine cuts prompts
        return "is not exact with --draft: speculative rounds round otherwise than one token a step"
    try:
        config = AutoConfig.from_pretrained(models.resolve(args.model))
    except (OSError, ValueError, models.ModelLoadError):
        return None  # the model load reports it
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"is exact only in the batch-invariant packed engine, which model type '{kind}' has no path to"
    torch.set_num_threads(max(1, args.threads))  # the probes see the server's kernels
    half, width = models.DTYPES[dtype], config.hidden_size
    dim = getattr(config, "head_dim", None) or width // config.num_attention_heads
    if not (probe_row_invariance("cpu", half, width) and probe_blocks_invariance("cpu", half, dim)):
        return (
            "is not batch-invariant on this CPU (probes.probe_row_invariance / probe_blocks_invariance fail)"
        )
    return None


def packed_note(engine) -> str:
    """The start line's word on the weights reordered for packed forwards (`--packed-weights`), from
    the engine's `Frontend` (a serial engine reorders none)."""
    size = engine.packed_weight_bytes
    return f", reordered weights {size / 2**20:,.0f} MiB (--packed-weights)" if size else ""


def cuda_graphs(args: argparse.Namespace) -> bool | None:
    """--cuda-graphs as given (refused off CUDA), else None: the engine's default."""
    if args.cuda_graphs and args.device.split(":")[0] != "cuda":
        raise UserError(f"--cuda-graphs needs a CUDA device, not --device {args.device}; drop the flag")
    return args.cuda_graphs


def batch_size(args: argparse.Namespace) -> int:
    return DEFAULT_BATCH_SIZE if args.max_batch_size is None else args.max_batch_size


def build_engine(args: argparse.Namespace, gen, keys=None):
    """`BatchEngine` where the packed path serves the model (unless --max-batch-size 1), else `Engine`
    (one request per forward); when a batch size was asked for and cannot be had, a line on stderr
    says why. Its waiting room takes the --max-waiting bounds and the keys file's tenant limits."""
    from kvblocks.engine.admission import RoomLimits, no_limits
    from kvblocks.engine.attention.dispatch import supports
    from kvblocks.engine.loop import Engine

    room = {
        "limits": RoomLimits(args.max_waiting, args.max_waiting_per_tenant),
        "limits_of": keys.limits if keys is not None else no_limits,
    }
    size = batch_size(args)
    if size == 1:
        return Engine(gen, **room)
    why = None
    if gen.cache is None:
        why = "--no-cache"
    elif not supports(gen.model):
        why = f"model type '{gen.model.config.model_type}' has no packed attention path yet"
    if why is not None:
        if args.max_batch_size is not None:  # asked for, not the default
            print(f"kvblocks: --max-batch-size {size} ignored: {why}", file=sys.stderr, flush=True)
        return Engine(gen, **room)
    from kvblocks.engine.batch import BatchEngine

    return BatchEngine(
        gen,
        max_batch_size=size,
        max_batch_tokens=args.max_batch_tokens,
        full_batch_tokens=args.full_batch_tokens,
        invariant=batch_invariant(args),
        cuda_graphs=cuda_graphs(args),
        packed_weights=args.packed_weights,
        **room,
    )


def build_generator(args: argparse.Namespace, model, tokenizer, cache, on_round=None):
    """A CachedGenerator, or a SpeculativeGenerator when --draft is given (their seq2seq kinds for
    an encoder-decoder model)."""
    from kvblocks import CachedGenerator

    if getattr(model.config, "is_encoder_decoder", False):
        return build_seq2seq_generator(args, model, tokenizer, cache, on_round)
    if not getattr(args, "draft", None):
        return CachedGenerator(model, tokenizer, cache)
    from kvblocks.specdec import SpeculativeGenerator
    from kvblocks.specdec.factory import DraftSpecError, build_drafter

    try:
        drafter = build_drafter(
            args.draft, model, cache, parse_capacity(args.capacity), args.dtype, args.device
        )
    except DraftSpecError as exc:
        raise UserError(str(exc)) from exc
    try:
        return SpeculativeGenerator(
            model, tokenizer, cache, drafter, gamma=args.gamma, adaptive=args.adaptive_gamma,
            on_round=on_round, tree=tree_shape(args),
        )  # fmt: skip
    except ValueError as exc:  # a target draft trees cannot serve, a bad gamma
        raise UserError(f"--draft: {exc}") from exc


def check_kv_mode(gen, kv_mode: str, blend_recompute: float) -> None:
    """A server default kv_mode the model cannot honour (no RoPE, ...) stops the start, not each request."""
    from kvblocks.generate.params import GenerationParams, ParamError

    try:
        gen.check_params(GenerationParams(kv_mode=kv_mode, blend_recompute=blend_recompute))
    except ParamError as exc:
        raise UserError(f"--{exc.param.replace('_', '-')}: {exc}") from exc


def build_seq2seq_generator(args: argparse.Namespace, model, tokenizer, cache, on_round=None):
    """`Seq2SeqCachedGenerator`, or with --draft a `Seq2SeqSpeculativeGenerator` drafting by prompt
    lookup, from the trie or with a seq2seq draft model (a folder); `cache` is a `Seq2SeqCache`."""
    from kvblocks.seq2seq import Seq2SeqCache, Seq2SeqCachedGenerator

    if not getattr(args, "draft", None):
        return Seq2SeqCachedGenerator(model, tokenizer, cache)
    if tree_shape(args) is not None:
        raise UserError("--draft-tree-width/--draft-tree-tokens: an encoder-decoder target drafts chains")
    from kvblocks.specdec import (
        PromptLookupDrafter,
        Seq2SeqModelDrafter,
        Seq2SeqSpeculativeGenerator,
        TrieDrafter,
    )

    kind, _, arg = args.draft.partition(":")
    if kind == "lookup" and (not arg or arg.isdigit()):
        drafter = PromptLookupDrafter(max_ngram=int(arg or 3))
    elif kind == "trie" and not arg and cache is not None:
        drafter = TrieDrafter(cache.decoder)
    elif kind in ("self", "trie", "lookup"):
        raise UserError(
            f"--draft {args.draft}: an encoder-decoder target takes lookup[:N], trie (with the cache) or a "
            "seq2seq draft model folder"
        )
    else:
        draft, _ = load_seq2seq_draft(args.draft, args.dtype, args.device)
        try:
            draft_cache = Seq2SeqCache.for_model(draft, **parse_capacity(args.capacity))
        except ValueError as exc:
            raise UserError(f"--draft: {exc}") from exc
        drafter = Seq2SeqModelDrafter(draft, draft_cache)
    return Seq2SeqSpeculativeGenerator(
        model, tokenizer, cache, drafter, gamma=args.gamma, adaptive=args.adaptive_gamma, on_round=on_round
    )


def load_seq2seq_draft(path: str, dtype: str, device: str):
    """A seq2seq draft model, or a UserError naming what is wrong with it."""
    from kvblocks import models

    try:
        draft, tokenizer = models.load(path, dtype, device)
    except models.ModelLoadError as exc:
        raise UserError(f"--draft: {exc}") from exc
    if not getattr(draft.config, "is_encoder_decoder", False):
        raise UserError(f"--draft {path}: an encoder-decoder target needs an encoder-decoder draft model")
    return draft, tokenizer


def generation_request(args: argparse.Namespace, prompt: str, encoder_decoder: bool):
    """What `generate` sends: an encoder-decoder model reads the prompt as its source (with
    --decoder-prompt as the reply's prefix); a decoder-only one reads it raw or as a chat turn."""
    if not encoder_decoder:
        if args.decoder_prompt is not None:
            raise UserError("--decoder-prompt is for encoder-decoder models; this one is decoder-only")
        return prompt if args.raw else _messages(args.system, prompt)
    if args.system is not None:
        raise UserError("--system: an encoder-decoder model has no chat template; the prompt is its source")
    from kvblocks.seq2seq import Seq2SeqPrompt

    return Seq2SeqPrompt(prompt, args.decoder_prompt or "")


def plain_generator(model, tokenizer, cache):
    """The generator without drafting that a speculative run's speed-up is measured against."""
    from kvblocks import CachedGenerator
    from kvblocks.seq2seq import Seq2SeqCachedGenerator

    if getattr(model.config, "is_encoder_decoder", False):
        return Seq2SeqCachedGenerator(model, tokenizer, cache)
    return CachedGenerator(model, tokenizer, cache)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvblocks import PromptError

    if args.dtype == "auto":  # one request per forward: a half dtype rounds by the shapes a hit leaves
        args.dtype = "float32"
    model, tokenizer, cache = load_stack(args)
    encoder_decoder = getattr(model.config, "is_encoder_decoder", False)
    show = DraftPainter(tokenizer) if args.show_drafts and args.draft else None
    gen = build_generator(args, model, tokenizer, cache, on_round=show)
    prompts = list(args.prompt)
    if not prompts:
        if sys.stdin.isatty():
            raise UserError("give a prompt as an argument or on stdin")
        prompts = [sys.stdin.read()]
    for prompt in prompts:
        request = generation_request(args, prompt, encoder_decoder)
        try:
            stream = gen.stream(
                request,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                stop=args.stop,
                seed=args.seed,
            )
            result = None
            for piece in stream:
                if show is None:
                    sys.stdout.write(piece.text)
                    sys.stdout.flush()
                result = piece.result
        except (PromptError, ValueError) as exc:
            raise UserError(str(exc)) from exc
        sys.stdout.write("\n")
        if result.spec is not None:
            baseline = plain_generator(model, tokenizer, cache).generate(
                request, max_new_tokens=len(result.token_ids), temperature=args.temperature, seed=args.seed
            )
            print(_spec_line(result, baseline), file=sys.stderr)
        summary = {
            "prompt_tokens": result.prompt_tokens,
            "cached_tokens": result.cached_tokens,
            "completion_tokens": len(result.token_ids),
            "ttft_ms": round(result.ttft_s * 1e3, 1),
            "total_ms": round(result.total_s * 1e3, 1),
            "finish_reason": result.finish_reason,
        }
        if encoder_decoder:
            summary |= {"source_tokens": result.encoder_tokens, "source_cached": result.encoder_cached_tokens}
        print(json.dumps(summary) if args.json else _summary_line(summary), file=sys.stderr)
    return 0


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
        f"kvblocks: serving {name} in {args.dtype} on http://{args.host}:{args.port} "
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


def _decode_rate(r) -> float:
    """Tokens/s after the first token (prefill excluded, so cached and uncached runs compare)."""
    span = r.total_s - r.ttft_s
    return (len(r.token_ids) - 1) / span if span > 0 and len(r.token_ids) > 1 else 0.0


def _spec_line(r, baseline) -> str:
    s = r.spec
    fast, slow = _decode_rate(r), _decode_rate(baseline)
    ratio = f"{fast / slow:.2f}x" if slow else "n/a"
    return (
        f"[speculative: {s.rounds} rounds, {s.drafted} drafted, {s.accepted} accepted, alpha {s.alpha:.3f}, "
        f"{s.tokens_per_call:.2f} tokens/target call, draft efficiency {s.draft_efficiency:.3f}; "
        f"decode {fast:.1f} tok/s vs target-only {slow:.1f} tok/s ({ratio})]"
    )


class DraftPainter:
    """--show-drafts: accepted drafts green, rejected drafts red and struck through, the target's
    own token (correction or bonus) yellow."""

    GREEN, RED, YELLOW, RESET = "\x1b[32m", "\x1b[9;31m", "\x1b[1;33m", "\x1b[0m"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, rnd) -> None:
        piece = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        n = rnd.accepted
        out = self.GREEN + piece(rnd.drafts[:n]) + self.RESET
        if n < len(rnd.drafts):
            out += self.RED + piece(rnd.drafts[n:]) + self.RESET
        out += self.YELLOW + piece([rnd.token]) + self.RESET
        sys.stdout.write(out)
        sys.stdout.flush()


def _messages(system: str | None, prompt: str) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return [*msgs, {"role": "user", "content": prompt}]


def _source_part(s: dict) -> str:
    if "source_tokens" not in s:
        return ""
    held = "held" if s["source_cached"] else "encoded"
    return f"source of {s['source_tokens']} tokens {held}; decoder: "


def _summary_line(s: dict) -> str:
    return (
        f"[{_source_part(s)}{s['prompt_tokens']} prompt tokens, {s['cached_tokens']} cached, "
        f"{s['completion_tokens']} generated; "
        f"ttft {s['ttft_ms']} ms, total {s['total_ms']} ms, {s['finish_reason']}]"
    )


def _add_generate_parser(sub) -> None:
    g = sub.add_parser(
        "generate", help="generate text with prefix reuse", description="Generate text with prefix reuse."
    )
    g.add_argument("prompt", nargs="*", help="one or more prompts, run in order against one shared cache")
    add_model_args(g)
    g.add_argument("--system", default=None, help="system message (chat prompts)")
    g.add_argument(
        "--decoder-prompt",
        default=None,
        help="an encoder-decoder model's decoder prefix (the prompt is then its source)",
    )
    g.add_argument(
        "--raw", action="store_true", help="send the prompt as plain text, without the chat template"
    )
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print the per-request summary as JSON on stderr")
    add_draft_args(g)
    g.add_argument(
        "--show-drafts",
        action="store_true",
        help="colour accepted drafts (green), rejected drafts (red) and the target's own tokens (yellow)",
    )
    g.set_defaults(func=cmd_generate)


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


def _add_serve_parser(sub) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser. Nothing here imports torch, so the HTTP-only commands (`stats`, `inspect`,
    `explain`) start in well under a second; `bench` parses its own arguments when it runs (`cmd_bench`)."""
    from kvblocks.cli.client import add_inspect_parsers
    from kvblocks.cli.models import add_models_parser

    parser = argparse.ArgumentParser(
        prog="kvblocks", description="Exact prefix-sharing KV cache for transformers"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate_parser(sub)
    _add_serve_parser(sub)
    add_inspect_parsers(sub)
    add_models_parser(sub)
    b = sub.add_parser(
        "bench",
        add_help=False,
        help="run benchmarks against their targets (kvblocks bench --help lists the suites)",
    )
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    b.set_defaults(func=cmd_bench)
    return parser


def cmd_bench(args: argparse.Namespace) -> int:
    from kvblocks.bench import bench_parser

    parser = bench_parser()
    bench_args = parser.parse_args(args.bench_args)
    if not getattr(bench_args, "func", None):
        parser.print_help()
        return 2
    return bench_args.func(bench_args)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":
        # `bench` takes everything after it, options before the suite name included (`bench -h`)
        args.bench_args = extra + args.bench_args
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except UserError as exc:
        print(f"kvblocks: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
