"""transformers' encoder-decoder caches (`EncoderDecoderCache`) as two kvblocks records.

A seq2seq request caches two things of different kinds. Its *source* (encoder output and every
decoder layer's cross-attention K/V) depends on the whole source at once, so it is kept as one
record per source. Its decoder self-attention K/V is causal, so it is a token prefix like a
decoder-only model's. `DecoderBridge` and `SourceBridge` are the two `PastBridge`s the core caches
use; `Seq2SeqPast` is what a running request holds (the live cache and the encoder output the
decoder's cross-attention reads).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, EncoderDecoderCache
from transformers.cache_utils import DynamicLayer

from kvblocks.adapters import hf
from kvblocks.cache.layout import LayerSpec


@dataclass(slots=True)
class Seq2SeqPast:
    """A running request's cache: decoder self- and cross-attention, and the encoder output `[1, S, d]`."""

    cache: EncoderDecoderCache
    encoder_hidden: torch.Tensor

    @property
    def decoder(self) -> DynamicCache:
        return self.cache.self_attention_cache


@dataclass(slots=True)
class SourceKV:
    """What a source gives every request over it: the encoder output and, once a decoder forward
    computed them, the cross-attention K/V (`cross` None until then)."""

    encoder_hidden: torch.Tensor
    cross: DynamicCache | None


def is_seq2seq(model) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


def encoder_forward_arg(model) -> str:
    """The forward argument that takes a cache (`cache` since transformers 5.24)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def encode(model, source_ids: list[int]) -> torch.Tensor:
    """The encoder's last hidden state `[1, S, d]` for one unpadded source."""
    device = next(model.parameters()).device
    ids = torch.tensor([source_ids], dtype=torch.long, device=device)
    out = model.get_encoder()(input_ids=ids, attention_mask=torch.ones_like(ids), return_dict=True)
    _OUTPUT_TYPES[type(model)] = type(out)
    return out[0]


# The class of each model type's encoder output: some decoders read more than the hidden state off
# it (switch_transformers and nllb-moe their router logits), so it is passed back in its own class.
_OUTPUT_TYPES: dict[type, type] = {}


def encoder_outputs(model, hidden: torch.Tensor):
    """`hidden` as the encoder output the model's forward expects (after one `encode` of it)."""
    return _OUTPUT_TYPES[type(model)](last_hidden_state=hidden)


def fresh_past(self_cache: DynamicCache | None, source: SourceKV) -> Seq2SeqPast:
    """A request's cache from a decoder prefix (None: empty) and its source: cross-attention K/V,
    when the source has them, are reused as they are (transformers then skips recomputing them)."""
    cross = source.cross if source.cross is not None else DynamicCache()
    decoder = self_cache if self_cache is not None else DynamicCache()
    return Seq2SeqPast(EncoderDecoderCache(decoder, cross), source.encoder_hidden)


# Families refused by name, with what was measured on plain transformers (docs/SEQ2SEQ.md)
REFUSED = {
    "prophetnet": (
        "runs a cached decoder forward on one token only (transformers asserts that `use_cache` "
        "supports decoder_input_ids of length 1), so a decoder prompt cannot be prefilled after a cached "
        "prefix; in float64 its logits are NaN even without kvblocks (an all-ones attention_mask times "
        "float64's minimum, computed in float32, is 0 x -inf)"
    ),
}


@torch.inference_mode()
def describe(model) -> tuple[list[LayerSpec], list[LayerSpec]]:
    """Probe a seq2seq model with a one-token source and decoder step: the decoder's self-attention
    specs, and the source record's specs (encoder output first, then each layer's cross-attention)."""
    config = model.config
    if config.model_type in REFUSED:
        raise hf.UnsupportedModelError(f"model type '{config.model_type}' {REFUSED[config.model_type]}")
    if getattr(config, "attention_type", None) == "block_sparse":
        raise hf.UnsupportedModelError(
            f"model type '{config.model_type}' with attention_type='block_sparse' switches its encoder to "
            "full attention for good on its first short input (kvblocks' one-token probe would change the "
            "model); load it with attention_type='original_full'"
        )
    d_model = encode(model, [0]).shape[-1]
    if d_model % 2:
        raise hf.UnsupportedModelError(
            f"model type '{config.model_type}' has an odd hidden size ({d_model}); kvblocks stores the "
            "encoder output as one K/V pair of half its width"
        )
    past = fresh_past(None, SourceKV(encode(model, [0]), None))
    step(model, [0], past, keep=1)
    decoder, cross = past.cache.self_attention_cache, past.cache.cross_attention_cache
    return _specs(config, decoder, "self"), [
        LayerSpec("full", 1, d_model // 2),
        *_specs(config, cross, "cross"),
    ]


def _specs(config, cache: DynamicCache, what: str) -> list[LayerSpec]:
    specs = []
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer or layer.keys.dim() != 4 or layer.keys.shape != layer.values.shape:
            raise hf.UnsupportedModelError(
                f"model type '{config.model_type}' {what}-attention layer {i} caches "
                f"{type(layer).__name__} {tuple(getattr(layer, 'keys', torch.empty(0)).shape)}; kvblocks "
                "expects full-attention K/V of shape [batch, heads, tokens, head_dim]"
            )
        specs.append(LayerSpec("full", layer.keys.shape[1], layer.keys.shape[3]))
    return specs


def step(model, token_ids: list[int], past: Seq2SeqPast, keep: int) -> torch.Tensor:
    """One decoder forward over `token_ids` after `past`; logits `[keep, vocab]` of its last positions."""
    device = past.encoder_hidden.device
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    mask = torch.ones(past.encoder_hidden.shape[:2], dtype=torch.long, device=device)
    out = model(
        encoder_outputs=encoder_outputs(model, past.encoder_hidden),
        attention_mask=mask,
        decoder_input_ids=ids,
        use_cache=True,
        **{encoder_forward_arg(model): past.cache},
    )
    return out.logits[0, -keep:]


def crop(past: Seq2SeqPast, length: int) -> None:
    """Roll the decoder back to `length` tokens; the cross-attention K/V depend on the source only."""
    hf.crop(past.decoder, length)


def _kv(cache: DynamicCache, start: int, end: int | None) -> list[torch.Tensor]:
    """`[end - start, 2, H, D]` per layer of a cache of full-attention layers."""
    return [
        torch.stack((layer.keys[0, :, start:end], layer.values[0, :, start:end])).permute(2, 0, 1, 3)
        for layer in cache.layers
    ]


def padded(source: SourceKV, length: int) -> SourceKV:
    """`source` grown to `length` positions with zeros (what no request reads): a source record is
    stored in whole spill chunks, or Redis would keep all of it but its last part."""
    extra = length - source.encoder_hidden.shape[1]
    if extra <= 0:
        return source
    assert source.cross is not None
    hidden = torch.nn.functional.pad(source.encoder_hidden, (0, 0, 0, extra))
    kv = [torch.nn.functional.pad(t, (0, 0, 0, 0, 0, 0, 0, extra)) for t in _kv(source.cross, 0, None)]
    return SourceKV(hidden, _cache_of(kv))


def trimmed(source: SourceKV, length: int) -> SourceKV:
    """The first `length` positions of a (padded) source record fresh from the pool (cut in place)."""
    if source.encoder_hidden.shape[1] == length:
        return source
    for layer in source.cross.layers:
        layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]
    return SourceKV(source.encoder_hidden[:, :length], source.cross)


def _cache_of(kv: list[torch.Tensor]) -> DynamicCache:
    """A fresh `DynamicCache` holding `kv[l]` (`[T, 2, H, D]`) in layer l."""
    return DynamicCache(
        ddp_cache_data=[(t[:, 0].transpose(0, 1)[None], t[:, 1].transpose(0, 1)[None]) for t in kv]
    )


@dataclass(slots=True, frozen=True)
class DecoderBridge:
    """`PastBridge` of a seq2seq decoder's self-attention: builds the `DynamicCache` a `Seq2SeqPast`
    wraps, and reads a running request's `Seq2SeqPast`."""

    specs: tuple[LayerSpec, ...]
    min_prefill: int = 1

    def build(self, kv: list[torch.Tensor | None], length: int, state: Any) -> DynamicCache:
        return _cache_of(kv) if length else DynamicCache()

    def extract(self, past: Seq2SeqPast, start: int, end: int) -> list[torch.Tensor]:
        return _kv(past.decoder, start, end)

    def length(self, past: Seq2SeqPast) -> int:
        return past.decoder.get_seq_length()

    def capture(self, past: Any) -> torch.Tensor:
        raise TypeError("a seq2seq decoder keeps no recurrent state to snapshot")


@dataclass(slots=True, frozen=True)
class SourceBridge:
    """`PastBridge` of source records: position t holds the encoder output of source token t (split
    into a K and a V half) and each layer's cross-attention K/V of it."""

    specs: tuple[LayerSpec, ...]
    min_prefill: int = 1

    def build(self, kv: list[torch.Tensor | None], length: int, state: Any) -> SourceKV:
        hidden = kv[0].reshape(1, length, -1)
        return SourceKV(hidden, _cache_of(kv[1:]))

    def extract(self, past: SourceKV, start: int, end: int) -> list[torch.Tensor]:
        assert past.cross is not None, "a source is stored once a decoder forward computed its cross K/V"
        hidden = past.encoder_hidden[0, start:end]
        return [hidden.reshape(end - start, 2, 1, -1), *_kv(past.cross, start, end)]

    def length(self, past: SourceKV) -> int:
        return past.encoder_hidden.shape[1]

    def capture(self, past: Any) -> torch.Tensor:
        raise TypeError("a source record keeps no recurrent state to snapshot")
