"""Prefill a segmented prompt from stored block KV: `concat` places each block's KV at its position
(keys re-rotated), `blend` (CacheBlend, Yao et al., EuroSys 2025) also recomputes the share of each
block's tokens whose layer-1 K/V deviates most from a fresh computation.

The exact prefix hit, and the plain tokens before the first block, are computed as usual. Every
other token that is not reused (plain segments, chosen block tokens) is recomputed through all
layers in one forward over a cache holding the reused KV, with a mask under which each sees exactly the tokens before it; the trailing plain segment (and
the last prompt token, always) is then prefilled by the generator as usual.

`BlockPrefill.steps` is the same work resumable, in forwards of at most a given number of tokens
(the engine's per-step budget), so an engine can interleave one request's block work with other
requests' steps; `run` does it at once (every forward whole).
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from kvblocks.adapters import hf
from kvblocks.adapters.hf import UnsupportedModelError
from kvblocks.blocks.report import BlockReport, BlockUse
from kvblocks.blocks.rope import RopeShift
from kvblocks.blocks.segments import BlockSpan
from kvblocks.cache.namespace import Scope
from kvblocks.cache.trie import Hit, Salt

if TYPE_CHECKING:
    from kvblocks.adapters.hf_trie import KVCacheTrie
    from kvblocks.generate.generator import ModelRunner

__all__ = ["BLOCK_TAG", "BlockPrefill", "Prefilled", "Promotions", "block_scope", "kv_deviation"]

# A block's KV lives in the prefix cache under its tenant, in a salt of its own: computed from
# position 0 alone, it is a different thing from the same ids inside a prompt.
BLOCK_TAG = "\0block\0"
# The first tokens of each block a blend recomputes before choosing by deviation (within the share).
BLEND_LEAD = 2
# The layer whose fresh K/V a blend compares with the reused one (the second, as CacheBlend).
PROBE_LAYER = 1
# An exact request's block longer than this share of the trie's capacity is not promoted: storing it
# would evict most of what the cache holds for one document.
PROMOTE_SHARE = 0.25

KV = list[tuple[torch.Tensor, torch.Tensor]]
# Resumable block work: yields the tokens each forward computed, returns its result.
Work = Generator[int, None, Any]


def block_scope(salt: Salt) -> Scope:
    """Where a request's blocks are stored: its tenant, and its salt tagged as a block's."""
    scope = salt if isinstance(salt, Scope) else Scope("", salt or "")
    return Scope(scope.tenant, BLOCK_TAG + scope.salt)


@dataclass(slots=True)
class Prefilled:
    """A cache holding the prompt's first `computed` positions; from `reusable` on, its KV was not
    computed exactly and must not enter the prefix cache."""

    past: Any
    computed: int
    reusable: int
    report: BlockReport


@dataclass(slots=True)
class Promotions:
    """Blocks marked in `exact` requests and stored in the block store since the start, and those
    skipped for being over `PROMOTE_SHARE` of the capacity."""

    blocks: int = 0
    tokens: int = 0  # tokens computed to store them (a block found in Redis costs none)
    skipped_blocks: int = 0
    skipped_tokens: int = 0


class BlockPrefill:
    """Prefills prompts with KV blocks for one model and its cache (None: blocks are not stored)."""

    def __init__(self, model, runner: ModelRunner, cache: KVCacheTrie | None) -> None:
        self.model, self.runner, self.cache = model, runner, cache
        self.rope = RopeShift(model)
        self.specs = list(cache.specs) if cache is not None else hf.describe_layers(model)
        self.promotions = Promotions()
        if any(spec.kind != "full" for spec in self.specs):
            raise UnsupportedModelError(
                f"model type '{model.config.model_type}' has sliding-window or KV-sharing layers: KV blocks "
                "support full-attention models only; use kv_mode 'exact'"
            )

    def run(
        self, ids: list[int], spans: list[BlockSpan], hit: Hit | None, salt: Salt, mode: str, share: float
    ) -> Prefilled | None:
        """The cache for `ids` up to the end of its last reusable block, or None when no block lies
        past the exact prefix hit (the ordinary prefill then serves the prompt)."""
        return finish(self.steps(ids, spans, hit, salt, mode, share))

    def steps(
        self,
        ids: list[int],
        spans: list[BlockSpan],
        hit: Hit | None,
        salt: Salt,
        mode: str,
        share: float,
        chunk: int | None = None,
    ) -> Work:
        """`run` as resumable work: each `next` runs one forward of at most `chunk` tokens (None:
        each forward whole, as `run`) and yields how many tokens it computed; returns `run`'s result.
        Chunks of one causal forward attend to exactly what the whole forward would."""
        h = hit.length if hit is not None else 0
        spans = _reusable(spans, h, len(ids) - 1)  # the last prompt token is always computed
        if not spans:
            return None
        share = share if mode == "blend" else 0.0
        report = BlockReport(mode, share, exact_tokens=h)
        end, first = max(span.end for span in spans), spans[0].start
        exact = yield from self._exact_kv(ids, hit, h, first, chunk)
        base = yield from self._place(exact, spans, salt, end, report, chunk)
        chosen: dict[int, list[int]] = {i: [] for i in range(len(spans))}
        if share > 0:
            chosen = yield from self._choose(ids, spans, exact, first, base, share, report, chunk)
        reused = torch.zeros(end, dtype=torch.bool)
        for i, span in enumerate(spans):
            reused[span.start : span.end] = True
            reused[chosen[i]] = False
            report.blocks[i].reused = span.end - span.start - len(chosen[i])
            report.add_tiers(_tiers(report.blocks[i], reused[span.start : span.end]))
        past = yield from self._recompute(ids, base, reused, first, end, chunk)
        report.reused_tokens = int(reused.sum())
        report.recomputed_tokens = len(ids) - h - report.reused_tokens
        return Prefilled(past, end, first, report)

    # ---- block store -----------------------------------------------------------------------

    def block_kv(self, block: tuple[int, ...], salt: Salt) -> tuple[KV, int, dict[str, int]]:
        """A block's keys and values `[n, H, D]` per layer, computed from position 0 on its own, how
        many of its tokens the store held (the rest are computed now and stored), and where those
        came from: `{"device": n, tier: n, ...}`, the device pool's first, then each spill tier's
        in lookup order (`origin`)."""
        return finish(self._fill(block, salt, None))

    def _fill(self, block: tuple[int, ...], salt: Salt, chunk: int | None) -> Work:
        """`block_kv` as resumable work (`steps`); the block's match stays locked until it returns."""
        if self.cache is None:
            past = hf.empty_cache(self.model.config)
            yield from self._forward(list(block), past, chunk)
            return hf.extract(past, self.specs, 0, len(block)), 0, {}
        scope = block_scope(salt)
        device = self.cache.cached_length(block, salt=scope)
        with self.cache.match(block, salt=scope, whole=True) as hit:
            past = hit.to_hf_cache()
            if hit.length < len(block):
                yield from self._forward(list(block[hit.length :]), past, chunk)
                self.cache.insert(block, past, salt=scope)
            return hf.extract(past, self.specs, 0, len(block)), hit.length, origin(device, hit)

    def store_steps(self, block: tuple[int, ...], salt: Salt, chunk: int | None = None) -> Work:
        """Store `block` ahead of the requests that use it, as resumable work (as `steps`); returns how
        many of its tokens the store held already (found in the pool or Redis, not computed)."""
        assert self.cache is not None
        _, held, _ = yield from self._fill(block, salt, chunk)
        return held

    def promote(self, spans: list[BlockSpan], salt: Salt) -> None:
        """Store the blocks of an `exact` request that the device pool does not hold (fetched from
        Redis, else computed from position 0 on their own), so a later blend or concat finds them."""
        finish(self.promote_steps(spans, salt))

    def promote_steps(self, spans: list[BlockSpan], salt: Salt, chunk: int | None = None) -> Work:
        """`promote` as resumable work (as `steps`: a forward of at most `chunk` tokens per call)."""
        assert self.cache is not None
        limit = PROMOTE_SHARE * self.cache.pool.capacity
        scope = block_scope(salt)
        for block in dict.fromkeys(span.ids for span in spans):
            if len(block) > limit:
                self.promotions.skipped_blocks += 1
                self.promotions.skipped_tokens += len(block)
            elif self.cache.cached_length(block, salt=scope) < len(block):
                _, stored, _ = yield from self._fill(block, salt, chunk)
                self.promotions.blocks += 1
                self.promotions.tokens += len(block) - stored

    # ---- steps -------------------------------------------------------------------------------

    def _forward(self, ids: list[int], past, chunk: int | None) -> Work:
        """`ids` prefilled into `past`, `chunk` tokens per forward (a chunked prefill)."""
        for piece in _pieces(ids, chunk):
            self.runner.forward(piece, past)
            yield len(piece)

    def _exact_kv(self, ids: list[int], hit: Hit | None, h: int, first: int, chunk: int | None) -> Work:
        """KV of the positions before the first block: the hit, and the plain tokens after it
        prefilled as any request would (they are exact, and enter the prefix cache)."""
        past = hit.to_hf_cache() if hit is not None else hf.empty_cache(self.model.config)
        yield from self._forward(ids[h:first], past, chunk)
        return hf.extract(past, self.specs, 0, first) if first else None

    def _place(
        self,
        exact: KV | None,
        spans: list[BlockSpan],
        salt: Salt,
        end: int,
        report: BlockReport,
        chunk: int | None,
    ) -> Work:
        """Per layer `[end, 2, H, D]`: the exact prefix, each block's KV at its position (keys
        re-rotated), zeros elsewhere (rows the recompute forward never reads)."""
        dtype, device = self.model.dtype, self.runner.device
        base = [torch.zeros(end, 2, s.heads, s.head_dim, dtype=dtype, device=device) for s in self.specs]
        if exact is not None:
            for layer, (k, v) in zip(base, exact):
                layer[: k.shape[0], 0], layer[: k.shape[0], 1] = k, v
        fetched: dict[tuple[int, ...], tuple[KV, int, dict[str, int]]] = {}
        for span in spans:
            if span.ids not in fetched:
                fetched[span.ids] = yield from self._fill(span.ids, salt, chunk)
                report.block_fill_tokens += len(span.ids) - fetched[span.ids][1]
            kv, stored, came = fetched[span.ids]
            n = span.end - span.start
            for layer, (k, v) in zip(base, kv):
                layer[span.start : span.end, 0] = self.rope.shift(k[:n], span.start)
                layer[span.start : span.end, 1] = v[:n]
            report.blocks.append(BlockUse(span.start, len(span.ids), stored, n, came))
        return base

    def _choose(
        self, ids, spans, exact: KV | None, h: int, base, share: float, report: BlockReport, chunk: int | None
    ) -> Work:
        """Per block, the positions to recompute: its first `BLEND_LEAD` tokens, then those whose
        fresh layer-1 K/V is furthest from the reused one (`kv_deviation`), `ceil(share * length)`
        in all."""
        end = base[0].shape[0]
        fresh = yield from self._probe(ids[h:end], exact, h, chunk)
        report.probe_tokens = end - h
        layer = min(PROBE_LAYER, len(self.specs) - 1)
        deviation = kv_deviation(fresh[h:end], base[layer][h:end])
        chosen: dict[int, list[int]] = {}
        for i, span in enumerate(spans):
            n = span.end - span.start
            k = min(n, math.ceil(share * n))
            lead = list(range(span.start, span.start + min(BLEND_LEAD, k)))
            rest = deviation[span.start + len(lead) - h : span.end - h]
            top = torch.topk(rest, k - len(lead)).indices + span.start + len(lead)
            chosen[i] = sorted(lead + top.tolist())
        return chosen

    def _probe(self, ids: list[int], exact: KV | None, h: int, chunk: int | None) -> Work:
        """Fresh K/V `[h + len(ids), 2, H, D]` of the probe layer: a forward stopped after it (the
        model's layers are whole again between chunks: other requests run there)."""
        layer = min(PROBE_LAYER, len(self.specs) - 1)
        past = self._cache(exact, h)
        for piece in _pieces(ids, chunk):
            with self.runner.lock, _first_layers(self.model, layer + 1), torch.inference_mode():
                self._call(piece, past, position_ids=None, mask=None)
            yield len(piece)
        (k, v) = hf.extract(past, self.specs[: layer + 1], 0, h + len(ids))[layer]
        return torch.stack((k, v), dim=1)

    def _recompute(
        self,
        ids: list[int],
        base: list[torch.Tensor],
        reused: torch.Tensor,
        h: int,
        end: int,
        chunk: int | None,
    ) -> Work:
        """The cache of positions [0, end): `base` where reused, the rest computed in one forward
        (or chunks of it) in which each recomputed token attends to reused and recomputed tokens
        before it only. A chunk's KV is written back in place before the next chunk reads it."""
        past = hf.build_cache(self.model.config, self.specs, base, end)
        todo = torch.nonzero(~reused[h:end]).flatten() + h
        held = reused.clone()  # positions whose KV the cache holds in place: reused, or recomputed
        dtype = self.model.dtype
        for piece in _pieces(todo, chunk):
            positions = piece.to(self.runner.device)
            allowed_cached = (torch.arange(end)[None, :] < piece[:, None]) & held[None, :]
            allowed_cached[:, :h] = True
            allowed_new = piece[None, :] <= piece[:, None]
            allowed = torch.cat((allowed_cached, allowed_new), dim=1).to(self.runner.device)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            mask.masked_fill_(~allowed, torch.finfo(dtype).min)
            with self.runner.lock, torch.inference_mode():
                self._call([ids[p] for p in piece.tolist()], past, positions[None], mask[None, None])
                hf.place_appended(past, positions, end)
            held[piece] = True
            yield len(piece)
        return past

    def _cache(self, exact: KV | None, h: int):
        if exact is None:
            return hf.empty_cache(self.model.config)
        return hf.build_cache(self.model.config, self.specs, [torch.stack(kv, dim=1) for kv in exact], h)

    def _call(self, ids: list[int], past, position_ids, mask) -> None:
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.runner.device)
        kwargs = {"logits_to_keep": 1} if self.runner._keep_arg else {}
        self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            use_cache=True,
            **{self.runner._cache_arg: past},
            **kwargs,
        )


def kv_deviation(fresh: torch.Tensor, reused: torch.Tensor) -> torch.Tensor:
    """Per token of `[T, 2, H, D]` K/V, the squared deviation of the reused rows from the fresh ones,
    per K/V and head relative to that head's mean squared fresh norm, summed. Raw squared distances
    rank by the keys of the loudest head only: keys are an order of magnitude larger than values,
    and a few heads larger than the rest."""
    fresh = fresh.double()
    error = (fresh - reused.double()).pow(2).sum(dim=-1)
    scale = fresh.pow(2).sum(dim=-1).mean(dim=0, keepdim=True)
    return (error / scale.clamp_min(torch.finfo(torch.float64).tiny)).sum(dim=(1, 2))


def finish(work: Work) -> Any:
    """Run resumable block work to its end; its result."""
    while True:
        try:
            next(work)
        except StopIteration as done:
            return done.value


def _pieces(items: Sequence | torch.Tensor, chunk: int | None) -> list:
    """`items` in consecutive runs of at most `chunk` (None: one run); none when empty."""
    step = chunk or max(len(items), 1)
    return [items[i : i + step] for i in range(0, len(items), step)]


def origin(device: int, hit) -> dict[str, int]:
    """Where the `hit.length` tokens of a block's lookup came from: the `device` tokens the pool held
    before it, then what each spill tier gave (`Hit.tiers`, in lookup order), cut at the hit. Hit
    tokens neither gave (another request stored them meanwhile) were in the pool: `device`."""
    out, left = {"device": min(device, hit.length)}, hit.length - min(device, hit.length)
    for tier, n in hit.tiers.items():
        out[tier] = min(n, left)
        left -= out[tier]
    out["device"] += left
    return out


def _tiers(use: BlockUse, reused: torch.Tensor) -> dict[str, int]:
    """Where the KV of a block's reused tokens (`reused`, per placed token) came from: the device
    pool, each spill tier, or computed by this request to store the block ("fill")."""
    at = torch.arange(len(reused))
    out, start = {}, 0
    for tier, n in use.origin.items():
        out[tier] = int((reused & (at >= start) & (at < start + n)).sum())
        start += n
    out["fill"] = int(reused.sum()) - sum(out.values())
    return out


def _reusable(spans: list[BlockSpan], h: int, last: int) -> list[BlockSpan]:
    """The blocks wholly past the exact prefix hit, cut before the last prompt token."""
    return [replace(s, length=min(s.length, last - s.start)) for s in spans if h <= s.start < last]


@contextmanager
def _first_layers(model, count: int):
    """Run the model's decoder on its first `count` layers only (the caller holds the runner's lock)."""
    decoder = model.get_decoder()
    layers = decoder.layers
    decoder.layers = layers[:count]
    try:
        yield
    finally:
        decoder.layers = layers
