"""The one place that touches transformers' cache internals (checked against transformers 5.x).

A kvblocks pool stores every token's KV for every attention layer. This module turns pool data
into a fresh `DynamicCache` with the layer classes the model itself would build (full attention,
sliding window, hybrid layouts such as gemma2/gemma3), reads the KV of new tokens back out of a
live cache, and crops a cache to a target length.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer

from kvblocks.layout import LayerSpec

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
        "recurrent_gemma",
        "rwkv",
        "xlstm",
        "minimax",
        "kimi_linear",
        "olmo_hybrid",
    }
)


class UnsupportedModelError(ValueError):
    """The model's cache cannot be shared per token prefix without giving wrong output."""


def check_supported(config) -> None:
    model_type = getattr(config, "model_type", "?")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = set(getattr(text, "layer_types", None) or [])
    recurrent = layer_types & {
        "conv",
        "linear_attention",
        "hybrid",
        "hybrid_sliding",
        "mamba",
        "attention_mamba",
    }
    if model_type in RECURRENT_MODEL_TYPES or recurrent:
        raise UnsupportedModelError(
            f"model type '{model_type}' keeps recurrent state in its cache, which cannot be reused per token "
            "prefix without giving wrong output; kvblocks supports attention-only models"
        )


def empty_cache(config) -> DynamicCache:
    """A cache built the way the model builds its own, recording sliding-window past for extraction."""
    cache = DynamicCache(config=config)
    cache.activate_past_recording()
    return cache


@torch.no_grad()
def describe_layers(model: PreTrainedModel) -> list[LayerSpec]:
    """Run a one-token probe and read the per-layer cache layout the model really produces."""
    config = model.config
    check_supported(config)
    device = next(model.parameters()).device
    probe = empty_cache(config)
    out = model(
        input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), past_key_values=probe, use_cache=True
    )
    cache = out.past_key_values
    if not isinstance(cache, DynamicCache) or len(cache.layers) == 0:
        raise UnsupportedModelError(
            f"model type '{config.model_type}' did not return a transformers DynamicCache; kvblocks cannot manage it"
        )
    specs = []
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DummyLayer):
            specs.append(LayerSpec("none"))
            continue
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
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
    return specs


def build_cache(config, specs: list[LayerSpec], kv: list[torch.Tensor | None], length: int) -> DynamicCache:
    """A fresh cache holding `length` tokens; `kv[l]` is `[tokens_held, 2, H, D]` (the last tokens)."""
    cache = empty_cache(config)
    if length == 0:
        return cache
    assert len(cache.layers) == len(specs), "cache layout changed since the model was probed"
    for layer, spec, data in zip(cache.layers, specs, kv):
        if spec.kind == "none":
            continue
        keys = data[:, 0].transpose(0, 1).unsqueeze(0)
        values = data[:, 1].transpose(0, 1).unsqueeze(0)
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        if spec.kind == "sliding":
            layer.cumulative_length = length
    return cache


def seq_length(cache: DynamicCache) -> int:
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


def crop(cache: DynamicCache, length: int) -> None:
    """Crop every layer to a target length, keeping a sliding-window layer's recorded past.

    transformers' own `crop` takes a negative count and, once a sliding window is full, throws the
    recorded past away; rolling back by target length keeps later extraction possible.
    """
    current = cache.get_seq_length()
    if length > current:
        raise ValueError(f"cannot crop a cache of {current} tokens to {length}")
    remove = current - length
    if remove == 0:
        return
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DummyLayer) or not layer.is_initialized:
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
