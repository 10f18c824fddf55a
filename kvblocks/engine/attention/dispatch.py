"""The attention function transformers calls: a packed batch's layers, or the model's own attention.

`install(model)` makes the model's attention implementation a dispatcher: calls that carry a
packed batch (under the keyword `NAME`) take the packed path, every other call goes to the
implementation the model had (sdpa, eager, ...) with the same arguments, so ordinary forwards are
unchanged. On the packed path each layer writes its new K/V into the pool at the new tokens' slots,
then reads the keys by the batch's plans: the cascade plan and the CPU kernel on layers without a
window or soft-capping; grouped calls and a call per segment otherwise.

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

from kvblocks.engine import graphs, kernel
from kvblocks.engine.attention.batch import PackedBatch
from kvblocks.engine.attention.grouped import grouped_attention
from kvblocks.engine.attention.per_segment import plain_attention, segment_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel

NAME = graphs.BATCH_KEYWORD  # the keyword a packed forward's batch travels under to every layer
ATTENTION_RANGE = "kvblocks.attention"  # the profiler range around `paged_attention`, under a profiler
# whether a profiler is recording on this process (a torch without the check: always, as before)
_profiling = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)
# Model types whose packed forward is tested equal to one request at a time (tests/test_paged.py).
SUPPORTED = frozenset(
    {"llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text", "gpt2", "gpt_neox", "opt"}
)
_KNOWN_KWARGS = frozenset({"position_ids", "use_cache", "output_attentions", "is_causal", "cache_position"})

_install_lock = threading.Lock()
_clock = threading.local()  # `attention_clock`'s accumulator on this thread, if one is open
_wrapped: dict[str, str] = {}  # dispatcher name -> the implementation it falls back to


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


def paged_attention(*args: Any, **kwargs: Any) -> Any:
    """The attention interface's signature: `query [1, Hq, T, D]`, `key/value [1, Hkv, T, D]` of the
    packed new tokens (rotary applied). Returns `([1, T, Hq, D], None)`. Under a profiler it runs inside
    a range named `ATTENTION_RANGE`, so a profile can tell attention from the rest of a step (without
    one the range is skipped: entering it cost 3 ms of a 145 ms decode step), and is timed
    inside an `attention_clock`."""
    spent = getattr(_clock, "spent", None)
    start = time.process_time() if spent is not None else 0.0
    # the range costs about 0.1 ms a call in a step
    with torch.profiler.record_function(ATTENTION_RANGE) if _profiling() else nullcontext():
        out = _dispatch(*args, **kwargs)
    if spent is not None:
        spent[0] += time.process_time() - start
    return out


def _dispatch(
    module: Any,  # the model's attention layer (its family's own class)
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> Any:
    batch: PackedBatch | graphs.StaticBatch | None = kwargs.pop(NAME, None)
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
    pool_layer = batch.pool.layers[layer]
    if pool_layer is None:
        raise NotImplementedError(f"layer {layer} keeps no KV in the pool")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(batch, graphs.StaticBatch):  # a graphed forward's fixed layout
        return batch.attend(pool_layer, query, key, value, scale, sliding_window, softcap), None
    new = torch.stack((key[0].transpose(0, 1), value[0].transpose(0, 1)), dim=1)  # [T, 2, Hkv, D]
    pool_layer.index_copy_(0, batch.write_index, new.to(batch.pool.dtype))
    return _packed_attention(
        pool_layer, query, batch, scale, query.shape[1] // key.shape[1], sliding_window, softcap
    )[None], None


def _packed_attention(
    pool_layer: torch.Tensor,
    query: torch.Tensor,
    batch: PackedBatch,
    scale: float,
    groups: int,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """`[T, Hq, D]`: by the batch's plans where the layer has no window and no soft-capping; else
    the grouped segments in one call (no soft-capping) and the others a call each."""
    if (batch.direct is not None or batch.cascade is not None) and window is None and softcap is None:
        return _planned_attention(pool_layer, query, batch, scale, groups)
    out = torch.empty(query.shape[2], query.shape[1], query.shape[3], dtype=query.dtype, device=query.device)
    alone: range | list[int] = range(len(batch.segments))
    if batch.grouped and softcap is None:
        group = batch.group(window)
        out[group.out] = grouped_attention(pool_layer, query, group, scale, groups)
        alone = batch.alone
    views = batch.views(window)
    for i in alone:
        (a, b), (index, mask) = batch.bounds[i], views[i]
        if softcap is None:
            mask = batch.segment_mask(window, i, groups, query.dtype)
        o = segment_attention(pool_layer, query[0, :, a:b], index, mask, scale, groups, softcap)
        if len(batch.segments) == 1:  # the only segment: its output is the layer's (no copy)
            return o
        out[a:b] = o
    return out


def _planned_attention(
    pool_layer: torch.Tensor, query: torch.Tensor, batch: PackedBatch, scale: float, groups: int
) -> torch.Tensor:
    """`[T, Hq, D]` by the batch's plans (layers without a window or soft-capping): its cascade plan
    (`CascadePlan` or `FixedCutsPlan`) for the segments it holds, the CPU kernel for the `direct`
    ones, over their slots in place, and draft trees a call each."""
    if batch.cascade is not None:
        out = batch.cascade.attend(pool_layer, query, batch, scale, groups)
    else:
        out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
    if batch.direct is not None:
        kernel.attend(query, pool_layer, batch.direct, scale, out)
    plain_attention(pool_layer, query, batch, batch.trees, out, scale, groups)
    return out


def _fallback(module: Any) -> Callable[..., Any]:
    """The attention function the model had before `install`: a registered one, or the eager
    function of the module's own modeling file (each family has its own)."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = _wrapped[module.config._attn_implementation]
    function: Callable[..., Any]
    if original in ALL_ATTENTION_FUNCTIONS:
        function = ALL_ATTENTION_FUNCTIONS[original]
    else:
        function = sys.modules[type(module).__module__].eager_attention_forward
    return function


def supports(model: PreTrainedModel) -> bool:
    """True when `model` can run packed forwards (its family is in SUPPORTED)."""
    return getattr(model.config, "model_type", None) in SUPPORTED


def install(model: PreTrainedModel) -> None:
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
