"""Generation options: one object through `CachedGenerator`, the engine and the server.

`GenerationParams` holds everything that shapes which token comes next. Penalties, biases and
constraints rewrite a request's logits before sampling, through the same code with or without the
cache, so a cached request stays exact against the same options applied without it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvblocks.generate.sampling import ParamError as ParamError
from kvblocks.generate.sampling import SamplingParams


class Constraint(Protocol):
    """Per-request decoding constraint (a grammar): which tokens may come next."""

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits of every token the constraint forbids next to -inf, in place."""

    def advance(self, token: int) -> None:
        """The token that was chosen; raises ValueError if the constraint forbade it."""

    def done(self) -> bool:
        """Whether the constrained text is complete: generation must stop here."""


class ConstraintError(ValueError):
    """A constraint that cannot go on (its grammar hit a resource limit while decoding): the
    request's fault, not the engine's. It ends that request with a client error and no traceback."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the request field the constraint came from


class ConstraintFactory(Protocol):
    """Compiled once per request shape; `start()` gives a fresh state per generated sequence."""

    def start(self) -> Constraint: ...


# Dividing logits by a tinier penalty overflows them to inf (and sampling fails); above the
# maximum the schema's bound applies.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
# How a prompt with KV blocks (`kvblocks.Block`) is prefilled (`kvblocks.blocks`).
KV_MODES = ("exact", "blend", "concat")


@dataclass(slots=True)
class GenerationParams:
    """What one generated sequence is asked for.

    `logprobs`: None for none; k >= 0 for the chosen token's log-probability plus the k most
    likely alternatives at every generated position. `prompt_logprobs`: the same for every prompt
    position after the first (this needs logits at prompt positions, so the prompt is computed in
    full, without prefix reuse). Log-probabilities are those of the model's own distribution, before
    penalties, biases, temperature and truncation.

    `min_tokens` keeps EOS out (-inf) until that many tokens exist; `ignore_eos` lets EOS through
    without ending the sequence. A `constraint` ends the sequence (finish "stop") once it is done.

    `kv_mode` says what a prompt's `kvblocks.Block`s reuse: "exact" (only as a prefix, output as
    without blocks), "concat" (stored block KV at its new position) or "blend" (that, plus the
    `blend_recompute` share of each block's tokens recomputed, CacheBlend-style).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: Sequence[str] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    constraint: ConstraintFactory | None = None
    kv_mode: str = "exact"
    blend_recompute: float = 0.15

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ParamError("max_new_tokens", f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.sampling  # noqa: B018 -- validates temperature, top_p, top_k and min_p
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise ParamError(name, f"{name} must be in [-2, 2], got {value}")
        if not (MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise ParamError(
                "repetition_penalty",
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}], "
                f"got {self.repetition_penalty}",
            )
        if self.min_tokens < 0:
            raise ParamError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ParamError(name, f"{name} must be >= 0, got {value}")
        if self.kv_mode not in KV_MODES:
            raise ParamError("kv_mode", f"kv_mode must be one of {', '.join(KV_MODES)}, got {self.kv_mode!r}")
        if not (0.0 <= self.blend_recompute <= 1.0):
            raise ParamError(
                "blend_recompute", f"blend_recompute must be in [0, 1], got {self.blend_recompute}"
            )
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        self.logit_bias = _checked_bias(self.logit_bias)

    @property
    def sampling(self) -> SamplingParams:
        """The options `choose` and `distribution` need."""
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.min_p)

    @property
    def logit_processors(self) -> tuple[str, ...]:
        """Names of the options that rewrite logits before sampling; empty: logits go straight to it."""
        active = {
            "logit_bias": bool(self.logit_bias),
            "min_tokens": self.min_tokens > 0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "presence_penalty": self.presence_penalty != 0.0,
            "constraint": self.constraint is not None,
        }
        return tuple(name for name, on in active.items() if on)

    @property
    def processes_logits(self) -> bool:
        """Whether anything rewrites the logits before sampling (penalties, biases, constraints)."""
        return bool(self.logit_processors)


def _checked_bias(bias: Mapping[int, float] | None) -> dict[int, float]:
    """`{token id: bias}` with int ids and finite biases in [-100, 100] (OpenAI's range)."""
    checked: dict[int, float] = {}
    for token, value in (bias or {}).items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ParamError("logit_bias", f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
        if not (math.isfinite(value) and -100.0 <= value <= 100.0):
            raise ParamError(
                "logit_bias", f"logit_bias for token {token} must be in [-100, 100], got {value}"
            )
        checked[token] = float(value)
    return checked


def params_of(params: GenerationParams | None, fields: Mapping[str, Any]) -> GenerationParams:
    """`params`, or one built from `GenerationParams` fields given as keywords (the older call shape);
    an unknown keyword is a TypeError here."""
    if params is None:
        return GenerationParams(**fields)
    if not isinstance(params, GenerationParams):
        raise TypeError(f"params must be a GenerationParams, got {type(params).__name__}")
    if fields:
        raise TypeError(f"give either params or keyword options ({', '.join(sorted(fields))}), not both")
    return params
