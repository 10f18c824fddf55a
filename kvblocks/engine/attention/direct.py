"""The CPU kernel's share of a packed forward: narrow segments attended with their keys in place.

On a CPU, segments of at most `kernel.MAX_WIDTH` new tokens (decodes, speculative rounds) attend
through the C++ kernel of `kvblocks.engine.kernel` where it builds, under the cascade strategies
(batch-invariant or not): all their keys read where they lie in the pool instead of gathered every
layer, a shared run read once for every row of the group of segments that starts with it, and one
exact softmax per row whose arithmetic depends on the row's query and keys only (so batch-invariant
forwards need neither fixed cuts nor padding rows there). Wider segments keep the cascade plans.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvblocks.cache.pool import KVPool
from kvblocks.engine import kernel
from kvblocks.engine.attention.batch import leading_run

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kvblocks.engine.attention.batch import PackedBatch


def kernel_plan(batch: PackedBatch, members: Sequence[int], minimum: int) -> kernel.Plan:
    """The CPU kernel's plan for `members`: segments whose keys begin with a run of at least
    `minimum` consecutive slots at the same first slot (a prefix the trie stored once) form a group
    that reads the shortest of their runs once for all of them; the rest of each segment's keys are
    its own. A segment with no such run is a group of its own."""
    by_first: dict[int, list[tuple[int, int]]] = {}
    alone = []
    for i in members:
        slots, start = batch.slots[i], batch.starts[i]
        run = leading_run(slots, start, minimum)
        if run:
            by_first.setdefault(int(slots[0]), []).append((i, run))
        else:
            alone.append(i)
    groups = []
    for first, group in by_first.items():
        run = min(n for _, n in group)
        shared = np.arange(first, first + run)
        groups.append((shared, [(np.arange(*batch.bounds[i]), batch.slots[i][run:]) for i, _ in group]))
    empty = np.zeros(0, dtype=np.int64)
    groups += [(empty, [(np.arange(*batch.bounds[i]), batch.slots[i])]) for i in alone]
    return kernel.Plan.of(groups)


def direct_refusal(model: PreTrainedModel, pool: KVPool) -> str | None:
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
