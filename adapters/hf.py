"""The one place that touches transformers' cache internals (checked against transformers 5.x).

A kvblocks pool stores every token's KV for every attention layer. This module turns pool data
into a fresh `DynamicCache` with the layer classes the model itself would build (full attention,
sliding window, hybrid layouts such as gemma2/gemma3), reads the KV of new tokens back out of a
live cache, and crops a cache to a target length.

Recurrent layers (SSM, short convolution, gated linear attention: transformers'
`LinearAttentionCacheLayerMixin`) keep a state that summarises every token so far; it cannot be
sliced per token. For the families in `STATEFUL_MODEL_TYPES` (each tested exact) this module
copies that state out of a live cache at the position the cache has reached (`capture_state`,
one byte string laid out by a `StateLayout`) and writes it back into a fresh cache
(`apply_state`), which then continues exactly as the live one would have.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
)

from kvblocks.cache.layout import LayerSpec, StateLayout

# Architectures whose cache carries recurrent (SSM / linear-attention / conv) state. That state
# cannot be sliced per token, so serving a prefix of it would be silently wrong.
RECURRENT_MODEL_TYPES = frozenset(
    {
        "mamba",
        "mamba2",
        "falcon_mamba",
        "jamba",
        "falcon_h1",
        "zamba",
        "zamba2",
        "bamba",
        "granitemoehybrid",
        "nemotron_h",
        "qwen3_next",
        "qwen3_5",
        "qwen3_5_moe",
        "lfm2",
        "lfm2_moe",
        "lfm2_vl",
        "lfm3",
        "lara_mini",
        "zaya",
        "recurrent_gemma",
        "rwkv",
        "xlstm",
        "minimax",
        "kimi_linear",
        "bailing_hybrid",
        "olmo_hybrid",
    }
)


# Recurrent families whose state kvblocks snapshots and restores, each proven exact by
# tests/test_hybrid.py (fp64 bit-identical to a replay, fp32 greedy equal to no cache).
STATEFUL_MODEL_TYPES = frozenset(
    {
        "mamba",
        "mamba2",
        "falcon_mamba",
        "jamba",
        "falcon_h1",
        "lfm2",
        "lfm2_moe",
        "qwen3_next",
        "qwen3_5_text",
        "granitemoehybrid",
        "zamba",
        "zamba2",
        "nemotron_h",
        "bamba",
        "qwen3_5_moe_text",
        "olmo_hybrid",
        "zaya",
        "lfm3",
        "lara_mini",
    }
)
# Why each refused recurrent family is refused, as measured on a tiny random model of it
# (transformers 5.24, float64, tests/test_hybrid.py); a family not named here was never proven.
_VISION = "is a vision-language model; kvblocks caches text-only causal LMs"
REFUSED_REASONS = {
    "recurrent_gemma": "keeps its recurrent state on its own modules (`conv1d_state`, `rg_lru.recurrent_states`), "
    "shared by every request, not in the cache it is given (a prompt fed in two forwards differs from one "
    "forward by 2.1e-2 in its logits)",
    "rwkv": "keeps its recurrent state in its own `state` tensors and leaves a transformers cache unused "
    "(a prompt fed in two forwards with one cache differs from one forward by 0.51 in its logits)",
    "xlstm": "keeps its recurrent state in its own xLSTMCache (`rnn_state`), not in a transformers DynamicCache",
    "minimax": "keeps its linear-attention state in a MiniMaxCache of its own and rejects a DynamicCache",
    "kimi_linear": "caches MLA latents (one head, keys and values of different widths) that kvblocks' pool, "
    "which holds keys and values of one shape, cannot store",
    "bailing_hybrid": "caches MLA latents (one head, keys and values of different widths) that kvblocks' pool, "
    "which holds keys and values of one shape, cannot store",
    "qwen3_5": f"{_VISION}: AutoModelForCausalLM loads its text model (model type 'qwen3_5_text'), which is supported",
    "qwen3_5_moe": f"{_VISION}: AutoModelForCausalLM loads its text model (model type 'qwen3_5_moe_text'), "
    "which is supported",
    "lfm2_vl": f"{_VISION}: its language model is an lfm2, which is supported on its own",
}
# Families whose recurrent layers start from a zero state whenever a forward gets more than one
# token (transformers' mamba scan keeps only the conv state): after a snapshot, their tokens are
# fed one per forward, which continues the state exactly.
STEPWISE_MODEL_TYPES = frozenset({"mamba", "falcon_mamba", "jamba", "zamba"})
# Families whose one-token step computes differently from their multi-token prefill (transformers'
# Zamba2 and Nemotron-H mixers leave out the time_step_min clamp on one token): kvblocks never
# prefills a single token for them (every prefill forward takes at least this many tokens), so a
# cached prompt is computed along the same path as an uncached one; decoding is one token either way.
MIN_PREFILL_TOKENS = {"zamba2": 2, "nemotron_h": 2}
RECURRENT_LAYER_TYPES = frozenset(
    {"conv", "linear_attention", "hybrid", "hybrid_sliding", "mamba", "attention_mamba"}
)


class UnsupportedModelError(ValueError):
    """The model's cache cannot be shared per token prefix without giving wrong output."""


def _refuse(model_type: str, why: str) -> UnsupportedModelError:
    why = REFUSED_REASONS.get(model_type, why)
    return UnsupportedModelError(
        f"model type '{model_type}' {why}; kvblocks restores recurrent state exactly only for "
        f"{', '.join(sorted(STATEFUL_MODEL_TYPES))} (and supports attention-only models)"
    )


def check_supported(config) -> None:
    model_type = getattr(config, "model_type", "?")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    recurrent = set(getattr(text, "layer_types", None) or []) & RECURRENT_LAYER_TYPES
    if (model_type in RECURRENT_MODEL_TYPES or recurrent) and model_type not in STATEFUL_MODEL_TYPES:
        raise _refuse(
            model_type,
            "keeps recurrent state in its cache, which kvblocks has not proven it can restore exactly",
        )


def is_stateful_layer(layer) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def min_prefill_tokens(config) -> int:
    """The fewest tokens a prefill forward of this model takes (see MIN_PREFILL_TOKENS)."""
    return MIN_PREFILL_TOKENS.get(getattr(config, "model_type", None), 1)


def has_state(cache: DynamicCache) -> bool:
    """Whether some recurrent layer of `cache` already holds a state (a forward continues it)."""
    return any(is_stateful_layer(layer) and any(layer.has_previous_state.values()) for layer in cache.layers)


def empty_cache(config) -> DynamicCache:
    """A cache built the way the model builds its own, recording sliding-window past for extraction.

    Recurrent layers do not record their past (a growing conv history): kvblocks snapshots their
    state at exact positions instead of rolling it back.
    """
    cache = DynamicCache(config=config)
    cache.activate_past_recording()
    for layer in cache.layers:
        if is_stateful_layer(layer):
            layer.record_past = False
    return cache


def cache_argument(model) -> str:
    """The forward argument that takes a cache: `cache` since transformers 5.24 (some families, e.g.
    mamba, silently ignore the older `past_key_values`), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def position_arguments(model) -> tuple[str, ...]:
    """The forward arguments, of `position_ids` and `cache_position`, that the model takes: some
    families (bamba) number the new tokens from 0 when they are left out, whatever the cache holds."""
    params = inspect.signature(model.forward).parameters
    return tuple(name for name in ("position_ids", "cache_position") if name in params)


def positions(
    names: tuple[str, ...], past: DynamicCache, count: int, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """The true positions of `count` tokens fed after `past`, as the forward arguments `names`
    (`position_ids` `[1, count]`, `cache_position` `[count]`); none for a cache with no attention
    layer, whose tokens have no position to number."""
    start = seq_length(past)
    if not names or start is None:
        return {}
    numbers = torch.arange(start, start + count, dtype=torch.long, device=device)
    return {name: numbers[None] if name == "position_ids" else numbers for name in names}


@torch.no_grad()
def describe(model: PreTrainedModel) -> tuple[list[LayerSpec], StateLayout | None]:
    """Run a one-token probe and read what the model caches per layer: the KV layout of its
    attention layers and, for a recurrent or hybrid model, the layout of its state snapshots."""
    config = model.config
    check_supported(config)
    device = next(model.parameters()).device
    probe = empty_cache(config)
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    out = model(input_ids=ids, use_cache=True, **{cache_argument(model): probe})
    cache = out.past_key_values
    if cache is not probe:
        raise UnsupportedModelError(
            f"model type '{config.model_type}' did not fill the cache it was given; kvblocks cannot manage it"
        )
    if not isinstance(cache, DynamicCache) or len(cache.layers) == 0:
        raise UnsupportedModelError(
            f"model type '{config.model_type}' did not return a transformers DynamicCache; kvblocks cannot manage it"
        )
    specs, states = [], []
    for i, layer in enumerate(cache.layers):
        if is_stateful_layer(layer):
            if config.model_type not in STATEFUL_MODEL_TYPES:
                raise _refuse(
                    config.model_type, f"keeps recurrent state in layer {i} ({type(layer).__name__})"
                )
            if isinstance(layer, DynamicSlidingWindowLayer):
                raise _refuse(config.model_type, f"mixes recurrent state and a sliding window in layer {i}")
            states.extend(_layer_states(i, layer))
            if not isinstance(layer, DynamicLayer) or not layer.is_initialized:
                specs.append(LayerSpec("none"))
                continue
        if isinstance(layer, DummyLayer):
            specs.append(LayerSpec("none"))
            continue
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) and not is_stateful_layer(layer):
            raise UnsupportedModelError(
                f"model type '{config.model_type}' layer {i} uses {type(layer).__name__}, which kvblocks cannot "
                "slice per token"
            )
        if layer.keys.dim() != 4 or layer.keys.shape != layer.values.shape:
            raise UnsupportedModelError(
                f"model type '{config.model_type}' layer {i} caches KV of shape {tuple(layer.keys.shape)}; "
                "kvblocks expects [batch, heads, tokens, head_dim] for both keys and values"
            )
        _, heads, _, head_dim = layer.keys.shape
        if isinstance(layer, DynamicSlidingWindowLayer):
            specs.append(LayerSpec("sliding", heads, head_dim, int(layer.sliding_window)))
        else:
            specs.append(LayerSpec("full", heads, head_dim))
    return specs, StateLayout.packed(states) if states else None


def describe_layers(model: PreTrainedModel) -> list[LayerSpec]:
    """The per-layer KV layout the model really produces (a one-token probe)."""
    return describe(model)[0]


def _layer_states(i: int, layer) -> list[tuple]:
    out = []
    for index in range(layer.number_of_states):
        if layer.is_conv_states_initialized[index]:
            t = layer.conv_states[index]
            out.append((i, "conv", index, tuple(t.shape), t.dtype))
        if layer.is_recurrent_states_initialized[index]:
            t = layer.recurrent_states[index]
            out.append((i, "recurrent", index, tuple(t.shape), t.dtype))
    return out


def capture_state(cache: DynamicCache, layout: StateLayout) -> torch.Tensor:
    """A copy of every recurrent state of a live cache, as one `[layout.nbytes]` uint8 tensor on
    the cache's device: the state after the last position the cache has consumed."""
    first = layout.states[0]
    device = _state_tensor(cache.layers[first.layer], first).device
    blob = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
    for spec, view in zip(layout.states, layout.views(blob)):
        t = _state_tensor(cache.layers[spec.layer], spec)
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            raise ValueError(
                f"layer {spec.layer} {spec.kind} state is {tuple(t.shape)} {t.dtype}, "
                f"the model's probe said {spec.shape} {spec.dtype}"
            )
        view.copy_(t)
    return blob


def _state_tensor(layer, spec) -> torch.Tensor:
    states = layer.conv_states if spec.kind == "conv" else layer.recurrent_states
    t = states[spec.index]
    if t is None:
        raise ValueError(f"layer {spec.layer} holds no {spec.kind} state {spec.index} yet")
    return t


def apply_state(cache: DynamicCache, layout: StateLayout, blob: torch.Tensor) -> None:
    """Write a snapshot into `cache` (fresh from `empty_cache`/`build_cache`, or live): its
    recurrent layers then continue from the snapshot's position."""
    for spec, view in zip(layout.states, layout.views(blob)):
        layer = cache.layers[spec.layer]
        t = view.clone()
        if layer.device is None:
            layer.dtype, layer.device = t.dtype, t.device
        if spec.kind == "conv":
            layer.conv_states[spec.index] = t
            layer.conv_kernel_size[spec.index] = spec.shape[-1]
            layer.is_conv_states_initialized[spec.index] = True
        else:
            layer.recurrent_states[spec.index] = t
            layer.is_recurrent_states_initialized[spec.index] = True
        layer.has_previous_state[spec.index] = True


def build_cache(
    config,
    specs: list[LayerSpec],
    kv: list[torch.Tensor | None],
    length: int,
    state: tuple[StateLayout, torch.Tensor] | None = None,
) -> DynamicCache:
    """A fresh cache holding `length` tokens; `kv[l]` is `[tokens_held, 2, H, D]` (the last tokens),
    and `state` the (layout, snapshot) of the recurrent layers at `length`."""
    cache = empty_cache(config)
    if length == 0:
        return cache
    assert len(cache.layers) == len(specs), "cache layout changed since the model was probed"
    if any(is_stateful_layer(layer) for layer in cache.layers) and state is None:
        raise ValueError("a cache with recurrent layers needs their state at the hit's position")
    for layer, spec, data in zip(cache.layers, specs, kv):
        if spec.kind == "none":
            continue
        keys = data[:, 0].transpose(0, 1).unsqueeze(0)
        values = data[:, 1].transpose(0, 1).unsqueeze(0)
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        if spec.kind == "sliding":
            layer.cumulative_length = length
    if state is not None:
        apply_state(cache, *state)
    return cache


def seq_length(cache: DynamicCache) -> int | None:
    """Positions the cache holds; None for a cache of recurrent layers only (no layer counts tokens)."""
    if not any(isinstance(layer, DynamicLayer) for layer in cache.layers) and cache.layers:
        return None
    return cache.get_seq_length()


def extract(
    cache: DynamicCache, specs: list[LayerSpec], start: int, end: int
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Keys and values `[n, H, D]` of positions `[start, end)` for each layer (None for "none" layers).

    Sliding-window layers only hold their past when recording was on (see `empty_cache`); asking
    for positions a layer no longer holds raises rather than returning the wrong tokens.
    """
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for i, (layer, spec) in enumerate(zip(cache.layers, specs)):
        if spec.kind == "none":
            out.append(None)
            continue
        held = layer.keys.shape[-2]
        total = layer.get_seq_length()
        first = total - held
        if start < first or end > total:
            raise ValueError(
                f"layer {i} holds positions [{first}, {total}) but [{start}, {end}) was asked for "
                "(a sliding-window cache must record its past to be stored)"
            )
        keys = layer.keys[0, :, start - first : end - first].transpose(0, 1)
        values = layer.values[0, :, start - first : end - first].transpose(0, 1)
        out.append((keys, values))
    return out


def crop(cache: DynamicCache, length: int, *, state_restored: bool = False) -> None:
    """Crop every layer to a target length, keeping a sliding-window layer's recorded past.

    transformers' own `crop` takes a negative count and, once a sliding window is full, throws the
    recorded past away; rolling back by target length keeps later extraction possible. Recurrent
    state cannot be rolled back: a cache with recurrent layers is cropped only after the caller
    wrote the state of the target position back (`apply_state`, then `state_restored=True`).
    """
    current = seq_length(cache)
    if current is None:  # recurrent layers only: no token positions to drop
        return
    if length > current:
        raise ValueError(f"cannot crop a cache of {current} tokens to {length}")
    remove = current - length
    if remove == 0:
        return
    if not state_restored and any(is_stateful_layer(layer) for layer in cache.layers):
        raise ValueError("recurrent state cannot be cropped; restore a snapshot of the target position first")
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DummyLayer) or not isinstance(layer, DynamicLayer) or not layer.is_initialized:
            continue
        held = layer.keys.shape[-2]
        if isinstance(layer, DynamicSlidingWindowLayer):
            keep = held - remove
            if keep < min(length, layer.sliding_window - 1):
                raise ValueError(
                    f"sliding layer {i} cannot roll back {remove} tokens without its recorded past"
                )
            layer.cumulative_length = length
        else:
            keep = length
        layer.keys = layer.keys[..., :keep, :]
        layer.values = layer.values[..., :keep, :]


def place_appended(cache: DynamicCache, positions: torch.Tensor, length: int) -> None:
    """Move the KV a forward appended after the first `length` positions to `positions` (each
    < `length`), then crop to `length`: a blended prefill (`kvblocks.blocks`) recomputes tokens out
    of order over stale rows and writes them back where they belong."""
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or not layer.is_initialized:
            continue
        assert not isinstance(layer, DynamicSlidingWindowLayer), "KV blocks need full-attention layers"
        for name in ("keys", "values"):
            data = getattr(layer, name)
            data[..., positions, :] = data[..., length:, :]
            setattr(layer, name, data[..., :length, :])


@torch.inference_mode()
def keep_rows(cache: DynamicCache, base: int, rows: list[int]) -> None:
    """Keep positions `[0, base)` and then the rows `base + r` for `r` in `rows` (increasing), in
    that order, dropping the rest: a verified draft tree's accepted path. Rows already in place (a
    path along the tree's first branch) are not moved; the others are copied down (a few rows)."""
    moved = [j for j, r in enumerate(rows) if r != j]
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or not layer.is_initialized:
            continue
        assert not isinstance(layer, DynamicSlidingWindowLayer), "draft trees need full-attention layers"
        for name in ("keys", "values"):
            data = getattr(layer, name)
            if moved:
                src = torch.tensor([base + rows[j] for j in moved], device=data.device)
                dst = torch.tensor([base + j for j in moved], device=data.device)
                data[..., dst, :] = data[..., src, :]
            setattr(layer, name, data[..., : base + len(rows), :])


@dataclass(slots=True, frozen=True)
class HFBridge:
    """The cache core's view of transformers caches (`kvblocks.cache.bridge.PastBridge`) for one model:
    its config, layer specs and, on a recurrent model, the layout of its state snapshots."""

    config: Any
    specs: tuple[LayerSpec, ...]
    state: StateLayout | None = None

    @property
    def min_prefill(self) -> int:
        return min_prefill_tokens(self.config)

    def build(self, kv: list[torch.Tensor | None], length: int, state: torch.Tensor | None) -> DynamicCache:
        snapshot = None if state is None else (self.state, state)
        return build_cache(self.config, list(self.specs), kv, length, snapshot)

    def extract(self, past: DynamicCache, start: int, end: int) -> list[torch.Tensor | None]:
        return [
            None if kv is None else torch.stack(kv, dim=1)
            for kv in extract(past, list(self.specs), start, end)
        ]

    def length(self, past: DynamicCache) -> int | None:
        return seq_length(past)

    def capture(self, past: DynamicCache) -> torch.Tensor:
        return capture_state(past, self.state)
