"""Cascade attention (the CPU default unless batch-invariant): a shared prefix read once, in place.

When several running requests' keys begin with the same pool slots (a system prompt the trie stored
once), their queries attend those shared keys together in one fused call reading the slots in place,
and the requests' own keys in one batched call per number of new tokens (gathered once per layer,
masks made once per forward); the two results are merged exactly by their log-sum-exps
(`fused.combine`). A request alone is cut the same way (its cut depends on its own slots only), so a
decode step after a long cached prompt reads that prompt in place rather than copying it with the
request's own keys every layer. Within 1e-10 of one request alone in fp64 (tests/test_paged.py,
tests/test_paged_cascade.py); the batched calls differ from a request alone in the last bits of fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np
import torch

from kvblocks.engine.attention.batch import leading_run, rows_of
from kvblocks.engine.attention.direct import kernel_plan
from kvblocks.engine.attention.fused import combine, fused, lse_dtype, row_padding
from kvblocks.engine.attention.per_segment import plain_attention

if TYPE_CHECKING:
    from kvblocks.engine import kernel
    from kvblocks.engine.attention.batch import PackedBatch

# A segment's keys are cut where its leading run of consecutive slots ends (before its new tokens),
# when the run has at least `CASCADE_MIN_RUN` slots; segments cut at the same slots (a prefix the
# trie stored once) attend that run together in one matrix product.
CASCADE_MIN_RUN = 32
# Segments' own keys (after their cut) are attended in batches padded to their longest: a batch's
# longest own key count is at most this many times its shortest.
OWN_PAD = 2


@dataclass(frozen=True, slots=True)
class Cascade:
    """The cascade strategy: runs of at least `min_run` slots read in place. With `direct`, narrow
    segments go to the CPU kernel (`direct.py`); `direct_reason` says why not otherwise."""

    min_run: int = CASCADE_MIN_RUN
    direct: bool = False
    direct_reason: str | None = "turned off"
    align: int = 1
    name: ClassVar[str] = "cascade"
    groups: ClassVar[bool] = False

    @property
    def cuts(self) -> Sequence[int] | None:
        """The sizes of the fixed cuts (`FixedCuts`); None: keys cut where their leading run ends."""
        return None

    def plan(self, batch: PackedBatch, members: Sequence[int]) -> LayerPlan:
        return CascadePlan.of(batch, self.min_run, members)

    def plan_direct(self, batch: PackedBatch, members: Sequence[int]) -> kernel.Plan:
        return kernel_plan(batch, members, self.min_run)


class LayerPlan(Protocol):
    """What a cascade's plan does for each layer without a window (`CascadePlan`, `FixedCutsPlan`)."""

    def attend(
        self, pool_layer: torch.Tensor, query: torch.Tensor, batch: PackedBatch, scale: float, groups: int
    ) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class Part:
    """Query `rows` of the packed sequence attending a shared run of pool slots `keys` (a slice: the
    keys are read in place, nothing is copied)."""

    keys: slice
    rows: slice | torch.Tensor


@dataclass(slots=True)
class Own:
    """Segments with the same number `width` of new tokens attending their own keys (after their
    cuts) in one batched call: `reads` are `[segments * length]` pool slots (each segment's keys
    padded to `length` with its last slot), `rows` the segments' packed rows, `allowed` `[segments,
    width, length]` which keys each row sees (None: all of them, as for decodes of equal length).
    `biases` keeps the additive masks a layer's call needs, made once per forward."""

    reads: torch.Tensor
    rows: slice | torch.Tensor
    allowed: torch.Tensor | None
    segments: int
    width: int
    length: int
    min_rows: int = 0  # batch-invariant: query rows per call padded (zeros) to a multiple of this
    biases: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def padding(self, groups: int) -> int:
        """Zero query rows added to each (segment, K/V head) of the call (`fused.row_padding`)."""
        return row_padding(groups * self.width, self.min_rows)

    def bias(self, groups: int, dtype: torch.dtype) -> torch.Tensor | None:
        """`[segments, 1, groups * width (+ padding), length]` (0 or -inf), the layout of the batched
        scores (query heads of a K/V head stacked along the rows; padding rows see every key); the
        same for every layer, so built by the first."""
        if self.allowed is None:
            return None
        key = (groups, dtype)
        if key not in self.biases:
            allowed = self.allowed[:, None, None].expand(-1, -1, groups, -1, -1)
            bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            bias.masked_fill_(~allowed, float("-inf"))
            bias = bias.reshape(self.segments, 1, groups * self.width, self.length)
            pad = self.padding(groups)
            if pad:
                bias = torch.cat((bias, bias.new_zeros(self.segments, 1, pad, self.length)), dim=2)
            self.biases[key] = bias
        return self.biases[key]


@dataclass(frozen=True, slots=True)
class CascadePlan:
    """The plan of a cascade forward on layers without a window. A segment's keys are cut at the end
    of its leading run of consecutive slots (before its first new token, if at least `min_run`
    long), so requests that share a prefix the trie stored in one piece are cut at the same slots. The
    cut depends on the segment's own slots only, never on the rest of the batch: a request alone is cut
    where it is cut in a batch, and its run is read in place instead of copied with its own keys.
    `runs` are the leading runs: every segment cut at the same slots attends them in one fused call
    reading the slots in place. `own` are the rest of each segment's keys: segments with the same
    number of new tokens and similar key counts (padded at most `OWN_PAD`-fold) in one batched call. A
    row's two results are merged exactly by log-sum-exp. Segments with no cut (`plain`: no leading run
    of `min_run` slots) need no merge: they attend all their keys in one fused call each."""

    runs: list[Part]
    own: list[Own]
    plain: list[int]

    @classmethod
    def of(cls, batch: PackedBatch, min_run: int, members: Sequence[int]) -> CascadePlan:
        """The plan of the batch's segments `members` (the others are attended elsewhere)."""
        device = batch.pool.device
        cuts = [leading_run(slots, start, min_run) for slots, start in zip(batch.slots, batch.starts)]
        outside = set(range(len(cuts))) - set(members)
        by_run: dict[tuple[int, int], list[int]] = {}
        for i in members:
            if cuts[i]:
                by_run.setdefault((int(batch.slots[i][0]), cuts[i]), []).append(i)
        runs = [
            Part(slice(first, first + n), rows_of(batch, group, device))
            for (first, n), group in by_run.items()
        ]
        batches = own_batches(batch, [0 if i in outside else cut for i, cut in enumerate(cuts)])
        own = [own_keys(batch, group, cuts, device) for group in batches]
        return cls(runs, own, [i for i in members if not cuts[i]])

    def attend(
        self, pool_layer: torch.Tensor, query: torch.Tensor, batch: PackedBatch, scale: float, groups: int
    ) -> torch.Tensor:
        """`[T, Hq, D]`: each row of a cut segment attends its own keys, then its shared run's, merged
        by log-sum-exp; a segment with no cut attends all its keys in one call. Rows of segments
        outside the plan are left unwritten."""
        tokens, heads, dim = query.shape[2], query.shape[1], query.shape[3]
        out = torch.empty(tokens, heads, dim, dtype=query.dtype, device=query.device)
        lse = torch.empty(tokens, heads, dtype=lse_dtype(query.dtype), device=query.device)
        plain_attention(pool_layer, query, batch, self.plain, out, scale, groups)
        for own in self.own:
            out[own.rows], lse[own.rows] = own_attention(pool_layer, query, own, scale, groups)
        for part in self.runs:
            o, sums = run_attention(pool_layer, query, part, 1, scale, groups, 0)  # the run as one piece
            out[part.rows] = combine(
                torch.stack((out[part.rows], o[0])), torch.stack((lse[part.rows], sums[0]))
            )
        return out


def own_batches(batch: PackedBatch, cuts: Sequence[int]) -> list[list[int]]:
    """The cut segments in batches of one width (new tokens), by their own key counts: a batch's
    longest is at most `OWN_PAD` times its shortest, so padding never dominates the work."""
    by_width: dict[int, list[int]] = {}
    for i, cut in enumerate(cuts):
        if cut:
            by_width.setdefault(len(batch.segments[i].token_ids), []).append(i)
    batches = []
    for members in by_width.values():
        members.sort(key=lambda i: len(batch.slots[i]) - cuts[i])
        current: list[int] = []
        for i in members:
            if current and len(batch.slots[i]) - cuts[i] > OWN_PAD * (
                len(batch.slots[current[0]]) - cuts[current[0]]
            ):
                batches.append(current)
                current = []
            current.append(i)
        batches.append(current)
    return batches


def own_keys(
    batch: PackedBatch,
    members: Sequence[int],
    cuts: Sequence[int] | dict[int, int],
    device: torch.device,
    length: int | None = None,
    min_rows: int = 0,
) -> Own:
    """The keys of `members` (all of one width) after their cuts, padded to one length (their
    longest, or `length`); a row sees its own segment's keys up to its position."""
    width = len(batch.segments[members[0]].token_ids)
    length = length or max(len(batch.slots[i]) - cuts[i] for i in members)
    reads = np.empty((len(members), length), dtype=np.int64)
    allowed = np.zeros((len(members), width, length), dtype=bool)
    for m, i in enumerate(members):
        slots, start = batch.slots[i], batch.starts[i]
        q = np.arange(start, len(slots))[:, None]
        k = np.arange(cuts[i], len(slots))[None, :]
        reads[m, : k.shape[1]], reads[m, k.shape[1] :] = slots[cuts[i] :], slots[-1]
        allowed[m, :, : k.shape[1]] = k <= q
    mask = None if allowed.all() and not min_rows else torch.from_numpy(allowed).to(device)
    index = batch.pool.index(reads.reshape(-1))
    return Own(index, rows_of(batch, members, device), mask, len(members), width, length, min_rows)


def run_attention(
    pool_layer: torch.Tensor,
    query: torch.Tensor,
    part: Part,
    n: int,
    scale: float,
    groups: int,
    min_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A run cut into `n` equal pieces, each attended on its own by the run's rows, in one fused call
    over the run's slots read in place (the pieces are its batch): `([n, R, Hq, D], [n, R, Hq])`.
    The query heads of a K/V head are stacked along the rows (so no K/V is repeated), padded to a
    multiple of `min_rows` (0: not padded)."""
    kv = pool_layer[part.keys].to(query.dtype)  # [n * piece, 2, Hkv, D], a view
    kv = kv.view(n, -1, *kv.shape[1:])
    q = query[0][:, part.rows]  # [Hq, R, D]
    heads, rows, dim = q.shape
    kv_heads = kv.shape[3]
    q = q.reshape(1, kv_heads, groups * rows, dim)
    pad = row_padding(groups * rows, min_rows)
    if pad:
        q = torch.cat((q, q.new_zeros(1, kv_heads, pad, dim)), dim=2)
    q = q.expand(n, -1, -1, -1)
    o, sums = fused(q, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2), scale)
    o = o[:, :, : groups * rows].reshape(n, heads, rows, dim).transpose(1, 2)
    return o, sums[:, :, : groups * rows].reshape(n, heads, rows).transpose(1, 2)


def own_attention(
    pool_layer: torch.Tensor, query: torch.Tensor, own: Own, scale: float, groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The own keys of a batch of segments, `([S * width, Hq, D], [S * width, Hq])`: one gather of
    whole slots, then one fused call over (segment, K/V head) pairs reading the gathered K and V as
    strided views; the query heads of a K/V head are stacked along the rows."""
    s, width, length = own.segments, own.width, own.length
    kv = pool_layer.index_select(0, own.reads).to(query.dtype).view(s, length, *pool_layer.shape[1:])
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [S, Hkv, L, D]
    q = query[0][:, own.rows]  # [Hq, S * width, D]
    heads, _, dim = q.shape
    kv_heads = k.shape[1]
    q = q.view(kv_heads, groups, s, width, dim).permute(2, 0, 1, 3, 4).reshape(s, kv_heads, -1, dim)
    pad = own.padding(groups)
    if pad:
        q = torch.cat((q, q.new_zeros(s, kv_heads, pad, dim)), dim=2)
    o, sums = fused(q, k, v, scale, own.bias(groups, query.dtype))
    rows = groups * width
    o = (
        o[:, :, :rows]
        .reshape(s, kv_heads, groups, width, dim)
        .permute(0, 3, 1, 2, 4)
        .reshape(s * width, heads, dim)
    )
    return o, sums[:, :, :rows].reshape(s, kv_heads, groups, width).permute(0, 3, 1, 2).reshape(
        s * width, heads
    )
