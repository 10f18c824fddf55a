"""Packed forwards over the KV pool: many requests in one forward, K/V read through slot lists.

This is the attention path of the batched engine (`kvblocks.engine.batch`, `kvblocks serve
--max-batch-size`). A packed forward takes segments, one per request: the request's new tokens (a
decode token or a chunk of prefill) and the pool slots of every position the request has so far,
its new tokens' slots last. The tokens of all segments go through the model as one sequence
`[1, T]` with each token's own position id, so the linear layers see every request's rows at once.
Attention is the one place where requests must stay apart: `paged_attention` (registered with
transformers' `AttentionInterface`) writes each layer's new K/V into the pool at the new tokens'
slots, then, segment by segment, reads that request's K/V from the pool through its slot list and
attends causally, within the window on windowed layers (SDPA with grouped heads; explicit math where
gemma2 soft-caps). On a GPU a call per segment is launch-bound, so there (`PagedRunner(grouped=...)`,
by default on CUDA unless batch-invariant) the segments of at most `GROUP_MAX_TOKENS` new tokens
(decodes) share one SDPA call per layer over their slot lists padded to one batch, and only longer
ones (prefill chunks) keep a call each; and by default there a forward of at most 256 rows is padded
to a fixed layout and replayed from a CUDA graph (`kvblocks.engine.graphs`, `PagedRunner(cuda_graphs=
...)`), which launches its kernels at once. Nothing is copied per request between steps and no cache
grows by `torch.cat`: a request's KV is its slot list, the shared prefix's slots included, exactly
as the trie holds them.

Cascade attention (`PagedRunner(cascade=...)`, the default on CPU unless batch-invariant): when
several running requests' keys begin with the same pool slots (a system prompt the trie stored once),
their queries attend those shared keys together in one fused call reading the slots in place (on
CPU the flash kernel, which also returns each row's log-sum-exp), and the requests' own keys in one
batched call per number of new tokens (gathered once per layer, masks made once per forward); the
two results are merged exactly by their log-sum-exp. A request alone is cut the same way (where its
cut depends on its own slots only), so a decode step after a long cached prompt reads that prompt in
place rather than copying it with the request's own keys every layer. Within 1e-10 of one request
alone in fp64 (tests/test_paged.py, tests/test_paged_cascade.py); the batched calls differ from a
request alone in the last bits of fp32 (greedy tokens agree in the tests and benchmarks).

In batch-invariant mode the cascade is cut at fixed positions instead (`Blocks`, the CPU default
with `--batch-invariant`): a row's keys are split into whole blocks (of 2,048 positions, then 256, then 64)
and a tail, each attended on its own over a length that depends on the row's position only, and the
results combined by log-sum-exp in a fixed order. Requests that hold the same blocks in the same
slots (a stored system prompt) attend them in one call reading the slots in place; other blocks are
gathered. How a block is read and with whom never changes a row's bits (`probe_blocks_invariance`
checks what that relies on: the fused kernel's rows in calls of any multiple of `MIN_ROWS` rows,
and exp / log wherever an element lies).

On a CPU, segments of at most `kernel.MAX_WIDTH` new tokens (decodes, speculative rounds) attend
through the C++ kernel of `kvblocks.engine.kernel` where it builds (`PagedRunner(direct=...)`),
in both modes: all their keys read where they lie in the pool instead of gathered every layer, a
shared run read once for every row of the group of segments that starts with it, and one exact
softmax per row whose arithmetic depends on the row's query and keys only (so batch-invariant
forwards need neither fixed cuts nor padding rows there). Wider segments (prefill chunks) keep the
cascade plans above.

Batch invariance (`PagedRunner(..., invariant=True)`, `kvblocks serve --batch-invariant`): a row of
a packed forward rounds the same whatever else is in the batch. CPU BLAS computes a row of a matrix
product the same way for any number of rows from `MIN_ROWS` up, but takes another kernel (GEMV and
friends) below it, so the runner adds a segment of padding rows (token 0, K/V written to scratch
slots) whenever fewer than `MIN_ROWS` rows would reach the output head, and so every matrix product
sees at least `MIN_ROWS` rows (`probe_row_invariance` checks the property on the model's device and
dtype before it is relied on). Attention rounds differently for different key lengths, so the batched engine also cuts every
prompt at the same positions however the budget falls (`chunk_ends`): a query row then always reads
the same keys. Together a request's logits are bit-identical whether it runs alone or among others.

`install(model)` makes the model's attention implementation a dispatcher: calls that carry a
`kvblocks_paged` batch take the paged path, every other call goes to the implementation the model
had (sdpa, eager, ...) with the same arguments, so ordinary forwards are unchanged.

Only models whose attention layers hand position-encoded K/V to the attention interface and whose
positions come from `position_ids` can run packed (llama, qwen2, qwen3, mistral, phi3, gemma2,
gemma3, gpt2, gpt_neox, opt); `supports(model)` says which, and the others stay on the one-request
path: falcon and bloom compute attention inside their own modules (bloom's ALiBi bias comes from the
attention mask), so transformers cannot route them through an attention function. Attention sinks
are refused by name.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from kvblocks.cache.pool import KVPool
from kvblocks.engine import graphs, kernel
from kvblocks.engine import tree as trees
from kvblocks.engine.head import PackedHead, PackedLinears, scope

NAME = graphs.BATCH_KEYWORD  # the keyword a packed forward's batch travels under to every layer
ATTENTION_RANGE = "kvblocks.attention"  # the profiler range around `paged_attention`, under a profiler
# whether a profiler is recording on this process (a torch without the check: always, as before)
_profiling = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)
# Model types whose packed forward is tested equal to one request at a time (tests/test_paged.py).
SUPPORTED = frozenset(
    {"llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text", "gpt2", "gpt_neox", "opt"}
)
# the CPU fused attention kernel that also returns each row's log-sum-exp (what cascade merges by)
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_KNOWN_KWARGS = frozenset({"position_ids", "use_cache", "output_attentions", "is_causal", "cache_position"})

MIN_ROWS = 4  # fewest rows a linear layer runs on in batch-invariant forwards
# In grouped mode, segments of at most this many new tokens (decodes, draft/verify rounds) share one
# attention call per layer; longer ones (prefill chunks) have enough work to run alone.
GROUP_MAX_TOKENS = 16
# Cascade attention (the CPU default): a segment's keys are cut where its leading run of consecutive
# slots ends (before its new tokens), when the run has at least `CASCADE_MIN_RUN` slots; segments cut
# at the same slots (a prefix the trie stored once) attend that run together in one matrix product.
CASCADE_MIN_RUN = 32
# Segments' own keys (after their cut) are attended in batches padded to their longest: a batch's
# longest own key count is at most this many times its shortest.
OWN_PAD = 2
# Batch-invariant cascade: a row's keys are cut into whole blocks of these sizes at fixed positions,
# each attended on its own (`Blocks`); rounded up, the smallest to a multiple of the prompt chunk and
# each to a multiple of the next smaller one.
CASCADE_BLOCKS = (2048, 256, 64)

_install_lock = threading.Lock()
_clock = threading.local()  # `attention_clock`'s accumulator on this thread, if one is open
_wrapped: dict[str, str] = {}  # dispatcher name -> the implementation it falls back to


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


class PagedBatch:
    """The layout of one packed forward, built once and read by every layer."""

    def __init__(
        self,
        pool: KVPool,
        segments: Sequence[Segment],
        align: int = 1,
        grouped: bool = False,
        cascade_min: int | None = None,
        cascade_blocks: Sequence[int] | None = None,
        direct: bool = False,
    ) -> None:
        if not segments:
            raise ValueError("a packed forward needs at least one segment")
        self.pool = pool
        device = pool.device
        self.bounds: list[tuple[int, int]] = []  # each segment's rows in the packed sequence
        positions, writes = [], []
        row = 0
        for s in segments:
            n = len(s.token_ids)
            if n == 0 or len(s.slots) < n or not 1 <= s.keep <= n:
                raise ValueError(
                    f"a segment needs new tokens, a slot for each position and 1 <= keep <= new tokens; "
                    f"got {n} tokens, {len(s.slots)} slots, keep={s.keep}"
                )
            self.bounds.append((row, row + n))
            if s.tree is not None:
                assert len(s.tree) == n, "a tree names one parent per new token"
                positions.append(trees.positions(s.start, s.tree))
            else:
                positions.append(np.arange(s.start, len(s.slots)))
            writes.append(s.slots[s.start :])
            row += n
        self.segments = list(segments)
        self.tokens = row
        ids = [t for s in segments for t in s.token_ids]
        self.input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        self.position_ids = torch.from_numpy(np.concatenate(positions).astype(np.int64))[None].to(device)
        self.write_index = pool.index(np.concatenate(writes))
        self._slots = [s.slots for s in segments]
        self._starts = [s.start for s in segments]
        self._align = align
        self._views: dict[int | None, list[tuple[torch.Tensor | slice, torch.Tensor]]] = {}
        self._stacked: dict[tuple[int | None, int, int, torch.dtype], torch.Tensor] = {}
        # draft trees attend under their own masks, a call each (`_plain_attention`)
        self.trees = [i for i, s in enumerate(segments) if s.tree is not None]
        short = [i for i, s in enumerate(segments) if len(s.token_ids) <= GROUP_MAX_TOKENS and s.tree is None]
        self.grouped = short if grouped and len(short) > 1 else []  # segments read in one call per layer
        self.alone = sorted(set(range(len(segments))) - set(self.grouped))
        self._groups: dict[int | None, Group] = {}
        self._folds: dict[tuple[int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        # The CPU kernel (`direct`) takes the segments of at most `kernel.MAX_WIDTH` new tokens, all of
        # their keys, a shared run read once per group (a row's bits do not depend on how its keys are
        # split, so this serves batch-invariant forwards too); the cascade plans take the others.
        rest = [i for i, s in enumerate(segments) if s.tree is None]
        self.direct: kernel.Plan | None = None
        if direct:
            narrow = [i for i in rest if len(segments[i].token_ids) <= kernel.MAX_WIDTH]
            self.direct = _direct_plan(self, narrow, cascade_min or CASCADE_MIN_RUN) if narrow else None
            rest = [i for i in rest if i not in set(narrow)]
        self.cascade: Cascade | Blocks | None = None
        if cascade_blocks is not None and rest:
            self.cascade = Blocks.plan(self, cascade_blocks, rest)
        elif cascade_min is not None and rest:
            self.cascade = Cascade.plan(self, cascade_min, rest)

    def views(self, window: int | None) -> list[tuple[torch.Tensor | slice, torch.Tensor]]:
        """Per segment, the slots its new tokens read and a boolean `[new, read]` mask: causal, and on
        a windowed layer only the last `window` positions of each token. Keys before the window of
        the segment's first position are not read at all; with `align`, reads start at the window
        of the first position of the `align`-sized chunk the segment starts in, so that a query row
        reads the same keys wherever the segment around it starts (batch invariance)."""
        if window not in self._views:
            out = []
            for segment, slots, start in zip(self.segments, self._slots, self._starts):
                first = 0 if window is None else max(0, start // self._align * self._align - window + 1)
                if segment.tree is not None:
                    allowed = trees.visible(start, len(slots), first, segment.tree, window)
                    out.append(
                        (_reader(self.pool, slots[first:]), torch.from_numpy(allowed).to(self.pool.device))
                    )
                    continue
                q = torch.arange(start, len(slots), device=self.pool.device)[:, None]
                k = torch.arange(first, len(slots), device=self.pool.device)[None, :]
                allowed = k <= q
                if window is not None:
                    allowed &= k > q - window
                out.append((_reader(self.pool, slots[first:]), allowed))
            self._views[window] = out
        return self._views[window]

    def segment_mask(self, window: int | None, segment: int, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """The mask `_segment_attention` takes for `views(window)[segment]`: on a CPU as it is; else
        an additive bias in `dtype` (0 or -inf) repeated for the `groups` query heads of a K/V head
        stacked along the rows (row `j * new + i` is head `j`'s row `i`), its rows 8-element aligned,
        made once per forward: SDPA then neither converts a boolean mask nor pads the bias for the
        memory-efficient kernel in every layer (each a kernel launch, which bound a GPU's prefill)."""
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

    def fold(self, heads: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch-invariant cascade's per-block results, made once per forward and written by every
        layer at the same places: `[depth + 1, T, heads, dim]` outputs (zeros) and `[depth + 1, T,
        heads]` log-sum-exps (-inf), index 0 the tails, then the blocks in order. What a layer
        leaves unwritten (a row's missing blocks, the `plain` rows) keeps its first value."""
        key = (heads, dim, dtype)
        if key not in self._folds:
            depth, device = self.cascade.depth + 1, self.pool.device
            self._folds[key] = (
                torch.zeros(depth, self.tokens, heads, dim, dtype=dtype, device=device),
                torch.full(
                    (depth, self.tokens, heads), float("-inf"), dtype=_lse_dtype(dtype), device=device
                ),
            )
        return self._folds[key]

    def group(self, window: int | None) -> Group:
        """The `grouped` segments padded to one batch: see `Group`. Keys start where `views` starts
        them (align 1); padding rows and keys repeat a real one and are masked out."""
        if window not in self._groups:
            members = [(self.bounds[i], self._slots[i], self._starts[i]) for i in self.grouped]
            firsts = [0 if window is None else max(0, start - window + 1) for _, _, start in members]
            self._groups[window] = Group.pad(members, firsts, window, self.pool.device)
        return self._groups[window]


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
        flat = []
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
        """Zero query rows added to each (segment, K/V head) of the call (`_row_padding`)."""
        return _row_padding(groups * self.width, self.min_rows)

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
class Cascade:
    """The plan of a cascade forward on layers without a window. A segment's keys are cut at the end
    of its leading run of consecutive slots (before its first new token, if at least `cascade_min`
    long), so requests that share a prefix the trie stored in one piece are cut at the same slots. The
    cut depends on the segment's own slots only, never on the rest of the batch: a request alone is cut
    where it is cut in a batch, and its run is read in place instead of copied with its own keys.
    `runs` are the leading runs: every segment cut at the same slots attends them in one fused call
    reading the slots in place. `own` are the rest of each segment's keys: segments with the same
    number of new tokens and similar key counts (padded at most `OWN_PAD`-fold) in one batched call. A
    row's two results are merged exactly by log-sum-exp. Segments with no cut (`plain`: no leading run
    of `cascade_min` slots) need no merge: they attend all their keys in one fused call each."""

    runs: list[Part]
    own: list[Own]
    plain: list[int]

    @classmethod
    def plan(cls, batch: PagedBatch, cascade_min: int, members: Sequence[int]) -> Cascade:
        """The plan of the batch's segments `members` (the others are attended elsewhere)."""
        device = batch.pool.device
        cuts = [_leading_run(slots, start, cascade_min) for slots, start in zip(batch._slots, batch._starts)]
        outside = set(range(len(cuts))) - set(members)
        by_run: dict[tuple[int, int], list[int]] = {}
        for i in members:
            if cuts[i]:
                by_run.setdefault((int(batch._slots[i][0]), cuts[i]), []).append(i)
        runs = [
            Part(slice(first, first + n), _rows(batch, group, device)) for (first, n), group in by_run.items()
        ]
        batches = _own_batches(batch, [0 if i in outside else cut for i, cut in enumerate(cuts)])
        own = [_own(batch, group, cuts, device) for group in batches]
        return cls(runs, own, [i for i in members if not cuts[i]])


@dataclass(frozen=True, slots=True)
class Blocks:
    """The plan of a batch-invariant cascade forward on layers without a window: each row's attention
    is computed the same way whatever else is in the batch and wherever its K/V lie in the pool.

    A row's keys before its segment's first new token are cut into whole blocks at fixed positions:
    blocks of `sizes[0]` positions up to the last multiple of it, then of `sizes[1]`, and so on (each
    size a multiple of the next and the last a multiple of the prompt chunk, so no segment spans a
    cut). Each block is attended on its own over exactly its keys; the rest, from the last cut on (the
    `tails`), over a length padded to a multiple of the last size. Every call gives each (segment,
    K/V head) a multiple of `MIN_ROWS` query rows, and a row's results are combined by log-sum-exp in a
    fixed order: its tail, then its blocks from the first. The positions alone decide the arithmetic.

    Only how blocks are read depends on the batch: `runs` are blocks of one size in consecutive slots
    (a prefix the trie stored in one piece), which every segment starting with them attends in one
    call reading the slots in place (the blocks are the call's batch); `private` are the other blocks,
    gathered, one call per size and width. A tail is always as long as a block of the last size, so
    such blocks are gathered and attended in their width's tail call (`tails`), under the tails' mask
    (all keys allowed): whatever the batch, a block of the last size is attended in a masked call and
    a larger one in an unmasked call. `plain` segments (speculative rounds, whose rows may span a cut)
    keep a call each."""

    runs: list[tuple[Part, int, int]]  # the run, its number of blocks, the index of its first in the fold
    private: list[tuple[Own, torch.Tensor]]  # gathered blocks; where each row's result goes (fold * T + row)
    # a width's tails, then its gathered blocks of the last size: the call, its tail rows, the blocks' targets
    tails: list[tuple[Own, int, torch.Tensor | None]]
    plain: list[int]
    depth: int  # the most blocks any row has

    @classmethod
    def plan(cls, batch: PagedBatch, sizes: Sequence[int], members: Sequence[int]) -> Blocks:
        """The plan of the batch's segments `members` (the others are attended elsewhere)."""
        device = batch.pool.device
        last = sizes[-1]
        # (first slot, size, blocks, fold) -> segments; (size, width) -> (segment, position, fold);
        # (width, padded length) -> segments
        runs: dict[tuple[int, int, int, int], list[int]] = {}
        private: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        tails: dict[tuple[int, int], list[int]] = {}
        plain, cuts, depth = [], {}, 0
        for i in members:
            segment, slots, start = batch.segments[i], batch._slots[i], batch._starts[i]
            if segment.keep > 1 or start // last != (len(slots) - 1) // last:
                plain.append(i)
                continue
            width = len(segment.token_ids)
            run = _leading_run(slots, start, 1)
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
        calls = []
        for (width, length), members in tails.items():
            assert length == last, "a segment within one chunk has a tail of one block"
            tail = _own(batch, members, cuts, device, length, MIN_ROWS)
            calls.append(_with_blocks(batch, tail, private.pop((last, width), [])))
        return cls(
            [
                (Part(slice(first, first + n * size), _rows(batch, members, device)), n, fold)
                for (first, size, n, fold), members in runs.items()
            ],
            [_private(batch, size, width, members) for (size, width), members in private.items() if members],
            calls,
            plain,
            depth,
        )


def _direct_plan(batch: PagedBatch, members: Sequence[int], minimum: int) -> kernel.Plan:
    """The CPU kernel's plan for `members`: segments whose keys begin with a run of at least
    `minimum` consecutive slots at the same first slot (a prefix the trie stored once) form a group
    that reads the shortest of their runs once for all of them; the rest of each segment's keys are
    its own. A segment with no such run is a group of its own."""
    by_first: dict[int, list[tuple[int, int]]] = {}
    alone = []
    for i in members:
        slots, start = batch._slots[i], batch._starts[i]
        run = _leading_run(slots, start, minimum)
        if run:
            by_first.setdefault(int(slots[0]), []).append((i, run))
        else:
            alone.append(i)
    groups = []
    for first, group in by_first.items():
        run = min(n for _, n in group)
        shared = np.arange(first, first + run)
        groups.append((shared, [(np.arange(*batch.bounds[i]), batch._slots[i][run:]) for i, _ in group]))
    empty = np.zeros(0, dtype=np.int64)
    groups += [(empty, [(np.arange(*batch.bounds[i]), batch._slots[i])]) for i in alone]
    return kernel.Plan.of(groups)


def _private(
    batch: PagedBatch, size: int, width: int, members: Sequence[tuple[int, int, int]]
) -> tuple[Own, torch.Tensor]:
    """Blocks `(segment, first position, fold index)` of one `size`, of segments of one `width`,
    that are not read in place: their slots gathered and attended in one call; and where each row's
    result goes in the `[depth * T]` rows of the block results (`fold * T + row`)."""
    device = batch.pool.device
    reads = np.concatenate([batch._slots[i][p : p + size] for i, p, _ in members])
    rows = np.concatenate([np.arange(*batch.bounds[i]) for i, _, _ in members])
    target = np.concatenate([np.arange(*batch.bounds[i]) + f * batch.tokens for i, _, f in members])
    index = torch.from_numpy(rows).to(device)
    own = Own(batch.pool.index(reads), index, None, len(members), width, size, MIN_ROWS)
    return own, torch.from_numpy(target).to(device)


def _with_blocks(
    batch: PagedBatch, tail: Own, members: Sequence[tuple[int, int, int]]
) -> tuple[Own, int, torch.Tensor | None]:
    """One call for a width's tails and its gathered blocks of the tails' length (`_private`'s
    members): the tails' rows first, then the blocks' (which see all their keys)."""
    rows = tail.segments * tail.width
    if not members:
        return tail, rows, None
    blocks, target = _private(batch, tail.length, tail.width, members)
    allowed = torch.ones(blocks.segments, tail.width, tail.length, dtype=torch.bool, device=target.device)
    own = Own(
        torch.cat((tail.reads, blocks.reads)),
        torch.cat([_index(r, target.device) for r in (tail.rows, blocks.rows)]),
        torch.cat((tail.allowed, allowed)),
        tail.segments + blocks.segments,
        tail.width,
        tail.length,
        MIN_ROWS,
    )
    return own, rows, target


def _index(rows: slice | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Packed rows as an index tensor."""
    if isinstance(rows, slice):
        return torch.arange(rows.start, rows.stop, device=device)
    return rows


def _own_batches(batch: PagedBatch, cuts: Sequence[int]) -> list[list[int]]:
    """The cut segments in batches of one width (new tokens), by their own key counts: a batch's
    longest is at most `OWN_PAD` times its shortest, so padding never dominates the work."""
    by_width: dict[int, list[int]] = {}
    for i, cut in enumerate(cuts):
        if cut:
            by_width.setdefault(len(batch.segments[i].token_ids), []).append(i)
    batches = []
    for members in by_width.values():
        members.sort(key=lambda i: len(batch._slots[i]) - cuts[i])
        current: list[int] = []
        for i in members:
            if current and len(batch._slots[i]) - cuts[i] > OWN_PAD * (
                len(batch._slots[current[0]]) - cuts[current[0]]
            ):
                batches.append(current)
                current = []
            current.append(i)
        batches.append(current)
    return batches


def _rows(batch: PagedBatch, members: Sequence[int], device: torch.device) -> torch.Tensor | slice:
    """The members' rows of the packed sequence: a slice when they are consecutive (a view)."""
    rows = [r for i in members for r in range(*batch.bounds[i])]
    if rows[-1] - rows[0] == len(rows) - 1:
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, device=device)


def _own(
    batch: PagedBatch,
    members: Sequence[int],
    cuts: Sequence[int] | dict[int, int],
    device: torch.device,
    length: int | None = None,
    min_rows: int = 0,
) -> Own:
    """The keys of `members` (all of one width) after their cuts, padded to one length (their
    longest, or `length`); a row sees its own segment's keys up to its position."""
    width = len(batch.segments[members[0]].token_ids)
    length = length or max(len(batch._slots[i]) - cuts[i] for i in members)
    reads = np.empty((len(members), length), dtype=np.int64)
    allowed = np.zeros((len(members), width, length), dtype=bool)
    for m, i in enumerate(members):
        slots, start = batch._slots[i], batch._starts[i]
        q = np.arange(start, len(slots))[:, None]
        k = np.arange(cuts[i], len(slots))[None, :]
        reads[m, : k.shape[1]], reads[m, k.shape[1] :] = slots[cuts[i] :], slots[-1]
        allowed[m, :, : k.shape[1]] = k <= q
    mask = None if allowed.all() and not min_rows else torch.from_numpy(allowed).to(device)
    index = batch.pool.index(reads.reshape(-1))
    return Own(index, _rows(batch, members, device), mask, len(members), width, length, min_rows)


def _leading_run(slots: np.ndarray, start: int, minimum: int) -> int:
    """Where cascade attention cuts a segment's keys: the end of the run of consecutive slots from
    `slots[0]`, at most `start`; 0 (no shared part) when that is shorter than `minimum`."""
    head = slots[:start].astype(np.int64)
    breaks = np.flatnonzero(np.diff(head) != 1)
    run = int(breaks[0]) + 1 if len(breaks) else len(head)
    return run if run >= minimum else 0


def _reader(pool: KVPool, slots: np.ndarray) -> torch.Tensor | slice:
    """How attention reads `slots` from a pool layer: a slice (a view, nothing copied) when they are
    consecutive, as a prefix stored in one piece usually is; an index for `index_select` otherwise."""
    if len(slots) and slots[-1] - slots[0] == len(slots) - 1 and np.all(np.diff(slots) == 1):
        return slice(int(slots[0]), int(slots[-1]) + 1)
    return pool.index(slots)


@contextmanager
def attention_clock() -> Iterator[list[float]]:
    """While open, every `paged_attention` call on this thread adds its CPU time (process clock),
    Python included, to the one-element list this yields: what a step's attention costs, without a
    profiler's overhead on each operator (`kvblocks bench packed --profile`)."""
    spent = [0.0]
    _clock.spent = spent
    try:
        yield spent
    finally:
        _clock.spent = None


def paged_attention(*args, **kwargs):
    """The attention interface's signature: `query [1, Hq, T, D]`, `key/value [1, Hkv, T, D]` of the
    packed new tokens (rotary applied). Returns `([1, T, Hq, D], None)`. Under a profiler it runs inside
    a range named `ATTENTION_RANGE`, so a profile can tell attention from the rest of a step (without
    one the range is skipped: entering it cost 3 ms of a 145 ms decode step), and is timed
    inside an `attention_clock`."""
    spent = getattr(_clock, "spent", None)
    start = time.process_time() if spent is not None else 0.0
    # the range costs about 0.1 ms a call in a step
    with torch.profiler.record_function(ATTENTION_RANGE) if _profiling() else nullcontext():
        out = _paged_attention(*args, **kwargs)
    if spent is not None:
        spent[0] += time.process_time() - start
    return out


def _paged_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
):
    batch: PagedBatch | graphs.StaticBatch | None = kwargs.pop(NAME, None)
    if batch is None:  # an ordinary forward: the model's own implementation, same arguments
        if sliding_window is not None:
            kwargs["sliding_window"] = sliding_window
        if softcap is not None:
            kwargs["softcap"] = softcap
        function = _fallback(module)
        return function(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    extra = set(kwargs) - _KNOWN_KWARGS
    if extra:
        raise NotImplementedError(f"packed attention does not handle {sorted(extra)}")
    if dropout:
        raise NotImplementedError("packed attention runs in inference only (dropout must be 0)")
    layer = module.layer_idx
    pool = batch.pool
    if pool.layers[layer] is None:
        raise NotImplementedError(f"layer {layer} keeps no KV in the pool")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(batch, graphs.StaticBatch):  # a graphed forward's fixed layout
        return batch.attend(pool.layers[layer], query, key, value, scale, sliding_window, softcap), None
    new = torch.stack((key[0].transpose(0, 1), value[0].transpose(0, 1)), dim=1)  # [T, 2, Hkv, D]
    pool.layers[layer].index_copy_(0, batch.write_index, new.to(pool.dtype))
    groups = query.shape[1] // key.shape[1]
    planned = batch.direct is not None or batch.cascade is not None
    if planned and sliding_window is None and softcap is None:
        return _planned_attention(pool.layers[layer], query, batch, scale, groups)[None], None
    out = torch.empty(query.shape[2], query.shape[1], query.shape[3], dtype=query.dtype, device=query.device)
    if batch.grouped and softcap is None:
        group = batch.group(sliding_window)
        out[group.out] = _grouped_attention(pool.layers[layer], query, group, scale, groups)
        alone = batch.alone
    else:
        alone = range(len(batch.segments))
    views = batch.views(sliding_window)
    for i in alone:
        (a, b), (index, mask) = batch.bounds[i], views[i]
        if softcap is None:
            mask = batch.segment_mask(sliding_window, i, groups, query.dtype)
        o = _segment_attention(pool.layers[layer], query[0, :, a:b], index, mask, scale, groups, softcap)
        if len(batch.segments) == 1:  # the only segment: its output is the layer's (no copy)
            return o[None], None
        out[a:b] = o
    return out[None], None


def _segment_attention(
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
        return _stacked_heads_attention(q, k, v, mask, scale, groups)
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


def _stacked_heads_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, groups: int
) -> torch.Tensor:
    """`[n, Hq, D]` from `q [Hq, n, D]` over `k, v [Hkv, L, D]`, the query heads of a K/V head stacked
    along the rows, `mask [groups * n, L]` (boolean or additive) stacked so (`PagedBatch.segment_mask`).
    Off the CPU a masked call with `enable_gqa` takes SDPA's math fallback, which repeats K/V per head;
    this one can take the memory-efficient kernel."""
    heads, n, dim = q.shape
    o = F.scaled_dot_product_attention(
        q.reshape(1, k.shape[0], groups * n, dim), k[None], v[None], attn_mask=mask, scale=scale
    )
    return o.reshape(heads, n, dim).transpose(0, 1)


def _grouped_attention(
    pool_layer: torch.Tensor, query: torch.Tensor, group: Group, scale: float, groups: int
) -> torch.Tensor:
    """One SDPA call for all the group's segments (`graphs.padded_attention`): `[len(group.out), Hq, D]`."""
    q = query[0][:, group.rows].transpose(0, 1)  # [G, Hq, width, D]
    g, heads, width, dim = q.shape
    o = graphs.padded_attention(pool_layer, q, group.reads, group.mask.repeat(1, 1, groups, 1), scale)
    return o.reshape(g * width, heads, dim)[group.flat]


def _planned_attention(
    pool_layer: torch.Tensor, query: torch.Tensor, batch: PagedBatch, scale: float, groups: int
) -> torch.Tensor:
    """`[T, Hq, D]` by the batch's plans (layers without a window or soft-capping): its cascade plan
    (`Blocks` or `Cascade`) for the segments it holds, the CPU kernel for the `direct` ones, over
    their slots in place."""
    if isinstance(batch.cascade, Blocks):
        out = _blocks_attention(pool_layer, query, batch, scale, groups)
    elif batch.cascade is not None:
        out = _cascade_attention(pool_layer, query, batch, scale, groups)
    else:
        out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
    if batch.direct is not None:
        kernel.attend(query, pool_layer, batch.direct, scale, out)
    _plain_attention(pool_layer, query, batch, batch.trees, out, scale, groups)
    return out


def _cascade_attention(
    pool_layer: torch.Tensor, query: torch.Tensor, batch: PagedBatch, scale: float, groups: int
) -> torch.Tensor:
    """`[T, Hq, D]`: each row of a cut segment attends its own keys, then its shared run's, merged by
    log-sum-exp; a segment with no cut attends all its keys in one call."""
    plan = batch.cascade
    tokens, heads, dim = query.shape[2], query.shape[1], query.shape[3]
    out = torch.empty(tokens, heads, dim, dtype=query.dtype, device=query.device)
    lse = torch.empty(tokens, heads, dtype=_lse_dtype(query.dtype), device=query.device)
    _plain_attention(pool_layer, query, batch, plan.plain, out, scale, groups)
    for own in plan.own:
        out[own.rows], lse[own.rows] = _own_attention(pool_layer, query, own, scale, groups)
    for part in plan.runs:
        o, sums = _blocks_run(pool_layer, query, part, 1, scale, groups, 0)  # the run as one block
        out[part.rows] = _combine(torch.stack((out[part.rows], o[0])), torch.stack((lse[part.rows], sums[0])))
    return out


def _blocks_attention(
    pool_layer: torch.Tensor, query: torch.Tensor, batch: PagedBatch, scale: float, groups: int
) -> torch.Tensor:
    """`[T, Hq, D]` by the batch-invariant plan (`Blocks`): each row's tail and its blocks, combined
    by log-sum-exp in a fixed order. A block a row lacks has the results (0, -inf), which add exact
    zeros, so one pass over the fold's depth serves every row at once."""
    plan: Blocks = batch.cascade
    heads, dim = query.shape[1], query.shape[3]
    results, sums = batch.fold(heads, dim, query.dtype)
    blocks, block_sums = results[1:].view(-1, heads, dim), sums[1:].view(-1, heads)  # fold * T + row
    for own, rows, target in plan.tails:
        o, sum_ = _own_attention(pool_layer, query, own, scale, groups)
        if target is None:
            results[0, own.rows], sums[0, own.rows] = o, sum_
            continue
        results[0, own.rows[:rows]], sums[0, own.rows[:rows]] = o[:rows], sum_[:rows]
        blocks[target], block_sums[target] = o[rows:], sum_[rows:]
    for part, n, fold in plan.runs:
        o, sum_ = _blocks_run(pool_layer, query, part, n, scale, groups, MIN_ROWS)
        results[1 + fold : 1 + fold + n, part.rows], sums[1 + fold : 1 + fold + n, part.rows] = o, sum_
    for own, target in plan.private:
        blocks[target], block_sums[target] = _own_attention(pool_layer, query, own, scale, groups)
    out = _combine(results, sums)
    _plain_attention(pool_layer, query, batch, plan.plain, out, scale, groups)
    return out


def _plain_attention(
    pool_layer: torch.Tensor,
    query: torch.Tensor,
    batch: PagedBatch,
    plain: Sequence[int],
    out: torch.Tensor,
    scale: float,
    groups: int,
) -> None:
    """The cascade plans' `plain` segments, each attending all its keys in one call, into `out`."""
    views = batch.views(None) if plain else []
    for i in plain:
        (a, b), (index, _) = batch.bounds[i], views[i]
        mask = batch.segment_mask(None, i, groups, query.dtype)
        out[a:b] = _segment_attention(pool_layer, query[0, :, a:b], index, mask, scale, groups, None)


def _combine(results: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """Attention over the union of disjoint key sets from each set's output `results [N, T, H, D]`
    and log-sum-exp `sums [N, T, H]`: each output weighted by its share (one elementwise product for
    all), then added in order (mul and add kept apart: no fused rounding)."""
    weights = (sums - sums.amax(dim=0)).exp_()
    terms = results * weights[..., None]  # in the log-sum-exp's dtype (at least float32)
    acc, total = terms[0], weights[0].clone()
    for b in range(1, len(terms)):
        acc += terms[b]
        total += weights[b]
    return acc.div_(total[..., None]).to(results.dtype)


def _blocks_run(
    pool_layer: torch.Tensor,
    query: torch.Tensor,
    part: Part,
    n: int,
    scale: float,
    groups: int,
    min_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `n` whole blocks of a run, each attended on its own by the run's rows, in one fused call
    over the run's slots read in place (the blocks are its batch): `([n, R, Hq, D], [n, R, Hq])`.
    The query heads of a K/V head are stacked along the rows (so no K/V is repeated), padded to a
    multiple of `min_rows` (0: not padded)."""
    kv = pool_layer[part.keys].to(query.dtype)  # [n * block, 2, Hkv, D], a view
    kv = kv.view(n, -1, *kv.shape[1:])
    q = query[0][:, part.rows]  # [Hq, R, D]
    heads, rows, dim = q.shape
    kv_heads = kv.shape[3]
    q = q.reshape(1, kv_heads, groups * rows, dim)
    pad = _row_padding(groups * rows, min_rows)
    if pad:
        q = torch.cat((q, q.new_zeros(1, kv_heads, pad, dim)), dim=2)
    q = q.expand(n, -1, -1, -1)
    o, sums = _fused(q, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2), scale)
    o = o[:, :, : groups * rows].reshape(n, heads, rows, dim).transpose(1, 2)
    return o, sums[:, :, : groups * rows].reshape(n, heads, rows).transpose(1, 2)


def _row_padding(rows: int, multiple: int) -> int:
    """Query rows to add so that a fused call's `rows` become a multiple of `multiple` (0: none). The
    CPU kernel attends query rows in blocks of 32, 64 or 256 and rounds a row differently in a block
    of fewer than `MIN_ROWS` rows; with a multiple of `MIN_ROWS` no block is that small."""
    return -rows % multiple if multiple else 0


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """Log-sum-exps are kept in at least float32 (what the fused kernel returns for half types)."""
    return torch.promote_types(dtype, torch.float32)


def _own_attention(
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
    o, sums = _fused(q, k, v, scale, own.bias(groups, query.dtype))
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


def _fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention `q [B, H, R, D]` over `k, v [B, H, L, D]` with an additive `bias` broadcast to `[B,
    H, R, L]`: the output and each row's log-sum-exp. On CPU one call of the flash kernel (which
    returns the log-sum-exp and reads strided K/V); elsewhere the same math in matrix products."""
    if q.device.type == "cpu":
        return _flash(q, k, v, attn_mask=bias, scale=scale)
    return _attend(q, k.transpose(-1, -2), v, scale, bias)


def _attend(
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


def _fallback(module):
    """The attention function the model had before `install`: a registered one, or the eager
    function of the module's own modeling file (each family has its own)."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = _wrapped[module.config._attn_implementation]
    if original in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[original]
    return sys.modules[type(module).__module__].eager_attention_forward


def supports(model) -> bool:
    """True when `model` can run packed forwards (its family is in SUPPORTED)."""
    return getattr(model.config, "model_type", None) in SUPPORTED


def install(model) -> None:
    """Route the model's attention through `paged_attention`, which falls back to the model's own
    implementation for every call that is not a packed forward. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if not supports(model):
        raise NotImplementedError(
            f"packed forwards are not supported for model type '{model.config.model_type}'"
        )
    current = model.config._attn_implementation
    if current.startswith(NAME):
        return
    name = f"{NAME}_{current}"
    with _install_lock:
        if name not in _wrapped:
            AttentionInterface.register(name, paged_attention)
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
            _wrapped[name] = current
    model.set_attn_implementation(name)


def chunk_ends(start: int, stop: int, chunk: int) -> list[int]:
    """Where a prompt computed from `start` to `stop` is cut in batch-invariant mode: at every
    multiple of `chunk` and at `stop`, the same cuts whatever `start` is."""
    return [*range((start // chunk + 1) * chunk, stop, chunk), stop]


def probe_row_invariance(device: torch.device | str, dtype: torch.dtype, width: int = 576) -> bool:
    """Whether a row of a matrix product on `device` in `dtype` comes out the same for every row
    count from `MIN_ROWS` up and whatever the other rows hold (what batch invariance relies on)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(3 * width, width, generator=g).to(device, dtype)
    x = torch.randn(300, width, generator=g).to(device, dtype)
    with torch.inference_mode():
        ref = F.linear(x[:MIN_ROWS], w)
        for rows in (MIN_ROWS + 1, 2 * MIN_ROWS + 3, 64, 300):
            if not torch.equal(F.linear(x[:rows], w)[:MIN_ROWS], ref):
                return False
        other = x[:64].clone()
        other[1:] = torch.randn(63, width, generator=g).to(device, dtype)
        return torch.equal(F.linear(other, w)[0], ref[0])


def probe_blocks_invariance(device: torch.device | str, dtype: torch.dtype, dim: int = 64) -> bool:
    """Whether what the batch-invariant cascade (`Blocks`) relies on holds on `device` in `dtype`: a
    row of the fused attention call comes out the same for every row count that is a multiple of
    `MIN_ROWS`, wherever it lies among the rows and in any batch, and exp / log give an element the
    same bits wherever it lies in a tensor."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, dim, generator=g).to(device, dtype) for n in (800, 300, 300))
    with torch.inference_mode():
        ref = _fused(q[:1, :, :MIN_ROWS], k[:1], v[:1], 0.125)
        for rows in (2 * MIN_ROWS, 36, 48, 68, 200, 260, 772):  # the 4 rows first, and in the last block
            for first in (0, rows - MIN_ROWS):
                head = q[:, :, :rows].clone()
                head[:, :, first : first + MIN_ROWS] = q[:, :, :MIN_ROWS]
                o, lse = _fused(head, k, v, 0.125)
                window = slice(first, first + MIN_ROWS)
                if not (torch.equal(o[:1, :, window], ref[0]) and torch.equal(lse[:1, :, window], ref[1])):
                    return False
        x = -torch.rand(4099, generator=g).to(device, _lse_dtype(dtype)) * 30
        for fn in (torch.exp, lambda t: torch.log(-t)):
            whole = fn(x)
            if not all(
                torch.equal(fn(x[a : a + n]), whole[a : a + n])
                for a, n in ((0, 1), (3, 7), (5, 33), (64, 97))
            ):
                return False
    return True


ATTENTION_MODES = ("cascade", "grouped", "per-segment")


def direct_refusal(model, pool: KVPool) -> str | None:
    """Why the CPU kernel cannot attend for this model and pool (None: it can): the pool's device
    and dtype, the kernel's build, and its `probe` for every layer's heads."""
    if pool.device.type != "cpu":
        return f"it runs on CPU (the pool is on {pool.device.type})"
    if pool.dtype != model.dtype or pool.dtype not in (torch.float32, torch.float64, torch.bfloat16):
        return (
            f"it runs float32, float64 and bfloat16 models over a pool of their dtype "
            f"(model {model.dtype}, pool {pool.dtype})"
        )
    if kernel.library() is None:
        return kernel.reason()
    heads = getattr(model.config, "num_attention_heads", None)
    for kv_heads, dim in {tuple(t.shape[2:]) for t in pool.layers if t is not None}:
        h = heads if isinstance(heads, int) and heads % kv_heads == 0 else kv_heads
        if not kernel.probe(pool.dtype, h, kv_heads, dim):
            return f"its probe failed for {h} heads over {kv_heads} K/V heads of {dim} in {pool.dtype}"
    return None


def graphs_default(device: torch.device, invariant: bool, grouped: bool | None = None) -> bool:
    """Whether packed forwards replay CUDA graphs by default: on CUDA, with the device's default
    (grouped) attention, not batch-invariant."""
    return device.type == "cuda" and not invariant and grouped is not False


def scratch_slots(invariant: bool, cuda_graphs: bool) -> int:
    """Pool slots a `PagedRunner` holds for padding rows' K/V: `MIN_ROWS - 1` batch-invariant, 1
    for CUDA graphs, else none."""
    return MIN_ROWS - 1 if invariant else int(cuda_graphs)


def attention_mode(name: str | None) -> dict[str, bool]:
    """`PagedRunner`'s `grouped` / `cascade` for an attention mode by name; None: the device's default
    (grouped on CUDA, cascade elsewhere, one call per request when batch-invariant)."""
    if name is None:
        return {}
    if name not in ATTENTION_MODES:
        raise ValueError(f"attention mode must be one of {', '.join(ATTENTION_MODES)}, got {name!r}")
    return {"grouped": name == "grouped", "cascade": name == "cascade"}


PACKED_WEIGHTS = ("all", "head", "none")  # `kvblocks serve --packed-weights`


def packed_layers(model, which: bool | str) -> PackedLinears | PackedHead | None:
    """The reordered weights a runner's packed forwards take: every linear layer's (`"all"`, True),
    the output head's (`"head"`) or none (`"none"`, False)."""
    which = {True: "all", False: "none"}.get(which, which)  # type: ignore[call-overload]
    if which not in PACKED_WEIGHTS:
        raise ValueError(f"packed_weights must be one of {', '.join(PACKED_WEIGHTS)}, not {which!r}")
    if which == "all":
        return PackedLinears.of(model)
    return PackedHead.of(model) if which == "head" else None


class PagedRunner:
    """Packed forwards of one model over one pool (the trie's, or a pool of its own). With
    `invariant`, matrix products never run on fewer than `MIN_ROWS` rows (padding rows use
    `MIN_ROWS - 1` `scratch` slots, taken from the pool when not given) and windowed layers read
    from the window of the first position of the segment's `chunk` (see the module's docstring);
    refused where `probe_row_invariance` fails. Attention: `cascade` (the CPU default; with
    `invariant`, cut into `cascade_blocks` at fixed positions where `probe_blocks_invariance` holds,
    else one call per request), `grouped` (the CUDA default), or neither (one call per request).
    `packed_weights`: `"all"` (True) runs the linear layers and the output head on weights reordered
    once for oneDNN where that is possible (`kvblocks.engine.head`; their size in memory once more),
    `"head"` the output head only, `"none"` (False) neither. `cuda_graphs`
    (default: on CUDA with grouped attention, not batch-invariant): forwards that fit a layout replay CUDA graphs (`kvblocks.engine.graphs`),
    their padding rows writing to one scratch slot (taken from the pool when `scratch` is not given)."""

    def __init__(
        self,
        model,
        pool: KVPool,
        invariant: bool = False,
        chunk: int = 1,
        scratch: np.ndarray | None = None,
        grouped: bool | None = None,
        cascade: bool | None = None,
        cascade_min: int = CASCADE_MIN_RUN,
        cascade_blocks: Sequence[int] | None = None,
        packed_weights: bool | str = True,
        cuda_graphs: bool | None = None,
        direct: bool | None = None,
    ) -> None:
        install(model)
        if invariant and pool.device.type != "cpu":
            raise NotImplementedError(
                f"batch-invariant forwards are proven on CPU only: on {pool.device.type} a request's rows "
                "are not bit-identical alone and in a batch (measured on an H200, BENCHMARKS.md)"
            )
        if invariant and not probe_row_invariance(pool.device, pool.dtype, model.config.hidden_size):
            raise NotImplementedError(
                f"batch-invariant forwards: matrix products on {pool.device} in {pool.dtype} round a "
                f"row differently with different row counts from {MIN_ROWS} up"
            )
        self.model = model
        self.pool = pool
        self.invariant = invariant
        self.chunk = chunk
        # short segments share one attention call per layer: on a GPU, where a call per segment is
        # launch-bound; not in invariant mode (a padded call's key length depends on the batch)
        self.grouped = pool.device.type == "cuda" and not invariant if grouped is None else grouped
        if self.grouped and invariant:
            raise ValueError("grouped attention calls are not batch-invariant")
        # cascade attention: the default on CPU, cut at fixed block multiples in invariant mode (where
        # `probe_blocks_invariance` holds); on CUDA the grouped path stays the default (cascade
        # measured 17x slower there)
        dims = {t.shape[-1] for t in pool.layers if t is not None}  # the head dims the probe covers
        holds = not invariant or all(probe_blocks_invariance(pool.device, pool.dtype, dim) for dim in dims)
        if cascade is None:
            cascade = not self.grouped and holds
        elif cascade and not holds:
            raise NotImplementedError(
                f"batch-invariant cascade attention: the fused attention kernel or exp / log on {pool.device} "
                f"in {pool.dtype} round an element differently by where it lies (use one call per request)"
            )
        self.cascade = cascade
        if self.cascade and self.grouped:
            raise ValueError("cascade attention does not combine with grouped calls")
        self.cascade_min = cascade_min
        # invariant cascade blocks: the smallest a multiple of the prompt chunk, each a multiple of the next
        sizes = [chunk]
        for size in sorted(cascade_blocks or CASCADE_BLOCKS):
            sizes.append(-(-size // sizes[-1]) * sizes[-1])
        self.cascade_blocks = sorted(set(sizes[1:]), reverse=True) if invariant and cascade else None
        # the CPU kernel (`kvblocks.engine.kernel`): short segments' keys read in place, shared runs once
        why = direct_refusal(model, pool) if self.cascade else "it serves cascade attention only"
        if direct and why:
            raise NotImplementedError(f"the attention kernel cannot be used: {why}")
        self.direct = why is None if direct is None else direct
        self.direct_reason = None if self.direct else why or "turned off"
        # CUDA graphs (`kvblocks.engine.graphs`): the default with grouped attention on CUDA
        if cuda_graphs is None:
            cuda_graphs = graphs_default(pool.device, invariant, self.grouped and not self.cascade)
        if cuda_graphs and (invariant or pool.device.type != "cuda"):
            raise ValueError("CUDA graphs run on a CUDA device and not in batch-invariant mode")
        self.scratch = np.zeros(0, dtype=np.int32)  # slots of the padding rows' K/V
        need = scratch_slots(invariant, cuda_graphs)
        if need:
            self.scratch = pool.alloc(need) if scratch is None else scratch
            if len(self.scratch) < need:
                raise ValueError(f"these forwards need {need} scratch slots, got {len(self.scratch)}")
        self.graphs = graphs.GraphedForwards(model, pool, int(self.scratch[0])) if cuda_graphs else None
        # the linear layers' weights reordered once for oneDNN (CPU, float32 or bfloat16, where the probe holds)
        self.head = packed_layers(model, packed_weights)
        self.lock = threading.Lock()

    @torch.inference_mode()
    def forward(self, segments: Sequence[Segment]) -> list[torch.Tensor]:
        """Run the segments' new tokens as one forward; their K/V land in their slots. Returns each
        segment's logits `[keep, vocab]`."""
        if self.graphs is not None and all(s.tree is None for s in segments):
            with self.lock, scope(self.head):
                out = self.graphs.forward(segments)
            if out is not None:
                return out
        real = len(segments)
        pad = MIN_ROWS - sum(s.keep for s in segments) if self.invariant else 0
        if pad > 0:  # rows of token 0 in scratch slots: every matrix product gets MIN_ROWS rows or more
            segments = [*segments, Segment([0] * pad, self.scratch[:pad], keep=pad)]
        batch = PagedBatch(
            self.pool,
            segments,
            self.chunk if self.invariant else 1,
            self.grouped,
            self.cascade_min if self.cascade else None,
            self.cascade_blocks,
            self.direct,
        )
        with self.lock, scope(self.head):
            out = self.model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                use_cache=False,
                logits_to_keep=batch.keep_rows(),
                **{NAME: batch},
            )
        logits = out.logits[0]
        bounds = np.cumsum([0] + [s.keep for s in segments])
        return [logits[bounds[i] : bounds[i + 1]] for i in range(real)]
