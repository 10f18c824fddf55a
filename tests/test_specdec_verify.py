"""One verification step of speculative decoding, checked exactly (no sampling noise).

The first token a step emits is x ~ q kept with probability min(1, p(x)/q(x)), else a sample of
residual(p, q). Its distribution is computed here in closed form from the same functions `verify`
uses and must equal p to rounding; the decision logic of `verify` itself is checked by scripting
its uniform draws and samples.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from kvblocks.specdec import acceptance_probability, residual, verify

# the package re-exports the function `verify` under the module's name, so fetch the module itself
verify_module = importlib.import_module("kvblocks.specdec.rejection")

VOCAB = 5


def _random_distribution(gen: torch.Generator, zeros: list[int] = ()) -> torch.Tensor:
    weights = torch.rand(VOCAB, generator=gen, dtype=torch.float64) ** 2
    weights[list(zeros)] = 0.0
    return weights / weights.sum()


def _one_hot(token: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token), VOCAB).to(torch.float64)


def _pairs() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(label, p, q): generic pairs, disjoint zeros, shared support, p == q, point-mass q."""
    out = []
    zeros = {  # (zeros of p, zeros of q)
        "random": ([], []),
        "q-zero-where-p-positive": ([], [0, 3]),
        "p-zero-where-q-positive": ([1, 4], []),
        "both-with-zeros": ([0, 1], [1, 2, 4]),
    }
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        for label, (p_zeros, q_zeros) in zeros.items():
            out.append(
                (f"{label}-{seed}", _random_distribution(gen, p_zeros), _random_distribution(gen, q_zeros))
            )
        p = _random_distribution(gen)
        out.append((f"p-equals-q-{seed}", p, p.clone()))
        out.append((f"point-mass-q-{seed}", _random_distribution(gen), _one_hot(seed % VOCAB)))
    gen = torch.Generator().manual_seed(99)
    out.append(("point-mass-p", _one_hot(2), _random_distribution(gen)))
    out.append(("point-mass-p-outside-q", _one_hot(1), _random_distribution(gen, [1])))
    out.append(("point-mass-both-equal", _one_hot(3), _one_hot(3)))
    return out


PAIRS = _pairs()


def _emitted_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(first emitted token = x) = q(x) a(x) + (1 - sum_y q(y) a(y)) residual(p, q)(x)."""
    accept = torch.tensor([acceptance_probability(p, q, x) for x in range(VOCAB)], dtype=torch.float64)
    kept = q * accept
    return kept + (1.0 - kept.sum()) * residual(p, q)


@pytest.mark.parametrize(("label", "p", "q"), PAIRS, ids=[label for label, _, _ in PAIRS])
def test_first_emitted_token_is_distributed_exactly_as_target(label, p, q):
    assert torch.allclose(_emitted_distribution(p, q), p, rtol=0.0, atol=1e-12)


@pytest.mark.parametrize(("label", "p", "q"), PAIRS, ids=[label for label, _, _ in PAIRS])
def test_residual_is_a_distribution_outside_the_drafters_surplus(label, p, q):
    r = residual(p, q)
    assert float(r.sum()) == pytest.approx(1.0, abs=1e-12)
    assert bool((r >= 0).all())
    if not torch.equal(p, q):
        assert bool((r[p <= q] == 0).all())


def test_acceptance_probability_is_min_one_ratio():
    p = torch.tensor([0.1, 0.4, 0.5, 0.0, 0.0], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.5, 0.1, 0.0], dtype=torch.float64)
    assert acceptance_probability(p, q, 0) == pytest.approx(0.5)
    assert acceptance_probability(p, q, 1) == 1.0
    assert acceptance_probability(p, q, 2) == 1.0
    assert acceptance_probability(p, q, 3) == 0.0


def test_point_mass_drafter_rule_equals_the_general_rule():
    """Accept-iff-the-target-sample-matches is the general rule with q = one-hot(draft):
    keep x with probability p(x), otherwise sample p without x, renormalised."""
    gen = torch.Generator().manual_seed(7)
    p = _random_distribution(gen)
    for x in range(VOCAB):
        assert acceptance_probability(p, _one_hot(x), x) == pytest.approx(float(p[x]), abs=1e-15)
        without_x = p.clone()
        without_x[x] = 0.0
        assert torch.allclose(residual(p, _one_hot(x)), without_x / without_x.sum(), atol=1e-15)


class _Script:
    """Replaces verify's randomness: uniforms and samples come from lists; samples record their input."""

    def __init__(self, uniforms=(), samples=()):
        self.uniforms, self.samples, self.sampled_from = list(uniforms), list(samples), []

    def uniform(self, rng, like):
        return self.uniforms.pop(0)

    def sample(self, probs, rng):
        self.sampled_from.append(probs.clone())
        return self.samples.pop(0)


@pytest.fixture
def script(monkeypatch):
    def install(**kwargs):
        s = _Script(**kwargs)
        monkeypatch.setattr(verify_module, "_uniform", s.uniform)
        monkeypatch.setattr(verify_module, "_sample", s.sample)
        return s

    return install


def _rows(seed: int, n: int, zeros: list[int] = ()) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([_random_distribution(gen, zeros) for _ in range(n)])


def test_model_draft_is_rejected_iff_uniform_reaches_acceptance_and_resamples_residual(script):
    p, q = _rows(1, 3), _rows(2, 2)
    drafts = [int(q[0].argmax()), int(q[1].argmax())]
    a0 = acceptance_probability(p[0], q[0], drafts[0])
    a1 = acceptance_probability(p[1], q[1], drafts[1])
    assert a0 < 1.0 and a1 < 1.0, "seeds chosen so both drafts can be rejected"

    s = script(uniforms=[a0 - 1e-9, a1], samples=[4])
    assert verify(p, drafts, q, False, None) == (1, 4)
    assert len(s.sampled_from) == 1 and torch.allclose(s.sampled_from[0], residual(p[1], q[1]))

    s = script(uniforms=[a0], samples=[3])
    assert verify(p, drafts, q, False, None) == (0, 3)
    assert torch.allclose(s.sampled_from[0], residual(p[0], q[0]))


def test_all_accepted_drafts_get_a_bonus_token_from_the_last_target_row(script):
    p, q = _rows(3, 4), _rows(4, 3)
    drafts = [0, 1, 2]
    s = script(uniforms=[0.0, 0.0, 0.0], samples=[2])
    assert verify(p, drafts, q, False, None) == (3, 2)
    assert torch.equal(s.sampled_from[0], p[3])


def test_point_mass_draft_is_accepted_iff_target_sample_matches(script):
    p = _rows(5, 4)
    s = script(samples=[1, 2, 0])
    assert verify(p, [1, 2, 3], None, False, None) == (2, 0)
    assert [torch.equal(row, p[i]) for i, row in enumerate(s.sampled_from)] == [True, True, True]

    s = script(samples=[1, 2, 3, 4])
    assert verify(p, [1, 2, 3], None, False, None) == (3, 4)
    assert torch.equal(s.sampled_from[-1], p[3])


def test_greedy_is_token_matching_and_ignores_drafter_probabilities():
    p = _rows(6, 4)
    target = [int(row.argmax()) for row in p]
    q = _rows(7, 3)
    assert verify(p, target[:3], q, True, None) == (3, target[3])
    assert verify(p, target[:3], None, True, None) == (3, target[3])
    wrong = (target[1] + 1) % VOCAB
    # q puts all its mass on the wrong token and p gives it some: still rejected, no rng needed
    q_wrong = torch.stack([_one_hot(target[0]), _one_hot(wrong), _one_hot(0)])
    assert float(p[1, wrong]) > 0
    assert verify(p, [target[0], wrong, 0], q_wrong, True, None) == (1, target[1])


def test_greedy_on_one_hot_rows_equals_sampling_on_them():
    """One-hot target rows (greedy `distribution`) make sampling deterministic: same answer as greedy."""
    targets = [3, 0, 4]
    p = torch.stack([_one_hot(t) for t in targets])
    rng = torch.Generator().manual_seed(0)
    for drafts in ([3, 0], [3, 1], [2, 0], []):
        greedy = verify(p[: len(drafts) + 1], drafts, None, True, None)
        assert verify(p[: len(drafts) + 1], drafts, None, False, rng) == greedy
        q = torch.stack([_one_hot(d) for d in drafts]) if drafts else None
        assert verify(p[: len(drafts) + 1], drafts, q, False, rng) == greedy


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("gamma", [0, 1, 3])
def test_verify_returns_accepted_count_and_one_token(greedy, gamma):
    p, q = _rows(8, gamma + 1), _rows(9, gamma) if gamma else None
    rng = torch.Generator().manual_seed(gamma)
    for _ in range(50):
        drafts = torch.randint(0, VOCAB, (gamma,), generator=rng).tolist()
        n, token = verify(p, drafts, q, greedy, rng)
        assert isinstance(n, int) and isinstance(token, int)
        assert 0 <= n <= gamma and 0 <= token < VOCAB
        if n < gamma and (greedy or q is None):
            assert token != drafts[n], "a point-mass or greedy rejection emits a different token"


def test_verify_needs_one_target_row_per_draft_plus_bonus():
    with pytest.raises(AssertionError):
        verify(_rows(0, 2), [1, 2], None, True, None)


def test_draft_outside_target_support_is_always_rejected():
    p = _rows(10, 2, zeros=[2])
    q = _rows(11, 1)
    rng = torch.Generator().manual_seed(0)
    for _ in range(100):
        n, token = verify(p, [2], q, False, rng)
        assert n == 0 and token != 2
