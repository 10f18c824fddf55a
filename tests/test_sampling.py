"""Next-token choice: logits processors and min-p against hand-written references, log-probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from kvblocks.generate.params import GenerationParams
from kvblocks.generate.sampling import (
    LOGPROB_ROWS,
    LogitsProcessor,
    SamplingParams,
    distribution,
    token_logprobs,
)

VOCAB = 12
EOS = (10, 11)
PROMPT = [1, 2, 2, 7]
GENERATED = [3, 3, 5, 7]


def fixed_row() -> torch.Tensor:
    """Positive, negative and zero logits, so each branch of the repetition penalty is exercised."""
    return torch.tensor(
        [2.5, -1.25, 0.75, 3.0, -0.5, 1.5, 0.0, -2.0, 0.25, 1.0, 4.0, -3.5], dtype=torch.float64
    )


def reference(
    row: list[float], prompt: list[int], generated: list[int], eos, p: GenerationParams
) -> list[float]:
    """The processors written out one token at a time, in vLLM's order."""
    out = list(row)
    for token, bias in p.logit_bias.items():
        out[token] += bias
    if len(generated) < p.min_tokens:
        for token in eos:
            out[token] = -math.inf
    seen = set(prompt) | set(generated)
    for token in range(len(out)):
        if token in seen and p.repetition_penalty != 1.0:
            r = p.repetition_penalty
            out[token] = out[token] / r if out[token] > 0 else out[token] * r
        count = generated.count(token)
        out[token] -= p.frequency_penalty * count
        if count:
            out[token] -= p.presence_penalty
    return out


def processed(p: GenerationParams, generated: list[int] = GENERATED, eos=EOS) -> torch.Tensor:
    processor = LogitsProcessor(p, PROMPT, eos, VOCAB, torch.device("cpu"))
    for token in generated:
        processor.accept(token)
    return processor(fixed_row())


@pytest.mark.parametrize(
    "options",
    [
        dict(presence_penalty=0.75),
        dict(frequency_penalty=0.5),
        dict(frequency_penalty=-0.25, presence_penalty=-1.0),
        dict(repetition_penalty=1.3),
        dict(repetition_penalty=0.8),
        dict(logit_bias={0: -100.0, 4: 5.5, 11: 1.0}),
        dict(min_tokens=5),
        dict(
            presence_penalty=0.5,
            frequency_penalty=0.25,
            repetition_penalty=1.2,
            logit_bias={6: 2.0, 3: -0.5},
            min_tokens=9,
        ),
    ],
)
def test_processors_match_the_token_by_token_reference(options):
    p = GenerationParams(**options)
    want = torch.tensor(reference(fixed_row().tolist(), PROMPT, GENERATED, EOS, p), dtype=torch.float64)
    torch.testing.assert_close(processed(p), want, rtol=0, atol=1e-12)


def test_presence_and_frequency_penalties_ignore_prompt_tokens():
    row = processed(GenerationParams(presence_penalty=1.0, frequency_penalty=1.0), generated=[])
    assert torch.equal(row, fixed_row())


def test_repetition_penalty_counts_prompt_tokens():
    row = processed(GenerationParams(repetition_penalty=2.0), generated=[])
    raw = fixed_row()
    assert row[2] == raw[2] / 2 and row[1] == raw[1] * 2 and row[7] == raw[7] * 2  # prompt ids 1, 2, 7
    assert row[3] == raw[3] and row[0] == raw[0]


def test_min_tokens_masks_eos_until_enough_tokens_were_generated():
    p = GenerationParams(min_tokens=2)
    assert torch.isneginf(processed(p, generated=[3])[list(EOS)]).all()
    assert torch.equal(processed(p, generated=[3, 4]), fixed_row())
    assert torch.equal(processed(p, generated=[], eos=()), fixed_row())  # ignore_eos: nothing to mask


def test_processor_leaves_the_models_row_untouched():
    row = fixed_row()
    processor = LogitsProcessor(GenerationParams(logit_bias={3: 9.0}), PROMPT, EOS, VOCAB, row.device)
    processor(row)
    assert torch.equal(row, fixed_row())


class OnlyTokens:
    """A constraint that allows one fixed token sequence, then is done."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.advanced: list[int] = []

    def start(self) -> OnlyTokens:
        return OnlyTokens(self.tokens)

    def mask(self, logits: torch.Tensor) -> None:
        allowed = logits.new_full(logits.shape, float("-inf"))
        allowed[self.tokens[len(self.advanced)]] = 0.0
        logits += allowed

    def advance(self, token: int) -> None:
        if token != self.tokens[len(self.advanced)]:
            raise ValueError(f"token {token} is not allowed here")
        self.advanced.append(token)

    def done(self) -> bool:
        return len(self.advanced) == len(self.tokens)


def test_constraint_masks_last_and_advances_on_accept():
    p = GenerationParams(logit_bias={4: 50.0}, constraint=OnlyTokens([6, 8]))
    processor = LogitsProcessor(p, PROMPT, EOS, VOCAB, torch.device("cpu"))
    row = processor(fixed_row())
    assert int(row.argmax()) == 6 and torch.isneginf(row).sum() == VOCAB - 1
    processor.accept(6)
    assert not processor.done
    assert int(processor(fixed_row()).argmax()) == 8
    processor.accept(8)
    assert processor.done


def test_a_row_with_no_allowed_token_is_an_error():
    p = GenerationParams(min_tokens=1, constraint=OnlyTokens([EOS[0]]))
    processor = LogitsProcessor(p, PROMPT, EOS, VOCAB, torch.device("cpu"))
    with pytest.raises(ValueError, match="no token may come next"):
        processor(fixed_row())


# ---- min-p -----------------------------------------------------------------------------------


@pytest.mark.parametrize("min_p, temperature", [(0.1, 1.0), (0.3, 0.7), (0.05, 2.0), (1.0, 1.0)])
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(min_p, temperature):
    row = fixed_row()
    probs = [math.exp(x / temperature) for x in row.tolist()]
    total = sum(probs)
    probs = [q / total for q in probs]
    kept = [q if q >= min_p * max(probs) else 0.0 for q in probs]
    want = torch.tensor([q / sum(kept) for q in kept], dtype=torch.float64)
    got = distribution(row, SamplingParams(temperature=temperature, min_p=min_p))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_min_p_zero_and_greedy_leave_the_distribution_unchanged():
    row = fixed_row()
    torch.testing.assert_close(distribution(row, SamplingParams(1.0, min_p=0.0)), row.softmax(-1))
    greedy = distribution(row, SamplingParams(0.0, min_p=0.9))
    assert greedy[int(row.argmax())] == 1.0 and greedy.sum() == 1.0


def test_min_p_applies_before_top_p_renormalises():
    # vLLM's order: min-p on the tempered distribution, then top-p over what is left.
    row = fixed_row()
    both = distribution(row, SamplingParams(1.0, top_p=0.6, min_p=0.2))
    min_p_only = distribution(row, SamplingParams(1.0, min_p=0.2))
    top_p_of_that = distribution(min_p_only.log(), SamplingParams(1.0, top_p=0.6))
    torch.testing.assert_close(both, top_p_of_that, rtol=0, atol=1e-12)


@pytest.mark.parametrize("min_p", [-0.1, 1.5, math.nan])
def test_min_p_outside_zero_one_is_a_value_error(min_p):
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(1.0, min_p=min_p)


# ---- log-probabilities -----------------------------------------------------------------------


def test_token_logprobs_are_the_raw_log_softmax_with_sorted_top_k():
    torch.manual_seed(0)
    logits = torch.randn(5, VOCAB, dtype=torch.float64)
    tokens = [0, 3, 3, 11, 7]
    got = token_logprobs(logits, tokens, k=4)
    want = logits.log_softmax(-1)
    for i, entry in enumerate(got):
        assert entry.token == tokens[i]
        assert entry.logprob == pytest.approx(want[i, tokens[i]].item(), abs=1e-12)
        assert [t for t, _ in entry.top] == want[i].argsort(descending=True)[:4].tolist()
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)
        assert values[0] == pytest.approx(want[i].max().item(), abs=1e-12)


def test_token_logprobs_with_k_zero_has_no_alternatives_and_k_is_capped_at_the_vocabulary():
    logits = torch.randn(2, VOCAB)
    assert all(entry.top == [] for entry in token_logprobs(logits, [1, 2], k=0))
    assert all(len(entry.top) == VOCAB for entry in token_logprobs(logits, [1, 2], k=VOCAB + 5))


def test_token_logprobs_over_many_rows_equal_one_log_softmax():
    n = 2 * LOGPROB_ROWS + 3
    logits = torch.randn(n, VOCAB, dtype=torch.float64)
    tokens = torch.randint(0, VOCAB, (n,)).tolist()
    got = [entry.logprob for entry in token_logprobs(logits, tokens, k=1)]
    want = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    assert got == pytest.approx(want, abs=1e-12)


def test_half_precision_logits_are_scored_in_float32():
    logits = torch.randn(1, VOCAB).to(torch.bfloat16)
    (entry,) = token_logprobs(logits, [5], k=1)
    assert entry.logprob == pytest.approx(logits.float().log_softmax(-1)[0, 5].item(), abs=1e-6)
