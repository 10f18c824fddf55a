"""The fused attention call the cascade strategies are made of, and their exact merge.

A cascade attends a row's keys in disjoint sets (a shared run read in place, the row's own keys
gathered) and merges the results by their log-sum-exps: `fused` returns both (on CPU the flash
kernel, which also returns each row's log-sum-exp; elsewhere the same math in matrix products),
`combine` merges them in a fixed order.
"""

from __future__ import annotations

import torch

# the CPU fused attention kernel that also returns each row's log-sum-exp (what cascade merges by)
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention `q [B, H, R, D]` over `k, v [B, H, L, D]` with an additive `bias` broadcast to `[B,
    H, R, L]`: the output and each row's log-sum-exp. On CPU one call of the flash kernel (which
    returns the log-sum-exp and reads strided K/V); elsewhere the same math in matrix products."""
    if q.device.type == "cpu":
        out, lse = _flash(q, k, v, attn_mask=bias, scale=scale)
        return out, lse
    return attend(q, k.transpose(-1, -2), v, scale, bias)


def attend(
    q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, scale: float, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention `q [..., R, D]` over `k_t [..., D, L]` and `v [..., L, D]` (an additive
    `bias` broadcast to the scores masks with -inf); returns the output and each row's log-sum-exp."""
    scores = torch.matmul(q * scale, k_t)  # scaling q: R x D multiplications instead of R x L
    if bias is not None:
        scores += bias
    top = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(top).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    return torch.matmul(weights, v).div_(total), (top + total.log()).squeeze(-1)


def combine(results: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """Attention over the union of disjoint key sets from each set's output `results [N, T, H, D]`
    and log-sum-exp `sums [N, T, H]`: each output weighted by its share (one elementwise product for
    all), then added in order (mul and add kept apart: no fused rounding)."""
    weights = (sums - sums.amax(dim=0)).exp_()
    terms = results * weights[..., None]  # in the log-sum-exp's dtype (at least float32)
    acc, total = terms[0], weights[0].clone()
    for i in range(1, len(terms)):
        acc += terms[i]
        total += weights[i]
    return acc.div_(total[..., None]).to(results.dtype)


def row_padding(rows: int, multiple: int) -> int:
    """Query rows to add so that a fused call's `rows` become a multiple of `multiple` (0: none). The
    CPU kernel attends query rows in tiles of 32, 64 or 256 and rounds a row differently in a tile
    of fewer than `probes.MIN_ROWS` rows; with a multiple of `MIN_ROWS` no tile is that small."""
    return -rows % multiple if multiple else 0


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """Log-sum-exps are kept in at least float32 (what the fused kernel returns for half types)."""
    return torch.promote_types(dtype, torch.float32)
