"""Next-token choice: logits processing, then greedy or sampling with temperature, min-p, top-k and top-p.

`distribution` is the single definition of the filtered sampling distribution, so every caller
(plain generation, speculative target and drafter) applies temperature/min-p/top-k/top-p identically.
`LogitsProcessor` rewrites a sequence's logits before that (penalties, biases, min_tokens, a
constraint); `token_logprobs` reports the model's own distribution for the OpenAI `logprobs` fields.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvblocks.generate.params import GenerationParams

# Below this temperature sampling is greedy (as in vLLM): dividing float32 logits by a tinier
# temperature overflows to inf and the distribution becomes NaN.
GREEDY_BELOW = 1e-5

# Rows of a log-softmax computed at once for `token_logprobs`: bounds the float copy of a long prompt.
LOGPROB_ROWS = 256


class ParamError(ValueError):
    """An option that is out of range or cannot be honoured; `param` names its `GenerationParams` field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True, frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ParamError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ParamError("top_k", f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _full_precision(logits: torch.Tensor) -> torch.Tensor:
    """float16/bfloat16 logits in float32 (softmax and penalties lose too much below it); others as they are."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities over the vocabulary (last dim) after temperature, min-p, top-k and top-p.

    Greedy is the point mass on the argmax (ties to the lowest id, like `torch.argmax`). The order
    is vLLM's: min-p compares probabilities after temperature, before top-k/top-p renormalise.
    """
    logits = _full_precision(logits)
    if params.greedy:
        probs = torch.zeros_like(logits)
        probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return probs
    scores = logits / params.temperature
    if params.min_p > 0.0:
        probs = scores.softmax(dim=-1)
        floor = params.min_p * probs.amax(dim=-1, keepdim=True)
        scores = scores.masked_fill(probs < floor, float("-inf"))
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        # drop a token once the mass strictly before it already reaches top_p (keeps at least one)
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
        drop_sorted[..., 0] = False  # a top_p that rounds to 0 in float32 must still keep the top token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Next token id from a 1-D row of logits."""
    if params.greedy:
        return int(logits.argmax())
    probs = distribution(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def seeded_rng(device: torch.device, seed: int | None) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


class LogitsProcessor:
    """One sequence's logits rewriting before `choose`, and the generated-token state it needs.

    Applied in vLLM's order: logit_bias is added; EOS is -inf until `min_tokens` tokens exist;
    repetition_penalty divides positive / multiplies negative logits of every token seen in the
    prompt or the output (as HF and vLLM); frequency_penalty * count and presence_penalty are
    subtracted for generated tokens only (as OpenAI and vLLM); the constraint masks last.
    """

    def __init__(
        self,
        params: GenerationParams,
        prompt_ids: Sequence[int],
        eos_ids: Collection[int],
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.params = params
        self.generated = 0
        self.counts = torch.zeros(vocab_size, dtype=torch.long, device=device)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.seen[torch.tensor(list(prompt_ids), dtype=torch.long, device=device)] = True
        self.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
        self.bias = list(params.logit_bias.values())
        self.eos_ids = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
        self.constraint = params.constraint.start() if params.constraint is not None else None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed copy of a 1-D logits row (the row itself is left as the model gave it)."""
        p = self.params
        scores = _full_precision(logits).clone()
        if self.bias_ids.numel():
            scores.index_add_(0, self.bias_ids, scores.new_tensor(self.bias))
        if self.generated < p.min_tokens:
            scores[self.eos_ids] = float("-inf")
        if p.repetition_penalty != 1.0:
            r = p.repetition_penalty
            scores = torch.where(self.seen, torch.where(scores > 0, scores / r, scores * r), scores)
        if p.frequency_penalty:
            scores -= p.frequency_penalty * self.counts.to(scores.dtype)
        if p.presence_penalty:
            scores -= p.presence_penalty * (self.counts > 0).to(scores.dtype)
        if self.constraint is not None:
            self.constraint.mask(scores)
        if torch.isneginf(scores).all():
            raise ValueError("no token may come next: the constraint and min_tokens exclude every token")
        return scores

    def accept(self, token: int) -> None:
        """The token chosen from the last processed row."""
        self.generated += 1
        self.counts[token] += 1
        self.seen[token] = True
        if self.constraint is not None:
            self.constraint.advance(token)

    @property
    def done(self) -> bool:
        """Whether the constraint is complete: the sequence ends with the token just accepted."""
        return self.constraint is not None and self.constraint.done()


@dataclass(slots=True)
class TokenLogprob:
    """A token's log-probability and the `top` (id, log-probability) alternatives, most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprob]:
    """Row i of `logits` ([n, vocab], raw model output) scores `tokens[i]`.

    Log-probabilities of the model's own distribution: log_softmax of the raw logits, before
    penalties, biases, temperature and truncation (what vLLM reports by default). Computed
    `LOGPROB_ROWS` rows at a time so a long prompt never holds a second full-size copy.
    """
    assert logits.shape[0] == len(tokens)
    targets = torch.tensor(list(tokens), dtype=torch.long, device=logits.device)
    k = min(k, logits.shape[-1])
    out: list[TokenLogprob] = []
    for start in range(0, len(tokens), LOGPROB_ROWS):
        rows = torch.log_softmax(_full_precision(logits[start : start + LOGPROB_ROWS]), dim=-1)
        chosen = rows.gather(-1, targets[start : start + LOGPROB_ROWS, None])[:, 0].tolist()
        values, ids = rows.topk(k, dim=-1)
        for token, logprob, top_ids, top_values in zip(
            tokens[start : start + LOGPROB_ROWS], chosen, ids.tolist(), values.tolist(), strict=True
        ):
            out.append(TokenLogprob(int(token), logprob, list(zip(top_ids, top_values, strict=True))))
    return out
