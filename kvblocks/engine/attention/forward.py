"""`PackedForward`: packed forwards of one model over one pool, many requests in one forward.

The tokens of all segments go through the model as one sequence `[1, T]` with each token's own
position id, so the linear layers see every request's rows at once; attention keeps the requests
apart (`dispatch`), reading each one's keys through its slot list by the strategy chosen once
(`strategy.choose`). On a GPU a forward of at most 256 rows is padded to a fixed layout and replayed
from a CUDA graph by default (`kvblocks.engine.graphs`), which launches its kernels at once. In
batch-invariant forwards padding rows make every matrix product see at least `MIN_ROWS` rows
(`probes`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvblocks.cache.pool import KVPool
from kvblocks.engine import graphs
from kvblocks.engine.attention.batch import PackedBatch, Segment
from kvblocks.engine.attention.cascade import CASCADE_MIN_RUN
from kvblocks.engine.attention.dispatch import NAME, install
from kvblocks.engine.attention.probes import MIN_ROWS, probe_row_invariance
from kvblocks.engine.attention.strategy import choose
from kvblocks.engine.head import PackedHead, PackedLinears, scope

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PACKED_WEIGHTS = ("all", "head", "none")  # `kvblocks serve --packed-weights`


def packed_layers(model: PreTrainedModel, which: str) -> PackedLinears | PackedHead | None:
    """The reordered weights a forward's packed forwards take: every linear layer's (`"all"`), the
    output head's (`"head"`) or none (`"none"`)."""
    if which not in PACKED_WEIGHTS:
        raise ValueError(f"packed_weights must be one of {', '.join(PACKED_WEIGHTS)}, not {which!r}")
    if which == "all":
        return PackedLinears.of(model)
    return PackedHead.of(model) if which == "head" else None


def graphs_default(device: torch.device, invariant: bool, grouped: bool | None = None) -> bool:
    """Whether packed forwards replay CUDA graphs by default: on CUDA, with the device's default
    (grouped) attention, not batch-invariant."""
    return device.type == "cuda" and not invariant and grouped is not False


def scratch_slots(invariant: bool, cuda_graphs: bool) -> int:
    """Pool slots a `PackedForward` holds for padding rows' K/V: `MIN_ROWS - 1` batch-invariant, 1
    for CUDA graphs, else none."""
    return MIN_ROWS - 1 if invariant else int(cuda_graphs)


def check_invariance(model: PreTrainedModel, pool: KVPool) -> None:
    """NotImplementedError unless batch-invariant forwards hold for `model` over `pool`."""
    if pool.device.type != "cpu":
        raise NotImplementedError(
            f"batch-invariant forwards are proven on CPU only: on {pool.device.type} a request's rows "
            "are not bit-identical alone and in a batch (measured on an H200, BENCHMARKS.md)"
        )
    if not probe_row_invariance(pool.device, pool.dtype, model.config.hidden_size):
        raise NotImplementedError(
            f"batch-invariant forwards: matrix products on {pool.device} in {pool.dtype} round a "
            f"row differently with different row counts from {MIN_ROWS} up"
        )


class PackedForward:
    """Packed forwards of one model over one pool (the trie's, or a pool of its own). With
    `invariant`, matrix products never run on fewer than `MIN_ROWS` rows (padding rows use
    `MIN_ROWS - 1` `scratch` slots, taken from the pool when not given) and windowed layers read
    from the window of the first position of the segment's `chunk`; refused where
    `probe_row_invariance` fails. `attention`: a mode of `strategy.ATTENTION_MODES` (None: the
    device's default), made a strategy once with `cascade_min`, `cascade_cuts` and `direct`
    (`strategy.choose`). `packed_weights`: `"all"` runs the linear layers and the output head on
    weights reordered once for oneDNN where that is possible (`kvblocks.engine.head`; their size in
    memory once more), `"head"` the output head only, `"none"` neither. `cuda_graphs` (default: on
    CUDA with grouped attention, not batch-invariant): forwards that fit a layout replay CUDA graphs
    (`kvblocks.engine.graphs`), their padding rows writing to one scratch slot (taken from the pool
    when `scratch` is not given)."""

    def __init__(
        self,
        model: PreTrainedModel,
        pool: KVPool,
        invariant: bool = False,
        chunk: int = 1,
        scratch: np.ndarray | None = None,
        attention: str | None = None,
        cascade_min: int = CASCADE_MIN_RUN,
        cascade_cuts: Sequence[int] | None = None,
        packed_weights: str = "all",
        cuda_graphs: bool | None = None,
        direct: bool | None = None,
    ) -> None:
        install(model)
        if invariant:
            check_invariance(model, pool)
        self.model = model
        self.pool = pool
        self.invariant = invariant
        self.attention = choose(model, pool, invariant, chunk, attention, cascade_min, cascade_cuts, direct)
        if cuda_graphs is None:  # `kvblocks.engine.graphs`: the default with grouped attention on CUDA
            cuda_graphs = graphs_default(pool.device, invariant, self.attention.groups)
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
        batch = PackedBatch(self.pool, segments, self.attention)
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
