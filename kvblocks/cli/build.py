"""What the common arguments build: the model, tokenizer and cache, the generator (speculative or
not, seq2seq or not), the engine, and the dtype and batch settings `serve` decides."""

from __future__ import annotations

import argparse
import sys

from kvblocks.cli.tiers import spill_stack
from kvblocks.errors import UserError


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
    from kvblocks.engine import quant

    torch.set_num_threads(max(1, args.threads))
    capacity = parse_capacity(args.capacity)
    spill = spill_stack(args)
    try:
        model, tokenizer = models.load(args.model, args.dtype, args.device)
        quant.quantize(model, getattr(args, "quantization", "none"))  # before the cache hashes the weights
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
    except (models.ModelLoadError, UnsupportedModelError, ValueError) as exc:  # QuantizationError too
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
    if (dtype := quantized_dtype(args)) is not None:
        return dtype
    dtype = models.default_dtype(args.device) if asked == "auto" else asked
    why = half_refusal(args, dtype) if dtype in HALF_DTYPES else None
    if why is not None and asked != "auto":
        raise UserError(f"--dtype {asked}: {why}; use --dtype float32")
    if why is not None:
        print(f"kvblocks: --dtype auto: float32, as {dtype} {why}", file=sys.stderr, flush=True)
        dtype = "float32"
    args.dtype = dtype
    return dtype


def quantized_dtype(args: argparse.Namespace) -> str | None:
    """--dtype under --quantization int8 (None without it): its activations and the rest of the model
    run in float32 (`kvblocks.engine.quant`), on CPU only; anything else is refused by name. Sets
    `args.dtype`."""
    if getattr(args, "quantization", "none") == "none":
        return None
    if args.device.split(":")[0] != "cpu":
        raise UserError(f"--quantization {args.quantization} runs on CPU only (FBGEMM), not on {args.device}")
    if args.dtype not in ("auto", "float32"):
        raise UserError(
            f"--quantization {args.quantization} runs its activations in float32; use --dtype float32 "
            f"(or auto), not {args.dtype}"
        )
    args.dtype = "float32"
    return "float32"


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


def quantized_note(model) -> str:
    """The start line's word on --quantization: the int8 weights' size, and that it is approximate."""
    from kvblocks.engine import quant

    if quant.scheme(model) == "none":
        return ""
    return f" with int8 weights ({quant.nbytes(model) / 2**20:,.0f} MiB; --quantization int8, approximate)"


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
            on_round=on_round, tree=tree_shape(args), packed=getattr(args, "packed_weights", "all"),
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


def plain_generator(model, tokenizer, cache):
    """The generator without drafting that a speculative run's speed-up is measured against."""
    from kvblocks import CachedGenerator
    from kvblocks.seq2seq import Seq2SeqCachedGenerator

    if getattr(model.config, "is_encoder_decoder", False):
        return Seq2SeqCachedGenerator(model, tokenizer, cache)
    return CachedGenerator(model, tokenizer, cache)
