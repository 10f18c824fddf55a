"""Fixed cuts (the CPU default with `--batch-invariant`): the cascade cut at fixed positions.

A row's keys are split into whole pieces (of 2,048 positions, then 256, then 64) and a tail, each
attended on its own over a length that depends on the row's position only, and the results combined
by log-sum-exp in a fixed order. Requests that hold the same pieces in the same slots (a stored
system prompt) attend them in one call reading the slots in place; other pieces are gathered. How a
piece is read and with whom never changes a row's bits (`probes.probe_blocks_invariance` checks what
that relies on: the fused kernel's rows in calls of any multiple of `MIN_ROWS` rows, and exp / log
wherever an element lies).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvblocks.engine.attention.batch import index_of, leading_run, rows_of
from kvblocks.engine.attention.cascade import Cascade, Own, Part, own_attention, own_keys, run_attention
from kvblocks.engine.attention.fused import combine, lse_dtype
from kvblocks.engine.attention.per_segment import plain_attention
from kvblocks.engine.attention.probes import MIN_ROWS

if TYPE_CHECKING:
    from kvblocks.engine.attention.batch import PackedBatch

# A row's keys are cut into whole pieces of these sizes at fixed positions, each attended on its own;
# rounded up, the smallest to a multiple of the prompt chunk and each to a multiple of the next smaller.
CASCADE_CUTS = (2048, 256, 64)


@dataclass(frozen=True, slots=True)
class FixedCuts(Cascade):
    """The batch-invariant cascade strategy: keys cut into pieces of `sizes` (largest first)."""

    sizes: Sequence[int] = CASCADE_CUTS

    @property
    def cuts(self) -> Sequence[int]:
        return self.sizes

    def plan(self, batch: PackedBatch, members: Sequence[int]) -> FixedCutsPlan:
        return FixedCutsPlan.of(batch, self.sizes, members)

    @staticmethod
    def rounded(chunk: int, sizes: Sequence[int]) -> list[int]:
        """`sizes` rounded up: the smallest to a multiple of the prompt `chunk` (so no segment spans
        a cut), each to a multiple of the next smaller; largest first, without repeats."""
        rounded = [chunk]
        for size in sorted(sizes):
            rounded.append(-(-size // rounded[-1]) * rounded[-1])
        return sorted(set(rounded[1:]), reverse=True)


@dataclass(frozen=True, slots=True)
class FixedCutsPlan:
    """The plan of a batch-invariant cascade forward on layers without a window: each row's attention
    is computed the same way whatever else is in the batch and wherever its K/V lie in the pool.

    A row's keys before its segment's first new token are cut into whole pieces at fixed positions:
    pieces of `sizes[0]` positions up to the last multiple of it, then of `sizes[1]`, and so on (each
    size a multiple of the next and the last a multiple of the prompt chunk, so no segment spans a
    cut). Each piece is attended on its own over exactly its keys; the rest, from the last cut on (the
    `tails`), over a length padded to a multiple of the last size. Every call gives each (segment,
    K/V head) a multiple of `MIN_ROWS` query rows, and a row's results are combined by log-sum-exp in a
    fixed order: its tail, then its pieces from the first. The positions alone decide the arithmetic.

    Only how pieces are read depends on the batch: `runs` are pieces of one size in consecutive slots
    (a prefix the trie stored in one piece), which every segment starting with them attends in one
    call reading the slots in place (the pieces are the call's batch); `private` are the other pieces,
    gathered, one call per size and width. A tail is always as long as a piece of the last size, so
    such pieces are gathered and attended in their width's tail call (`tails`), under the tails' mask
    (all keys allowed): whatever the batch, a piece of the last size is attended in a masked call and
    a larger one in an unmasked call. `plain` segments (speculative rounds, whose rows may span a cut)
    keep a call each."""

    runs: list[tuple[Part, int, int]]  # the run, its number of pieces, the index of its first in the fold
    private: list[tuple[Own, torch.Tensor]]  # gathered pieces; where each row's result goes (fold * T + row)
    # a width's tails, then its gathered pieces of the last size: the call, its tail rows, the pieces' targets
    tails: list[tuple[Own, int, torch.Tensor | None]]
    plain: list[int]
    depth: int  # the most pieces any row has
    folds: dict[tuple[int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def of(cls, batch: PackedBatch, sizes: Sequence[int], members: Sequence[int]) -> FixedCutsPlan:
        """The plan of the batch's segments `members` (the others are attended elsewhere)."""
        last = sizes[-1]
        # (first slot, size, pieces, fold) -> segments; (size, width) -> (segment, position, fold);
        # (width, padded length) -> segments
        runs: dict[tuple[int, int, int, int], list[int]] = {}
        private: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        tails: dict[tuple[int, int], list[int]] = {}
        plain, cuts, depth = [], {}, 0
        for i in members:
            segment, slots, start = batch.segments[i], batch.slots[i], batch.starts[i]
            if segment.keep > 1 or start // last != (len(slots) - 1) // last:
                plain.append(i)
                continue
            width = len(segment.token_ids)
            run = leading_run(slots, start, 1)
            position = fold = 0
            for size in sizes:
                n = start // size - position // size
                shared = min(n, max(0, run - position) // size)
                if shared:
                    runs.setdefault((int(slots[position]), size, shared, fold), []).append(i)
                private.setdefault((size, width), []).extend(
                    (i, position + j * size, fold + j) for j in range(shared, n)
                )
                position, fold = position + n * size, fold + n
            cuts[i], depth = position, max(depth, fold)
            padded = -(-(len(slots) - position) // last) * last
            tails.setdefault((width, padded), []).append(i)
        calls = _tail_calls(batch, tails, private, cuts, last)  # takes the last size's pieces first
        return cls(
            [
                (Part(slice(first, first + n * size), rows_of(batch, group, batch.pool.device)), n, fold)
                for (first, size, n, fold), group in runs.items()
            ],
            [gathered(batch, size, width, group) for (size, width), group in private.items() if group],
            calls,
            plain,
            depth,
        )

    def fold(
        self, tokens: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-piece results, made once per forward and written by every layer at the same places:
        `[depth + 1, T, heads, dim]` outputs (zeros) and `[depth + 1, T, heads]` log-sum-exps (-inf),
        index 0 the tails, then the pieces in order. What a layer leaves unwritten (a row's missing
        pieces, the `plain` rows) keeps its first value."""
        key = (heads, dim, dtype)
        if key not in self.folds:
            depth = self.depth + 1
            self.folds[key] = (
                torch.zeros(depth, tokens, heads, dim, dtype=dtype, device=device),
                torch.full((depth, tokens, heads), float("-inf"), dtype=lse_dtype(dtype), device=device),
            )
        return self.folds[key]

    def attend(
        self, pool_layer: torch.Tensor, query: torch.Tensor, batch: PackedBatch, scale: float, groups: int
    ) -> torch.Tensor:
        """`[T, Hq, D]`: each row's tail and its pieces, combined by log-sum-exp in a fixed order. A
        piece a row lacks has the results (0, -inf), which add exact zeros, so one pass over the
        fold's depth serves every row at once."""
        heads, dim = query.shape[1], query.shape[3]
        results, sums = self.fold(batch.tokens, heads, dim, query.dtype, query.device)
        pieces, piece_sums = results[1:].view(-1, heads, dim), sums[1:].view(-1, heads)  # fold * T + row
        for own, rows, target in self.tails:
            o, sum_ = own_attention(pool_layer, query, own, scale, groups)
            if target is None:
                results[0, own.rows], sums[0, own.rows] = o, sum_
                continue
            assert isinstance(own.rows, torch.Tensor), "a tail with pieces has its rows gathered"
            results[0, own.rows[:rows]], sums[0, own.rows[:rows]] = o[:rows], sum_[:rows]
            pieces[target], piece_sums[target] = o[rows:], sum_[rows:]
        for part, n, fold in self.runs:
            o, sum_ = run_attention(pool_layer, query, part, n, scale, groups, MIN_ROWS)
            results[1 + fold : 1 + fold + n, part.rows], sums[1 + fold : 1 + fold + n, part.rows] = o, sum_
        for own, target in self.private:
            pieces[target], piece_sums[target] = own_attention(pool_layer, query, own, scale, groups)
        out = combine(results, sums)
        plain_attention(pool_layer, query, batch, self.plain, out, scale, groups)
        return out


def _tail_calls(
    batch: PackedBatch,
    tails: dict[tuple[int, int], list[int]],
    private: dict[tuple[int, int], list[tuple[int, int, int]]],
    cuts: dict[int, int],
    last: int,
) -> list[tuple[Own, int, torch.Tensor | None]]:
    """One call per width for its tails, with its gathered pieces of the last size (taken out of
    `private`)."""
    calls = []
    for (width, length), members in tails.items():
        assert length == last, "a segment within one chunk has a tail of one piece"
        tail = own_keys(batch, members, cuts, batch.pool.device, length, MIN_ROWS)
        calls.append(with_gathered(batch, tail, private.pop((last, width), [])))
    return calls


def gathered(
    batch: PackedBatch, size: int, width: int, members: Sequence[tuple[int, int, int]]
) -> tuple[Own, torch.Tensor]:
    """Pieces `(segment, first position, fold index)` of one `size`, of segments of one `width`,
    that are not read in place: their slots gathered and attended in one call; and where each row's
    result goes in the `[depth * T]` rows of the piece results (`fold * T + row`)."""
    device = batch.pool.device
    reads = np.concatenate([batch.slots[i][p : p + size] for i, p, _ in members])
    rows = np.concatenate([np.arange(*batch.bounds[i]) for i, _, _ in members])
    target = np.concatenate([np.arange(*batch.bounds[i]) + f * batch.tokens for i, _, f in members])
    index = torch.from_numpy(rows).to(device)
    own = Own(batch.pool.index(reads), index, None, len(members), width, size, MIN_ROWS)
    return own, torch.from_numpy(target).to(device)


def with_gathered(
    batch: PackedBatch, tail: Own, members: Sequence[tuple[int, int, int]]
) -> tuple[Own, int, torch.Tensor | None]:
    """One call for a width's tails and its gathered pieces of the tails' length (`gathered`'s
    members): the tails' rows first, then the pieces' (which see all their keys)."""
    rows = tail.segments * tail.width
    if not members:
        return tail, rows, None
    pieces, target = gathered(batch, tail.length, tail.width, members)
    assert tail.allowed is not None, "a tail's mask is kept when its rows are padded (MIN_ROWS)"
    allowed = torch.ones(pieces.segments, tail.width, tail.length, dtype=torch.bool, device=target.device)
    own = Own(
        torch.cat((tail.reads, pieces.reads)),
        torch.cat([index_of(r, target.device) for r in (tail.rows, pieces.rows)]),
        torch.cat((tail.allowed, allowed)),
        tail.segments + pieces.segments,
        tail.width,
        tail.length,
        MIN_ROWS,
    )
    return own, rows, target
