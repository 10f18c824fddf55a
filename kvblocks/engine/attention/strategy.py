"""The attention strategy of a packed forward, chosen once from the configuration (`choose`).

A strategy says how a batch's layers read their keys: `PerSegment` (a call per segment),
`Grouped` (short segments in one call: the CUDA default), `Cascade` (shared runs read in place: the
CPU default) or `FixedCuts` (the cascade cut at fixed positions: the CPU default when
batch-invariant). The cascades also hand narrow segments to the CPU kernel where it builds
(`direct`). Each plans a `PackedBatch` (`plan`); `dispatch` runs the plans layer by layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvblocks.cache.pool import KVPool
from kvblocks.engine.attention.cascade import CASCADE_MIN_RUN, Cascade
from kvblocks.engine.attention.direct import direct_refusal
from kvblocks.engine.attention.fixed_cuts import CASCADE_CUTS, FixedCuts
from kvblocks.engine.attention.grouped import Grouped
from kvblocks.engine.attention.per_segment import PerSegment
from kvblocks.engine.attention.probes import probe_blocks_invariance

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ATTENTION_MODES = ("cascade", "grouped", "per-segment")  # `kvblocks serve --attention`
Attention = PerSegment | Grouped | Cascade | FixedCuts


def choose(
    model: PreTrainedModel,
    pool: KVPool,
    invariant: bool = False,
    chunk: int = 1,
    mode: str | None = None,
    cascade_min: int = CASCADE_MIN_RUN,
    cascade_cuts: Sequence[int] | None = None,
    direct: bool | None = None,
) -> Attention:
    """The strategy for `mode` (one of `ATTENTION_MODES`; None: the device's default, grouped on
    CUDA, cascade elsewhere, cut at fixed positions when `invariant` where `probe_blocks_invariance`
    holds, else one call per request). `direct`: the CPU kernel for narrow segments under a
    cascade (None: where it can; True: refused by name where it cannot)."""
    if mode is not None and mode not in ATTENTION_MODES:
        raise ValueError(f"attention mode must be one of {', '.join(ATTENTION_MODES)}, got {mode!r}")
    # short segments share one attention call per layer: on a GPU, where a call per segment is
    # launch-bound; not in invariant mode (a padded call's key length depends on the batch)
    grouped = pool.device.type == "cuda" and not invariant if mode is None else mode == "grouped"
    if grouped and invariant:
        raise ValueError("grouped attention calls are not batch-invariant")
    # cascade attention: the default on CPU, cut at fixed positions in invariant mode (where
    # `probe_blocks_invariance` holds); on CUDA the grouped path stays the default (cascade
    # measured 17x slower there)
    dims = {t.shape[-1] for t in pool.layers if t is not None}  # the head dims the probe covers
    holds = not invariant or all(probe_blocks_invariance(pool.device, pool.dtype, dim) for dim in dims)
    cascade = not grouped and holds if mode is None else mode == "cascade"
    if cascade and not holds:
        raise NotImplementedError(
            f"batch-invariant cascade attention: the fused attention kernel or exp / log on {pool.device} "
            f"in {pool.dtype} round an element differently by where it lies (use one call per request)"
        )
    align = chunk if invariant else 1
    if not cascade:
        if direct:
            raise NotImplementedError("the attention kernel cannot be used: it serves cascade attention only")
        return Grouped() if grouped else PerSegment(align)
    # the CPU kernel (`kvblocks.engine.kernel`): short segments' keys read in place, shared runs once
    why = direct_refusal(model, pool)
    if direct and why:
        raise NotImplementedError(f"the attention kernel cannot be used: {why}")
    use = why is None if direct is None else direct
    reason = None if use else why or "turned off"
    if invariant:
        sizes = FixedCuts.rounded(chunk, cascade_cuts or CASCADE_CUTS)
        return FixedCuts(cascade_min, use, reason, align, sizes)
    return Cascade(cascade_min, use, reason, align)
