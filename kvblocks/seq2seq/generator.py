"""Seq2SeqCachedGenerator: `CachedGenerator` for encoder-decoder models.

The encoder runs once per source (or not at all when `Seq2SeqCache` holds the source's record);
the decoder is then driven by the same stream, per-token rule and commits as a decoder-only
model, its prefix looked up under the source's scope. The decoder sequence a request is keyed by
is the model's decoder start token followed by the decoder prompt.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from kvblocks.adapters import hf_seq2seq
from kvblocks.adapters.hf_seq2seq import Seq2SeqPast, SourceKV
from kvblocks.cache.trie import Hit, Salt
from kvblocks.generate.decoding import Piece
from kvblocks.generate.generator import CachedGenerator, DecodeState, ModelRunner, PromptTooLongError
from kvblocks.generate.params import GenerationParams, ParamError
from kvblocks.generate.text import Prompt, PromptError, encode_prompt
from kvblocks.seq2seq.cache import Seq2SeqCache, SourceScope, SourceUse

__all__ = ["Seq2SeqCachedGenerator", "Seq2SeqPrompt", "Seq2SeqRunner"]


@dataclass(slots=True, frozen=True)
class Seq2SeqPrompt:
    """A seq2seq request: the `source` the encoder reads and the `decoder` prompt the reply continues
    (text is tokenised without special tokens; the decoder start token is added by the generator)."""

    source: Prompt
    decoder: str | Sequence[int] = ()


class Seq2SeqRunner(ModelRunner):
    """Forward passes of a seq2seq model: its encoder, and decoder steps over a `Seq2SeqPast`."""

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], past: Seq2SeqPast, keep: int = 1) -> torch.Tensor:
        with self.lock:
            return hf_seq2seq.step(self.model, list(token_ids), past, keep)

    @torch.inference_mode()
    def encode(self, source_ids: list[int]) -> torch.Tensor:
        with self.lock:
            return hf_seq2seq.encode(self.model, source_ids)

    def crop(self, past: Seq2SeqPast, length: int) -> None:
        hf_seq2seq.crop(past, length)


def source_context(config) -> int | None:
    """Source tokens the encoder embeds positions for (None: relative positions, as T5)."""
    for name in ("max_encoder_position_embeddings", "max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def decoder_start(model) -> int:
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "decoder_start_token_id", None)
        if isinstance(value, int):
            return value
    raise ValueError(f"model type '{model.config.model_type}' states no decoder_start_token_id")


class Seq2SeqCachedGenerator(CachedGenerator):
    """Generate from an encoder-decoder model with source and decoder-prefix reuse from a
    `Seq2SeqCache` (or none when `cache` is None). `generate`/`stream` take a `Seq2SeqPrompt` (or a
    bare source); results count the source in `encoder_tokens` / `encoder_cached_tokens`."""

    def __init__(self, model, tokenizer, cache: Seq2SeqCache | None) -> None:
        super().__init__(model, tokenizer, cache.decoder if cache is not None else None)
        self.bind_seq2seq(cache)

    def bind_seq2seq(self, cache: Seq2SeqCache | None) -> None:
        """The seq2seq parts of a generator whose `CachedGenerator` part is set up (the speculative
        generator shares them)."""
        if not hf_seq2seq.is_seq2seq(self.model):
            raise ValueError(f"model type '{self.model.config.model_type}' is not an encoder-decoder model")
        self.seq2seq = cache
        self.runner = Seq2SeqRunner(self.model)
        self.start_id = decoder_start(self.model)
        self.max_source = source_context(self.model.config)

    def check_params(self, params: GenerationParams) -> None:
        """KV blocks re-rotate a decoder-only model's cached keys: refused here by name."""
        if params.kv_mode != "exact":
            raise ParamError(
                "kv_mode", f"an encoder-decoder model serves kv_mode 'exact' only, not {params.kv_mode!r}"
            )
        super().check_params(params)

    def encode_source(self, source: Prompt) -> list[int]:
        ids = encode_prompt(self.tokenizer, source)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise PromptError(f"source token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if self.max_source is not None and len(ids) > self.max_source:
            raise PromptTooLongError(
                f"source has {len(ids)} tokens but the model's encoder takes {self.max_source} tokens"
            )
        return ids

    def decoder_ids(self, decoder: str | Sequence[int]) -> list[int]:
        """The decoder sequence: the start token, then the decoder prompt's ids."""
        if isinstance(decoder, str):
            return [self.start_id, *self.tokenizer(decoder, add_special_tokens=False)["input_ids"]]
        return [self.start_id, *(int(t) for t in decoder)]

    def stream(
        self,
        prompt: Seq2SeqPrompt | Prompt,
        params: GenerationParams | None = None,
        *,
        salt: Salt = None,
        output_logits: bool = False,
        **options,
    ) -> Iterator[Piece]:
        """`CachedGenerator.stream` for a (source, decoder prompt) request: the source's record is
        looked up (or its encoder run) first, then the decoder runs under the source's scope."""
        if not isinstance(prompt, Seq2SeqPrompt):
            prompt = Seq2SeqPrompt(prompt)
        began = time.perf_counter()
        source_ids = self.encode_source(prompt.source)
        scope = self.open_source(source_ids, salt)
        source_s = time.perf_counter() - began  # the decoder's clock starts after the encoder ran
        pieces = super().stream(
            self.decoder_ids(prompt.decoder), params, salt=scope, output_logits=output_logits, **options
        )
        try:
            for piece in pieces:
                if piece.result is not None:
                    piece.result.encoder_tokens = len(source_ids)
                    piece.result.encoder_cached_tokens = len(source_ids) if scope.source.cached else 0
                    piece.result.ttft_s += source_s
                    piece.result.total_s += source_s
                yield piece
        finally:
            pieces.close()

    def open_source(self, source_ids: list[int], salt: Salt) -> SourceScope:
        return open_source(self.runner, self.seq2seq, source_ids, salt)

    def _new_past(self, hit: Hit | None, salt: SourceScope) -> Seq2SeqPast:
        return new_past(hit, salt)

    def _commit_prompt(self, run: DecodeState) -> None:
        """Also keep the source's record, now that the first decoder forward computed its cross K/V."""
        super()._commit_prompt(run)
        keep_source(self.seq2seq, run.salt, run.past)


def open_source(
    runner: Seq2SeqRunner, cache: Seq2SeqCache | None, source_ids: list[int], salt: Salt
) -> SourceScope:
    """A request's scope, carrying its source: the cached record, or the encoder's output."""
    scope = cache.scope(source_ids, salt) if cache is not None else SourceScope()
    kv = cache.lookup(source_ids, scope) if cache is not None else None
    cached = kv is not None
    if kv is None:
        kv = SourceKV(runner.encode(source_ids), None)
        if cache is not None:
            cache.encoded(len(source_ids))
    return replace(scope, source=SourceUse(source_ids, kv, cached))


def new_past(hit: Hit | None, scope: SourceScope) -> Seq2SeqPast:
    """The live cache a request decodes into: its decoder hit (or nothing) over its source."""
    return hf_seq2seq.fresh_past(hit.to_hf_cache() if hit is not None else None, scope.source.kv)


def keep_source(cache: Seq2SeqCache | None, scope: SourceScope, past: Seq2SeqPast) -> None:
    """Store the source's record from a live cache a decoder forward ran on, unless it came from the cache."""
    use = scope.source
    computed = past.cache.cross_attention_cache.get_seq_length() > 0  # no decoder forward ran yet
    if cache is not None and computed and not (use.cached or use.stored):
        cache.store(use.ids, scope, SourceKV(use.kv.encoder_hidden, past.cache.cross_attention_cache))
        use.stored = True
