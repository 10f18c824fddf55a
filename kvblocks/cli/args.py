"""The arguments `generate` and `serve` share (the model, its cache and tiers, a drafter), and the
defaults the parsers copy from packages they must not import (so `--help` starts without torch)."""

from __future__ import annotations

import argparse

from kvblocks.cli.tiers import add_tier_args


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
        "--quantization",
        choices=QUANTIZATION_SCHEMES,
        default="none",
        help="none (default: the model's own weights, exact) or int8: every linear layer (the output head too) "
        "as int8 weights and per-token int8 activations (FBGEMM, CPU only, float32 activations): about 1.5-2x "
        "faster on a CPU without AVX-512, approximate (another model: responses say `quantization`, its "
        "cache namespace is its own; batched = alone and cached = uncached still hold); BENCHMARKS.md",
    )
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
QUANTIZATION_SCHEMES = ("none", "int8")  # kvblocks.engine.quant.SCHEMES, without importing torch here
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
