"""What a prompt with KV blocks would reuse, before it is sent: per block, its offset, its length,
how much of it the block store holds (device pool or a spill tier) and how many tokens would be reused.

A dry run: the device pool is matched and each spill tier is asked only for the sizes of its
records (as `kvblocks.cache.explain` asks), so asking reads, promotes, stores and counts nothing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from kvblocks.blocks.prefill import block_scope
from kvblocks.blocks.segments import BlockSpan
from kvblocks.cache.trie import Salt

if TYPE_CHECKING:
    from kvblocks.adapters.hf_trie import KVCacheTrie

__all__ = ["BlockExplanation", "explain_blocks"]


@dataclass(slots=True)
class BlockExplanation:
    """One block of the prompt: where it is, what the store holds of it, what a request would reuse."""

    offset: int
    length: int
    device_tokens: int  # leading tokens of the block the device pool holds
    spill_tokens: int  # the chunks the spill tiers hold after those, by their records' sizes
    tiers: list[dict]  # {tier, tokens} of each spill tier holding some of them, in lookup order
    redis_tokens: int  # Redis's share of `spill_tokens`
    held: bool  # all of it is stored: a request computes none of it to store it
    reused_tokens: int  # tokens whose stored KV a request in this kv_mode places at this offset
    note: str


def explain_blocks(
    cache: KVCacheTrie,
    ids: list[int],
    spans: list[BlockSpan],
    exact: int,
    salt: Salt,
    mode: str,
    share: float,
) -> list[dict]:
    """Per block of `ids` (whose first `exact` tokens the prefix cache serves), what `mode` at
    `share` would reuse: nothing in `exact` mode or within the exact prefix, the block's placed
    tokens in `concat`, all but the recomputed share of them in `blend`."""
    scope = block_scope(salt)
    out = []
    for span in spans:
        device = cache.cached_length(span.ids, salt=scope)
        tiers = _spill_tiers(cache, span.ids, device, scope)
        spilled = sum(t["tokens"] for t in tiers)
        redis = sum(t["tokens"] for t in tiers if t["tier"] == "redis")
        placed = min(span.length, len(ids) - 1 - span.start)
        reused, note = _reuse(span, placed, exact, mode, share)
        stored = device + spilled >= len(span.ids)
        explained = BlockExplanation(
            span.start, span.length, device, spilled, tiers, redis, stored, reused, note
        )
        out.append(asdict(explained))
    return out


def _reuse(span: BlockSpan, placed: int, exact: int, mode: str, share: float) -> tuple[int, str]:
    """How many of the block's tokens `mode` reuses at its offset, and why not more."""
    if span.start < exact:
        return 0, "within the exact prefix: served by the prefix cache"
    if mode == "exact":
        return 0, "kv_mode exact: blocks count only where they form a prefix"
    if placed <= 0:
        return 0, "holds the prompt's last token, which is always computed"
    cut = " (cut before the prompt's last token)" if placed < span.length else ""
    if mode == "concat":
        return placed, f"concat: every placed token reused{cut}"
    if share >= 1.0:
        return 0, "blend_recompute 1: the ordinary prefill, nothing reused"
    recomputed = min(placed, math.ceil(share * placed))
    return placed - recomputed, f"blend: {recomputed} of {placed} tokens recomputed{cut}"


def _spill_tiers(cache: KVCacheTrie, block: tuple[int, ...], device: int, scope) -> list[dict]:
    """{tier, tokens} of each spill tier holding chunks of `block` after its `device` tokens, by the
    records' sizes alone (none without spill tiers)."""
    if cache.spill is None or device >= len(block):
        return []
    arr, ns = cache.key_of(block, scope)
    return [{"tier": t, "tokens": n} for t, n in cache.spill.locate(ns.key, arr, device, len(block))]
