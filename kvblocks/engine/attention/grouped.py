"""Grouped calls (the CUDA default): short segments padded into one attention call per layer.

On a GPU a call per segment is launch-bound, so the segments of at most `GROUP_MAX_TOKENS` new
tokens (decodes, speculative rounds) share one SDPA call per layer over their slot lists padded to
one batch (`graphs.padded_attention`, what a CUDA graph replays too); longer ones (prefill chunks)
keep a call each. Not batch-invariant: a padded call's key length depends on the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvblocks.engine import graphs
from kvblocks.engine.attention.per_segment import PerSegment


@dataclass(frozen=True, slots=True)
class Grouped(PerSegment):
    """The strategy of grouped calls: short segments in one call, the others one call each."""

    name: ClassVar[str] = "grouped"
    groups: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class Group:
    """Segments padded to `[G, width]` query rows over `[G, length]` key slots: `rows` are the query
    rows taken from the packed sequence, `reads` the pool slots read, `mask` `[G, 1, width, length]`
    what each row may attend to; `out` are the packed rows written back, from the padded rows `flat`."""

    rows: torch.Tensor
    reads: torch.Tensor
    mask: torch.Tensor
    out: torch.Tensor
    flat: torch.Tensor

    @classmethod
    def pad(
        cls,
        members: Sequence[tuple[tuple[int, int], np.ndarray, int]],
        firsts: Sequence[int],
        window: int | None,
        device: torch.device,
    ) -> Group:
        """Members are (packed rows, slots, start); each reads its keys from position `first` on."""
        width = max(b - a for (a, b), _, _ in members)
        length = max(len(slots) - first for (_, slots, _), first in zip(members, firsts))
        rows = np.zeros((len(members), width), dtype=np.int64)
        reads = np.zeros((len(members), length), dtype=np.int64)
        mask = np.zeros((len(members), 1, width, length), dtype=bool)
        flat: list[int] = []
        for m, (((a, b), slots, start), first) in enumerate(zip(members, firsts)):
            n, read = b - a, len(slots) - first
            rows[m, :n], rows[m, n:] = np.arange(a, b), b - 1
            reads[m, :read], reads[m, read:] = slots[first:], slots[-1]
            q = np.arange(start, len(slots))[:, None]
            k = np.arange(first, len(slots))[None, :]
            mask[m, 0, :n, :read] = (k <= q) & (True if window is None else k > q - window)
            mask[m, 0, n:, 0] = True  # padding rows attend to one key (no all-masked row: NaN)
            flat += range(m * width, m * width + n)
        return cls(
            torch.from_numpy(rows).to(device),
            torch.from_numpy(reads).to(device),
            torch.from_numpy(mask).to(device),
            torch.from_numpy(rows.reshape(-1)[flat]).to(device),
            torch.tensor(flat, dtype=torch.long, device=device),
        )


def grouped_attention(
    pool_layer: torch.Tensor, query: torch.Tensor, group: Group, scale: float, groups: int
) -> torch.Tensor:
    """One SDPA call for all the group's segments (`graphs.padded_attention`): `[len(group.out), Hq, D]`."""
    q = query[0][:, group.rows].transpose(0, 1)  # [G, Hq, width, D]
    g, heads, width, dim = q.shape
    o = graphs.padded_attention(pool_layer, q, group.reads, group.mask.repeat(1, 1, groups, 1), scale)
    return o.reshape(g * width, heads, dim)[group.flat]
