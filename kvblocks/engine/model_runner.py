"""One step's forward: every scheduled sequence in one packed forward (`kvblocks.engine.attention`).

It turns each sequence's tokens of this step into segments that read and write the sequence's own
slots, runs them as one forward and hands back each sequence's logits. It knows nothing of the
scheduling or caching policy.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvblocks.engine import speculative
from kvblocks.engine.attention.batch import Segment
from kvblocks.engine.attention.forward import PackedForward
from kvblocks.engine.scheduler import Batch, Failure, chunk_ends
from kvblocks.engine.sequence import Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kvblocks.cache.pool import KVPool


class StepForward:
    """A step's sequences as segments of one `PackedForward`; a fault fails only its own sequence."""

    def __init__(
        self,
        model: PreTrainedModel,
        pool: KVPool,
        invariant: bool,
        chunk: int,
        scratch: np.ndarray | None,
        attention: str | None = None,
        cuda_graphs: bool | None = None,
        packed_weights: str = "all",
    ) -> None:
        self.packed = PackedForward(
            model,
            pool,
            invariant,
            chunk,
            scratch,
            attention,
            cuda_graphs=cuda_graphs,
            packed_weights=packed_weights,
        )
        self.invariant = invariant
        self.chunk = chunk

    @property
    def scratch(self) -> np.ndarray:
        """The slots of padding rows (batch-invariant or CUDA graphs), held for the runner's life."""
        return self.packed.scratch

    def forward(self, segments: list[Segment]) -> list[torch.Tensor]:
        return self.packed.forward(segments)

    def run(self, batch: Batch) -> list[torch.Tensor | Failure]:
        """Each sequence's output logits (every row of a speculative round, the last one otherwise).
        When the packed forward fails, each sequence runs alone so that the fault fails only the one
        it belongs to (its `Failure` in its place); the others go on."""
        if not batch:
            return []
        segments = [self.segments(s, n) for s, n in batch]
        try:
            outputs = self.forward([seg for group in segments for seg in group])
        except Exception as exc:
            if len(batch) == 1:
                return [Failure(batch[0][0], exc, "forward")]
            return [self._alone(s, group) for (s, _), group in zip(batch, segments)]
        ends = itertools.accumulate(len(group) for group in segments)
        return [outputs[end - 1] for end in ends]

    def _alone(self, s: Sequence, segments: list[Segment]) -> torch.Tensor | Failure:
        try:
            return self.forward(segments)[-1]
        except Exception as exc:
            return Failure(s, exc, "forward")

    def segments(self, s: Sequence, n: int) -> list[Segment]:
        """The segments of `n` tokens of `s`; the last one's logits are its output."""
        if s.proposal:  # the last token and the drafts, every row's logits kept for verification
            tokens = s.sequence + s.proposal[0]
            tree = speculative.segment_tree(s, n)
            return [Segment(tokens[s.computed :], s.slots[: s.computed + n], keep=n, tree=tree)]
        end = s.computed + n
        ends = chunk_ends(s.computed, end, self.chunk) if self.invariant else [end]
        segments, begin = [], s.computed
        for cut in ends:  # a sequence's later pieces read the K/V its earlier ones write
            segments.append(Segment(s.sequence[begin:cut], s.slots[:cut]))
            begin = cut
        return segments
