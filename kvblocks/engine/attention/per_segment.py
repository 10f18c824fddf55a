"""A call per segment: each request's queries attend its keys, gathered through its slot list.

The path every strategy falls back to where its plans do not reach: layers with a sliding window
or soft-capping (gemma2 soft-caps with explicit math), draft trees under their own masks, and the
whole forward when no other strategy is chosen (batch-invariant forwards where the fixed cuts'
probe fails). SDPA with grouped heads; off the CPU the query heads of a K/V head are stacked along
the rows, so the memory-efficient kernel serves the masked call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvblocks.engine import kernel
    from kvblocks.engine.attention.batch import PackedBatch


@dataclass(frozen=True, slots=True)
class PerSegment:
    """The strategy of one call per segment. `align`: in batch-invariant forwards, windowed layers
    read from the window of the first position of the segment's prompt chunk (`PackedBatch.views`)."""

    align: int = 1
    name: ClassVar[str] = "per-segment"
    groups: ClassVar[bool] = False  # short segments share one call (`grouped.Grouped`)
    direct: ClassVar[bool] = False
    direct_reason: ClassVar[str | None] = "it serves cascade attention only"

    @property
    def cuts(self) -> None:
        """No fixed cuts (`FixedCuts.cuts`)."""
        return None

    def plan(self, batch: PackedBatch, members: Sequence[int]) -> None:
        """No plan: every segment attends on its own."""
        return None

    def plan_direct(self, batch: PackedBatch, members: Sequence[int]) -> kernel.Plan:
        """Never called (`direct` is False): the CPU kernel serves cascade attention only."""
        raise NotImplementedError(f"the attention kernel cannot be used: {self.direct_reason}")


def segment_attention(
    pool_layer: torch.Tensor,
    q: torch.Tensor,
    index: torch.Tensor | slice,
    mask: torch.Tensor,
    scale: float,
    groups: int,
    softcap: float | None,
) -> torch.Tensor:
    """One segment's attention `[n, Hq, D]`: its queries `q [Hq, n, D]` over the slots `index`."""
    kv = (pool_layer[index] if isinstance(index, slice) else pool_layer.index_select(0, index)).to(q.dtype)
    k = kv[:, 0].transpose(0, 1)  # [Hkv, L, D]
    v = kv[:, 1].transpose(0, 1)
    if softcap is None and q.device.type == "cpu":
        # 4-D inputs: SDPA takes its fused CPU kernel (3-D with a mask and GQA is 2-3x slower)
        return F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=groups > 1
        )[0].transpose(0, 1)
    if softcap is None:
        return stacked_heads_attention(q, k, v, mask, scale, groups)
    k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
    scores = torch.matmul(q, k.transpose(1, 2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v).transpose(0, 1)


def stacked_bias(allowed: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """`allowed [n, L]` as an additive bias `[groups * n, L]` in `dtype` (0 where allowed, -inf
    elsewhere), repeated for `groups` query heads stacked along the rows; its row stride is a
    multiple of 8 elements, the alignment SDPA's memory-efficient kernel takes without padding."""
    allowed = allowed.repeat(groups, 1)
    rows, length = allowed.shape
    aligned = torch.full((rows, -(-length // 8) * 8), float("-inf"), dtype=dtype, device=allowed.device)
    return aligned[:, :length].masked_fill_(allowed, 0.0)


def stacked_heads_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, groups: int
) -> torch.Tensor:
    """`[n, Hq, D]` from `q [Hq, n, D]` over `k, v [Hkv, L, D]`, the query heads of a K/V head stacked
    along the rows, `mask [groups * n, L]` (boolean or additive) stacked so (`PackedBatch.segment_mask`).
    Off the CPU a masked call with `enable_gqa` takes SDPA's math fallback, which repeats K/V per head;
    this one can take the memory-efficient kernel."""
    heads, n, dim = q.shape
    o = F.scaled_dot_product_attention(
        q.reshape(1, k.shape[0], groups * n, dim), k[None], v[None], attn_mask=mask, scale=scale
    )
    return o.reshape(heads, n, dim).transpose(0, 1)


def plain_attention(
    pool_layer: torch.Tensor,
    query: torch.Tensor,
    batch: PackedBatch,
    plain: Sequence[int],
    out: torch.Tensor,
    scale: float,
    groups: int,
) -> None:
    """The segments `plain` (of a layer without a window or soft-capping), each attending all its
    keys in one call, into `out`."""
    views = batch.views(None) if plain else []
    for i in plain:
        (a, b), (index, _) = batch.bounds[i], views[i]
        mask = batch.segment_mask(None, i, groups, query.dtype)
        out[a:b] = segment_attention(pool_layer, query[0, :, a:b], index, mask, scale, groups, None)
