"""The batch description: each request's share of a packed forward and the layout every layer reads.

A packed forward takes segments, one per request (or per piece of one): the request's new tokens
(a decode token, a chunk of prefill, a speculative round) and the pool slots of every position it
has so far, its new tokens' slots last. `PackedBatch` lays them out once: the packed token ids and
positions, where the new K/V are written, which rows each segment owns, and the plans by which its
attention strategy reads the keys (built by the strategy, read by every layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvblocks.cache.pool import KVPool
from kvblocks.engine import kernel
from kvblocks.engine import tree as trees
from kvblocks.engine.attention.grouped import Group
from kvblocks.engine.attention.per_segment import stacked_bias

if TYPE_CHECKING:
    from kvblocks.engine.attention.strategy import Attention

# In grouped mode, segments of at most this many new tokens (decodes, draft/verify rounds) share one
# attention call per layer; longer ones (prefill chunks) have enough work to run alone.
GROUP_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Segment:
    """One request's share of a packed forward: its new `token_ids` and the slots of all of its
    positions (`len(slots) >= len(token_ids)`; the new tokens' slots are the last ones).
    `keep` rows of logits come back for it: its last `keep` new tokens. A `tree` (a speculative
    round's draft tree, `kvblocks.engine.tree`) numbers and masks the new tokens by ancestry."""

    token_ids: Sequence[int]
    slots: np.ndarray
    keep: int = 1
    tree: tuple[int, ...] | None = None

    @property
    def start(self) -> int:
        """Position of the first new token."""
        return len(self.slots) - len(self.token_ids)


class PackedBatch:
    """The layout of one packed forward, built once and read by every layer. `attention` (a
    strategy of `kvblocks.engine.attention.strategy`) plans how its layers read the keys."""

    def __init__(self, pool: KVPool, segments: Sequence[Segment], attention: Attention) -> None:
        if not segments:
            raise ValueError("a packed forward needs at least one segment")
        self.pool = pool
        self.segments = list(segments)
        self.bounds, positions, writes = _layout(self.segments)  # bounds: each segment's packed rows
        self.tokens = self.bounds[-1][1]
        ids = [t for s in segments for t in s.token_ids]
        self.input_ids = torch.tensor([ids], dtype=torch.long, device=pool.device)
        self.position_ids = torch.from_numpy(positions.astype(np.int64))[None].to(pool.device)
        self.write_index = pool.index(writes)
        self.slots = [s.slots for s in segments]
        self.starts = [s.start for s in segments]
        self._align = attention.align
        self._views: dict[int | None, list[tuple[torch.Tensor | slice, torch.Tensor]]] = {}
        self._stacked: dict[tuple[int | None, int, int, torch.dtype], torch.Tensor] = {}
        self._groups: dict[int | None, Group] = {}
        # draft trees attend under their own masks, a call each (`per_segment.plain_attention`)
        self.trees = [i for i, s in enumerate(segments) if s.tree is not None]
        short = [i for i, s in enumerate(segments) if len(s.token_ids) <= GROUP_MAX_TOKENS and s.tree is None]
        self.grouped = short if attention.groups and len(short) > 1 else []  # one call per layer
        self.alone = sorted(set(range(len(segments))) - set(self.grouped))
        # The CPU kernel (`direct`) takes the segments of at most `kernel.MAX_WIDTH` new tokens, all of
        # their keys, a shared run read once per group (a row's bits do not depend on how its keys are
        # split, so this serves batch-invariant forwards too); the cascade plans take the others.
        rest = [i for i, s in enumerate(segments) if s.tree is None]
        narrow = (
            [i for i in rest if len(segments[i].token_ids) <= kernel.MAX_WIDTH] if attention.direct else []
        )
        self.direct = attention.plan_direct(self, narrow) if narrow else None
        rest = [i for i in rest if i not in set(narrow)]
        self.cascade = attention.plan(self, rest) if rest else None

    def views(self, window: int | None) -> list[tuple[torch.Tensor | slice, torch.Tensor]]:
        """Per segment, the slots its new tokens read and a boolean `[new, read]` mask: causal, and on
        a windowed layer only the last `window` positions of each token. Keys before the window of
        the segment's first position are not read at all; with `align`, reads start at the window
        of the first position of the `align`-sized chunk the segment starts in, so that a query row
        reads the same keys wherever the segment around it starts (batch invariance)."""
        if window not in self._views:
            out = []
            for segment, slots, start in zip(self.segments, self.slots, self.starts):
                first = 0 if window is None else max(0, start // self._align * self._align - window + 1)
                if segment.tree is not None:
                    visible = trees.visible(start, len(slots), first, segment.tree, window)
                    out.append(
                        (reader(self.pool, slots[first:]), torch.from_numpy(visible).to(self.pool.device))
                    )
                    continue
                q = torch.arange(start, len(slots), device=self.pool.device)[:, None]
                k = torch.arange(first, len(slots), device=self.pool.device)[None, :]
                allowed = k <= q
                if window is not None:
                    allowed &= k > q - window
                out.append((reader(self.pool, slots[first:]), allowed))
            self._views[window] = out
        return self._views[window]

    def segment_mask(self, window: int | None, segment: int, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """The mask `per_segment.segment_attention` takes for `views(window)[segment]`: on a CPU as
        it is; else an additive bias in `dtype` (0 or -inf) repeated for the `groups` query heads of
        a K/V head stacked along the rows (row `j * new + i` is head `j`'s row `i`), its rows 8-element
        aligned, made once per forward: SDPA then neither converts a boolean mask nor pads the bias
        for the memory-efficient kernel in every layer (each a kernel launch, which bound a GPU's
        prefill)."""
        if self.pool.device.type == "cpu":
            return self.views(window)[segment][1]
        key = (window, segment, groups, dtype)
        if key not in self._stacked:
            self._stacked[key] = stacked_bias(self.views(window)[segment][1], groups, dtype)
        return self._stacked[key]

    def keep_rows(self) -> torch.Tensor:
        """Rows of the packed sequence whose logits are returned, segment by segment."""
        rows = [torch.arange(b - s.keep, b) for (_, b), s in zip(self.bounds, self.segments)]
        return torch.cat(rows).to(self.pool.device)

    def group(self, window: int | None) -> Group:
        """The `grouped` segments padded to one batch: see `Group`. Keys start where `views` starts
        them (align 1); padding rows and keys repeat a real one and are masked out."""
        if window not in self._groups:
            members = [(self.bounds[i], self.slots[i], self.starts[i]) for i in self.grouped]
            firsts = [0 if window is None else max(0, start - window + 1) for _, _, start in members]
            self._groups[window] = Group.pad(members, firsts, window, self.pool.device)
        return self._groups[window]


def _layout(segments: Sequence[Segment]) -> tuple[list[tuple[int, int]], np.ndarray, np.ndarray]:
    """Each segment's rows in the packed sequence, every new token's position and the slots its
    K/V are written to; ValueError for a segment that cannot be laid out."""
    bounds, positions, writes = [], [], []
    row = 0
    for s in segments:
        n = len(s.token_ids)
        if n == 0 or len(s.slots) < n or not 1 <= s.keep <= n:
            raise ValueError(
                f"a segment needs new tokens, a slot for each position and 1 <= keep <= new tokens; "
                f"got {n} tokens, {len(s.slots)} slots, keep={s.keep}"
            )
        bounds.append((row, row + n))
        if s.tree is not None:
            assert len(s.tree) == n, "a tree names one parent per new token"
            positions.append(trees.positions(s.start, s.tree))
        else:
            positions.append(np.arange(s.start, len(s.slots)))
        writes.append(s.slots[s.start :])
        row += n
    return bounds, np.concatenate(positions), np.concatenate(writes)


def rows_of(batch: PackedBatch, members: Sequence[int], device: torch.device) -> torch.Tensor | slice:
    """The members' rows of the packed sequence: a slice when they are consecutive (a view)."""
    rows = [r for i in members for r in range(*batch.bounds[i])]
    if rows[-1] - rows[0] == len(rows) - 1:
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, device=device)


def index_of(rows: slice | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Packed rows as an index tensor."""
    if isinstance(rows, slice):
        return torch.arange(rows.start, rows.stop, device=device)
    return rows


def leading_run(slots: np.ndarray, start: int, minimum: int) -> int:
    """Where cascade attention cuts a segment's keys: the end of the run of consecutive slots from
    `slots[0]`, at most `start`; 0 (no shared part) when that is shorter than `minimum`."""
    head = slots[:start].astype(np.int64)
    breaks = np.flatnonzero(np.diff(head) != 1)
    run = int(breaks[0]) + 1 if len(breaks) else len(head)
    return run if run >= minimum else 0


def reader(pool: KVPool, slots: np.ndarray) -> torch.Tensor | slice:
    """How attention reads `slots` from a pool layer: a slice (a view, nothing copied) when they are
    consecutive, as a prefix stored in one piece usually is; an index for `index_select` otherwise."""
    if len(slots) and slots[-1] - slots[0] == len(slots) - 1 and np.all(np.diff(slots) == 1):
        return slice(int(slots[0]), int(slots[-1]) + 1)
    return pool.index(slots)
