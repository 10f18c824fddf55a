"""Next-token choice: greedy, or sampling with temperature, top-k and top-p.

`distribution` is the single definition of the filtered sampling distribution, so every caller
(plain generation, speculative target and drafter) applies temperature/top-k/top-p identically.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Below this temperature sampling is greedy (as in vLLM): dividing float32 logits by a tinier
# temperature overflows to inf and the distribution becomes NaN.
GREEDY_BELOW = 1e-5


@dataclass(slots=True, frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities over the vocabulary (last dim) after temperature, top-k and top-p.

    Greedy is the point mass on the argmax (ties to the lowest id, like `torch.argmax`).
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if params.greedy:
        probs = torch.zeros_like(logits)
        probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return probs
    scores = logits / params.temperature
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


def make_generator(device: torch.device, seed: int | None) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
