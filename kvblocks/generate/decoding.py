"""The per-token rule: what every decoding path does with the logits of a sequence's next position.

One request (`CachedGenerator.stream`), a packed batch (the engine) and a speculative round all
choose, append, score and finish tokens here, so what a client receives (the finish rules: EOS,
stop text, constraint, length and the context cap; the last piece; the `GenerationResult`) has
one home whichever path served it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kvblocks.generate.params import GenerationParams
from kvblocks.generate.sampling import LogitsProcessor, TokenLogprob, choose, token_logprobs
from kvblocks.generate.text import StopTextAssembler


@dataclass(slots=True)
class GenerationResult:
    token_ids: list[int]
    text: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    total_s: float
    finish_reason: str
    prompt_ids: list[int] = field(repr=False, default_factory=list)
    logits: list[torch.Tensor] | None = field(repr=False, default=None)
    spec: Any = None
    logprobs: list[TokenLogprob] | None = field(repr=False, default=None)
    prompt_logprobs: list[TokenLogprob | None] | None = field(repr=False, default=None)
    cache_bypass: str | None = None  # why the prefix cache was not matched ("prompt_logprobs")
    # recurrent and hybrid models: where the prefill stopped (each forward's end) and the positions
    # whose recurrent state was snapshotted for the cache
    prefill_splits: list[int] = field(repr=False, default_factory=list)
    snapshot_positions: list[int] = field(repr=False, default_factory=list)
    # a prompt prefilled from KV blocks (`kvblocks.blocks.BlockReport`): what was reused and where
    blocks: Any = None
    # seq2seq models: source tokens the encoder saw, and how many of them were served from the cache
    # (all or none: an encoder output depends on the whole source)
    encoder_tokens: int = 0
    encoder_cached_tokens: int = 0


@dataclass(slots=True)
class Piece:
    """One step of a stream: new text and tokens; the last piece also carries the result."""

    text: str
    token_ids: list[int]
    result: GenerationResult | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of `token_ids` when asked for


def context_room(max_context: int | None, length: int) -> float:
    """Positions a sequence of `length` tokens may still grow by in the model's context window
    (infinite when the model states none): the one home of the context cap."""
    return math.inf if max_context is None else max_context - length


@dataclass(slots=True, eq=False)
class Decoding:
    """One sequence's output state: the tokens chosen so far, their text and log-probabilities, and
    why it finished (`finish`, None while it runs)."""

    prompt_ids: list[int]
    params: GenerationParams
    max_new_tokens: int  # the request's budget, capped by the context
    text: StopTextAssembler
    rng: torch.Generator | None
    processor: LogitsProcessor | None
    eos_ids: frozenset[int]
    started: float  # time origin of ttft_s and total_s
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    ttft_s: float = 0.0
    finish: str | None = None

    def __post_init__(self) -> None:
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def ends(self) -> frozenset[int]:
        """The tokens that finish this sequence when chosen (a drafter drafts nothing after one)."""
        return frozenset() if self.params.ignore_eos else self.eos_ids

    @property
    def left(self) -> int:
        """Tokens this sequence may still emit."""
        return self.max_new_tokens - len(self.generated)

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from the raw logits of its position: processed, then sampled or argmax."""
        if self.processor is None:
            return choose(logits, self.params.sampling, self.rng)
        token = choose(self.processor(logits), self.params.sampling, self.rng)
        self.processor.accept(token)
        return token

    def push(self, token: int, logits: torch.Tensor | None, now: float) -> Piece:
        """Append `token` (chosen from the raw `logits` of its position) and apply the finish rules;
        the piece to emit (`conclude` it when `finish` is set)."""
        assert self.finish is None, "a finished sequence takes no more tokens"
        if not self.generated:
            self.ttft_s = now - self.started
        self.generated.append(token)
        logprobs = None
        if self.logprobs is not None:
            assert logits is not None and self.params.logprobs is not None, "logprobs come with their logits"
            logprobs = token_logprobs(logits[None], [token], self.params.logprobs)
            self.logprobs.extend(logprobs)
        pending = ""
        if token in self.eos_ids and not self.params.ignore_eos:
            self.finish = "stop"
        else:
            pending = self.text.push(token, may_stop=len(self.generated) > self.params.min_tokens)  # as vLLM
            if self.text.stopped or (self.processor is not None and self.processor.done):
                self.finish = "stop"
            elif len(self.generated) >= self.max_new_tokens:
                self.finish = "length"
        return Piece(pending, [token], logprobs=logprobs)

    def conclude(self, piece: Piece, now: float, cached_tokens: int, **extras: Any) -> Piece:
        """The last piece: `piece` with the held-back text and the `GenerationResult` (`extras` are
        the path's own result fields: spec, logits, prompt log-probabilities, snapshots)."""
        assert self.finish is not None
        result = GenerationResult(
            token_ids=self.generated,
            text=self.text.text,
            prompt_tokens=len(self.prompt_ids),
            cached_tokens=cached_tokens,
            ttft_s=self.ttft_s,
            total_s=now - self.started,
            finish_reason=self.finish,
            prompt_ids=self.prompt_ids,
            logprobs=self.logprobs,
            **extras,
        )
        return Piece(piece.text + self.text.flush(), piece.token_ids, result, logprobs=piece.logprobs)
