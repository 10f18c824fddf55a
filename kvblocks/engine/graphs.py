"""CUDA graphs over packed forwards: a step's kernels launched by one call instead of one by one.

On a GPU a packed forward of a few requests is bound by launching its kernels, not by the card: a
Llama-1B layer is some forty kernels, each a few microseconds of work after tens of microseconds of
Python and dispatch on the host (BENCHMARKS.md, GPU). `GraphedForwards` captures the forward of a
*layout* once into a CUDA graph and replays it for every later forward of that layout, after copying
the forward's token ids, positions and slot lists into the graph's input buffers (one host-to-device
copy). A layout is `G` segments of at most `W` new tokens each, each reading at most `L` keys, `K`
rows of logits kept per segment; a forward is padded to its layout's bucket:

- a segment's rows to `W`: padding rows are token 0 at the segment's last position, and write their
  K/V to one scratch slot of the pool that nothing reads;
- a segment's keys to `L`: padding keys read the scratch slot and are masked out;
- the batch to `G` segments: padding segments read the scratch slot alone.

Attention in a graph is one SDPA call per layer over `[G, Hkv, groups * W, L]` (the query heads that
share a K/V head stacked along the rows, as `attention.grouped.grouped_attention` does), its additive mask built
once per replay from the rows' and keys' positions, inside the graph; the rest of the model runs as
it is. Buckets: `W` and `G` powers of two (`G` multiples of 8 above 8), `L` multiples of `KEY_STEP`.
A forward runs eagerly instead (returns None) when its layout would pad to more than
`max_rows` rows or more than twice its own rows plus `PAD_SLACK` (a prefill chunk beside decodes),
or when its mask would exceed `MAX_MASK_ELEMENTS`; and every forward runs eagerly once a capture has
failed, the reason kept in `stats()` (layers with a sliding window or soft-capping, whose masks the
static path does not build, fail on purpose). At most `max_graphs` graphs are kept, least recently
used first out; they share one memory pool, so their intermediate tensors take the room of the
largest forward only.

On a CPU the same padded forward runs without capture (`capture=False`): that is how the tests check
a layout's padding and masks against the eager path in float64.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from kvblocks.cache.pool import KVPool

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kvblocks.engine.attention.batch import Segment

log = logging.getLogger(__name__)

# the keyword under which `attention.dispatch` finds a packed forward's batch (`dispatch.NAME`)
BATCH_KEYWORD = "kvblocks_paged"
KEY_STEP = 256  # keys are padded to a multiple of this
PAD_SLACK = 16  # a layout may pad a forward to twice its rows plus this many
MAX_ROWS = 256  # forwards of more rows are compute-bound: they run eagerly, unpadded
MAX_GRAPHS = 32
CAPTURE_AFTER = 2  # a layout is captured the second time a forward takes it; eager before that
SEEN = 256
MAX_MASK_ELEMENTS = 1 << 26  # a layout's additive mask, `G * groups * W * L` elements
_FAR = 1 << 40  # the position of a padding key: after every row, so masked for all of them


@dataclass(frozen=True, slots=True)
class Layout:
    """A graph's shape: `segments` x `width` query rows over `segments` x `length` keys, `keep`
    rows of logits per segment."""

    segments: int
    width: int
    length: int
    keep: int

    @property
    def rows(self) -> int:
        return self.segments * self.width


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def bucket(segments: Sequence[Segment], max_rows: int = MAX_ROWS, groups: int = 1) -> Layout | None:
    """The layout a forward of `segments` (`attention.batch.Segment`) is padded to, or None where padding would
    cost more than launching its kernels one by one, or where its mask (`groups` query heads per K/V
    head) would exceed `MAX_MASK_ELEMENTS`."""
    real = sum(len(s.token_ids) for s in segments)
    n = len(segments)
    layout = Layout(
        segments=_pow2(n) if n <= 8 else -(-n // 8) * 8,
        width=_pow2(max(len(s.token_ids) for s in segments)),
        length=-(-max(len(s.slots) for s in segments) // KEY_STEP) * KEY_STEP,
        keep=max(s.keep for s in segments),
    )
    if layout.rows > max_rows or layout.rows > 2 * real + PAD_SLACK:
        return None
    if layout.rows * groups * layout.length > MAX_MASK_ELEMENTS:
        return None
    return layout


class StaticBatch:
    """What a graphed forward's layers read (`attention.dispatch` hands the call to `attend`):
    device tensors of fixed shape, refilled before every replay."""

    def __init__(self, pool: KVPool, layout: Layout, buffer: torch.Tensor) -> None:
        g, w, length, k = layout.segments, layout.width, layout.length, layout.keep
        self.pool = pool
        self.layout = layout
        sizes = (g * w, g * w, g * w, g * length, g * length, g * k)
        self.ids, self.positions, self.writes, reads, keys, self.keep = torch.split(buffer, list(sizes))
        self.reads = reads.view(g, length)
        self.key_positions = keys.view(g, length)
        self._bias: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def bias(self, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """`[G, 1, groups * W, L]`: 0 where a row may attend a key (causal, real keys), -inf elsewhere;
        row `j * W + i` is query head `j` (of a K/V head's `groups`), row `i`. Built by the first layer."""
        key = (groups, dtype)
        if key not in self._bias:
            g, w, length = self.layout.segments, self.layout.width, self.layout.length
            rows = self.positions.view(g, w)[:, :, None]
            allowed = self.key_positions[:, None, :] <= rows  # [G, W, L]
            bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
                ~allowed, float("-inf")
            )
            self._bias[key] = bias[:, None].expand(g, groups, w, length).reshape(g, 1, groups * w, length)
        return self._bias[key]

    def attend(
        self,
        pool_layer: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """One layer: write the rows' K/V at their slots, then attend `[1, G * W, Hq, D]`."""
        if sliding_window is not None or softcap is not None:
            raise NotImplementedError("graphed forwards build no sliding-window or soft-capped masks")
        new = torch.stack((key[0].transpose(0, 1), value[0].transpose(0, 1)), dim=1)  # [T, 2, Hkv, D]
        pool_layer.index_copy_(0, self.writes, new.to(pool_layer.dtype))
        g, w = self.layout.segments, self.layout.width
        heads, dim = query.shape[1], query.shape[3]
        q = query[0].view(heads, g, w, dim).transpose(0, 1)
        bias = self.bias(heads // key.shape[1], query.dtype)
        return padded_attention(pool_layer, q, self.reads, bias, scale).reshape(1, g * w, heads, dim)


def padded_attention(
    pool_layer: torch.Tensor, q: torch.Tensor, reads: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """`q [G, Hq, W, D]` over the pool slots `reads [G, L]` in one SDPA call: `[G, W, Hq, D]`. The
    query heads that share a K/V head are stacked along the rows (row `j * W + i` is head `j` of
    its group, row `i`), so no K/V is repeated per head and SDPA needs no GQA support (its
    memory-efficient CUDA kernel takes a mask but not `enable_gqa`); `mask` broadcasts to `[G, Hkv,
    groups * W, L]` (boolean or additive)."""
    g, heads, w, dim = q.shape
    kv = pool_layer[reads].to(q.dtype)  # [G, L, 2, Hkv, D]
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [G, Hkv, L, D]
    o = F.scaled_dot_product_attention(q.reshape(g, k.shape[1], -1, dim), k, v, attn_mask=mask, scale=scale)
    return o.reshape(g, heads, w, dim).transpose(1, 2)


class _Entry:
    """One layout's input buffers (host, pinned on CUDA, and device), static batch, graph and output."""

    def __init__(self, pool: KVPool, layout: Layout) -> None:
        g, w, length, k = layout.segments, layout.width, layout.length, layout.keep
        total = 3 * g * w + 2 * g * length + g * k
        pinned = pool.device.type == "cuda"
        self.host = torch.zeros(total, dtype=torch.int64, pin_memory=pinned)
        self.device = torch.zeros(total, dtype=torch.int64, device=pool.device)
        self.batch = StaticBatch(pool, layout, self.device)
        # the last copy out of `host` is done (torch leaves Event.__new__ unannotated)
        self.copied = torch.cuda.Event() if pinned else None  # type: ignore[no-untyped-call]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def fill(self, segments: Sequence[Segment], scratch: int) -> None:
        """The segments' ids, positions and slots into the input buffers (padding as the module says)."""
        layout = self.batch.layout
        g, w, length, k = layout.segments, layout.width, layout.length, layout.keep
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy has read `host`
        ids, positions, writes, reads, keys, keep = (
            part.numpy()
            for part in torch.split(self.host, [g * w, g * w, g * w, g * length, g * length, g * k])
        )
        ids[:], positions[:], writes[:] = 0, 0, scratch
        reads[:], keys[:] = scratch, _FAR
        reads, keys = reads.reshape(g, length), keys.reshape(g, length)
        for i, s in enumerate(segments):
            n, total, start = len(s.token_ids), len(s.slots), s.start
            rows = slice(i * w, i * w + n)
            ids[rows] = s.token_ids
            positions[rows] = np.arange(start, total)
            positions[i * w + n : (i + 1) * w] = total - 1
            writes[rows] = s.slots[start:]
            reads[i, :total] = s.slots
            keys[i, :total] = np.arange(total)
            keep[i * k : (i + 1) * k] = i * w + n - s.keep + np.minimum(np.arange(k), s.keep - 1)
        keys[len(segments) :, 0] = 0  # a padding segment attends its scratch key (no all-masked row)
        keep[len(segments) * k :] = 0
        self.device.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()


class GraphedForwards:
    """Packed forwards of one model over one pool, replayed from CUDA graphs per layout (see the
    module's docstring). `forward(segments)` returns each segment's logits `[keep, vocab]`, or None
    where the forward should run eagerly. Not thread-safe: the caller serialises forwards."""

    def __init__(
        self,
        model: PreTrainedModel,
        pool: KVPool,
        scratch: int,
        capture: bool | None = None,
        max_graphs: int = MAX_GRAPHS,
        max_rows: int = MAX_ROWS,
        capture_after: int = CAPTURE_AFTER,
    ) -> None:
        self.model = model
        self.pool = pool
        self.scratch = int(scratch)
        self.capture = pool.device.type == "cuda" if capture is None else capture
        if self.capture and pool.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {pool.device}")
        self.max_graphs = max_graphs
        self.max_rows = max_rows
        self.capture_after = capture_after
        self._seen: OrderedDict[Layout, int] = OrderedDict()  # uncaptured layouts: forwards so far
        self.disabled: str | None = None  # why forwards run eagerly from now on
        self._entries: OrderedDict[Layout, _Entry] = OrderedDict()
        self._mempool = torch.cuda.graph_pool_handle() if self.capture else None
        heads = model.config.num_attention_heads
        self._groups = heads // (getattr(model.config, "num_key_value_heads", None) or heads)
        self._lock = threading.Lock()
        self.counts = {"replays": 0, "captures": 0, "evictions": 0, "eager": 0}
        self.capture_seconds = 0.0  # host time spent warming up and capturing layouts
        self.warmup_seconds = 0.0  # of which the warm-up forwards

    def stats(self) -> dict[str, Any]:
        """Replays, captures (and the seconds they took), evictions, forwards left eager, graphs
        held and why graphs are off."""
        with self._lock:
            held = {"graphs": len(self._entries), "capture_seconds": round(self.capture_seconds, 4)}
            held["warmup_seconds"] = round(self.warmup_seconds, 4)
            return self.counts | held | {"disabled": self.disabled}

    def forward(self, segments: Sequence[Segment]) -> list[torch.Tensor] | None:
        layout = None if self.disabled else bucket(segments, self.max_rows, self._groups)
        entry = self._entries.get(layout) if layout is not None else None
        if entry is None and layout is not None and not self._recurs(layout):
            layout = None  # seen too few times yet to be worth a capture
        if layout is None:
            self.counts["eager"] += 1
            return None
        if entry is None:
            entry = _Entry(self.pool, layout)
        entry.fill(segments, self.scratch)
        batch = entry.batch

        def run() -> torch.Tensor:
            ids, positions = batch.ids.view(1, -1), batch.positions.view(1, -1)
            batch._bias.clear()  # rebuilt from this run's positions (inside the graph when capturing)
            out = self.model(
                input_ids=ids,
                position_ids=positions,
                use_cache=False,
                logits_to_keep=batch.keep,
                **{BATCH_KEYWORD: batch},
            )
            logits: torch.Tensor = out.logits[0]
            return logits

        if layout not in self._entries:
            start = time.perf_counter()
            try:
                self._capture(entry, run)
            except Exception as exc:  # a capture that cannot work here: eager from now on, said once
                self.disabled = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graphs are off for this model: %s", self.disabled)
                self.counts["eager"] += 1
                return None
            self.capture_seconds += time.perf_counter() - start
            with self._lock:
                self._entries[layout] = entry
                if len(self._entries) > self.max_graphs:
                    self._entries.popitem(last=False)
                    self.counts["evictions"] += 1
        else:
            self._entries.move_to_end(layout)
        if entry.graph is not None and entry.logits is not None:  # captured: the graph wrote its output
            entry.graph.replay()
            logits = entry.logits.clone()  # the graph's output is overwritten by its next replay
        else:
            logits = run()
        self.counts["replays"] += 1
        k = layout.keep
        return [logits[i * k : i * k + s.keep] for i, s in enumerate(segments)]

    def _recurs(self, layout: Layout) -> bool:
        """Count a forward of an uncaptured `layout`: True once it has come `capture_after` times
        (of the last `SEEN` uncaptured layouts), so that a one-off batch (a wave of prompts) runs
        eagerly instead of waiting for a capture, and what repeats (decode steps) is captured."""
        seen = self._seen.pop(layout, 0) + 1
        if seen >= self.capture_after:
            return True
        self._seen[layout] = seen
        if len(self._seen) > SEEN:
            self._seen.popitem(last=False)
        return False

    def _capture(self, entry: _Entry, run: Callable[[], torch.Tensor]) -> None:
        """Warm the layout's forward up on a side stream (lazy initialisation stays out of the graph),
        then capture it; without capture, only check that it runs."""
        if not self.capture:
            run()
            return
        device = self.pool.device
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                start = time.perf_counter()
                run()
                self.warmup_seconds += time.perf_counter() - start
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
                entry.logits = run()
        entry.graph = graph
        self.counts["captures"] += 1
