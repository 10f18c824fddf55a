"""Speculative sampling end to end: the output distribution is exactly the target's.

A stand-in model with a vocabulary of 8 makes the target's joint distribution over the first
three generated tokens (temperature, top-k and top-p applied by `kvblocks.generate.sampling.distribution`)
cheap to enumerate. 30k requests with different seeds go through the real `SpeculativeGenerator`
loop, and Pearson's chi-square test must accept kvblocks and reject a control that forgets the
rejection correction (it samples p instead of norm(max(0, p - q)) after a rejection) already at
2k samples, which shows the test has the power to see such a bias. Point-mass drafters are also
checked seed for seed against target-only sampling, on the stand-in and on a real tiny llama.
"""

from __future__ import annotations

import importlib
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from conftest import IdTokenizer, tiny_llama
from transformers import LlamaConfig

from kvblocks import CachedGenerator, KVCacheTrie
from kvblocks.adapters import hf
from kvblocks.generate.generator import ModelRunner
from kvblocks.generate.sampling import SamplingParams, distribution
from kvblocks.specdec import ModelDrafter, PromptLookupDrafter, SpeculativeGenerator, TrieDrafter, verify

# the package re-exports the function `verify` under its module's name: fetch the modules themselves
verify_module = importlib.import_module("kvblocks.specdec.rejection")
generator_module = importlib.import_module("kvblocks.specdec.generator")

VOCAB = 8
ROWS = 1009
NEW_TOKENS = 3
SAMPLES = 30_000
CONTROL_SAMPLES = 2_000
SAMPLING = dict(temperature=0.9, top_p=0.95, top_k=6)
PARAMS = SamplingParams(**SAMPLING)
PROMPT = [1, 2, 3, 1, 2, 3, 1]  # repeats, so prompt lookup drafts from the first round on
TOK = IdTokenizer()


class HashLM(torch.nn.Module):
    """A stand-in causal LM: the logits after each position are a fixed random row picked by a
    rolling hash of the whole context up to it.

    It caches, per position, the token id as the "key" and the context's hash as the "value" in the
    real transformers cache, so the cache *is* the context: a cache that kept a rejected draft or
    lost a token would change every later distribution. Lengths, `hf.crop` and the trie behave as
    with a real model, at a fraction of a real forward's cost.
    """

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=4,
            intermediate_size=4,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=1,
            max_position_embeddings=64,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        self.table = torch.nn.Parameter(table, requires_grad=False)

    def forward(self, input_ids, past_key_values, use_cache=True, logits_to_keep=0):
        layer = past_key_values.layers[0]
        h = int(layer.values[0, 0, -1, 0]) if layer.is_initialized and layer.values.shape[-2] else 0
        hashes = []
        for token in input_ids[0].tolist():
            h = (h * 1_000_003 + token + 1) % 2_147_483_647
            hashes.append(h)
        keys = input_ids.to(self.table.dtype)[:, None, :, None]
        values = torch.tensor(hashes, dtype=self.table.dtype).view(1, 1, -1, 1)
        past_key_values.update(keys, values, 0)
        rows = torch.tensor(hashes[-logits_to_keep:] if logits_to_keep else hashes) % ROWS
        return SimpleNamespace(logits=self.table[rows][None], past_key_values=past_key_values)


def _table(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.fixture(scope="module")
def target():
    return HashLM(_table(0))


@pytest.fixture(scope="module")
def draft_model():
    """A different model whose q overlaps p: drafts are often but not always accepted."""
    return HashLM(_table(0) + 1.2 * _table(1))


@pytest.fixture(scope="module")
def joint(target) -> dict[tuple[int, ...], float]:
    """The target's exact probability of every sequence of NEW_TOKENS tokens after PROMPT."""
    runner = ModelRunner(target)

    def step(context: list[int]) -> torch.Tensor:
        return distribution(runner.forward(context, hf.empty_cache(target.config))[-1], PARAMS)

    out = {(): 1.0}
    for _ in range(NEW_TOKENS):
        longer = {}
        for seq, prob in out.items():
            p = step([*PROMPT, *seq])
            for x in torch.nonzero(p).flatten().tolist():
                longer[(*seq, x)] = prob * float(p[x])
        out = longer
    assert sum(out.values()) == pytest.approx(1.0, abs=1e-12)
    return out


def chi2_sf(stat: float, dof: int) -> float:
    """P(chi-square with `dof` degrees of freedom >= stat): the regularised upper gamma Q(dof/2, stat/2)."""
    half = torch.tensor([dof / 2, stat / 2], dtype=torch.float64)
    return float(torch.special.gammaincc(half[0], half[1]))


def chi_square_p_value(counts: Counter, probs: dict, n: int) -> float:
    """Pearson's goodness-of-fit p-value; cells expected fewer than 5 times are pooled together."""
    cells = sorted(probs, key=probs.get)
    pooled, i = 0.0, 0
    while i < len(cells) and (probs[cells[i]] * n < 5 or 0 < pooled * n < 5):
        pooled += probs[cells[i]]
        i += 1
    bins = [(counts[c], probs[c] * n) for c in cells[i:]]
    if i:
        bins.append((sum(counts[c] for c in cells[:i]), pooled * n))
    return chi2_sf(sum((o - e) ** 2 / e for o, e in bins), len(bins) - 1)


def test_chi_square_p_value_matches_known_quantiles():
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, abs=1e-6)  # scipy.stats.chi2.sf
    assert chi2_sf(18.307038, 10) == pytest.approx(0.05, abs=1e-6)
    assert chi2_sf(0.0, 3) == 1.0
    probs = {(0,): 0.5, (1,): 0.5}
    assert chi_square_p_value(Counter({(0,): 50, (1,): 50}), probs, 100) == pytest.approx(1.0)
    assert chi_square_p_value(Counter({(0,): 70, (1,): 30}), probs, 100) < 1e-4


def sample(sg: SpeculativeGenerator, n: int) -> tuple[Counter, int, int]:
    """n requests with seeds 0..n-1: counts of the generated sequences, drafts accepted, rejected rounds."""
    counts, accepted, rejected = Counter(), 0, 0
    for seed in range(n):
        r = sg.generate(PROMPT, max_new_tokens=NEW_TOKENS, seed=seed, ignore_eos=True, **SAMPLING)
        counts[tuple(r.token_ids)] += 1
        accepted += r.spec.accepted
        rejected += r.spec.rejected_rounds
    return counts, accepted, rejected


def _check_exact(counts: Counter, joint: dict) -> None:
    assert set(counts) <= set(joint), "a sequence the target cannot produce was sampled"
    p_value = chi_square_p_value(counts, joint, SAMPLES)
    assert p_value > 1e-3, f"chi-square p-value {p_value:.3g}: not the target's distribution"


def _point_mass_as_one_hot(p, drafts, q, greedy, rng, tail_q=None):
    """Treats a point-mass draft as q = one-hot: keep it with probability p(x)."""
    if q is None and drafts:
        q = torch.nn.functional.one_hot(torch.tensor(drafts), p.shape[-1]).to(p.dtype)
    return verify(p, drafts, q, greedy, rng, tail_q=tail_q)


@pytest.fixture
def no_rejection_correction(monkeypatch):
    """The control: after a rejection it samples the target's p instead of the residual.

    For a point-mass drafter that is the biased n-gram rule of the repository kvblocks grew from
    (keep the draft with probability p(x), else sample p), which gives draft x p(x)(2 - p(x)).
    """
    monkeypatch.setattr(verify_module, "residual", lambda p, q: p)
    monkeypatch.setattr(generator_module, "verify", _point_mass_as_one_hot)


def test_model_drafter_sampling_has_the_target_distribution(target, draft_model, joint):
    sg = SpeculativeGenerator(target, TOK, None, ModelDrafter(draft_model), gamma=2)
    counts, accepted, rejected = sample(sg, SAMPLES)
    assert accepted > SAMPLES and rejected > SAMPLES // 4, "both acceptance and rejection paths run"
    _check_exact(counts, joint)


def test_model_drafter_control_without_rejection_correction_fails_the_test(
    target, draft_model, joint, no_rejection_correction
):
    """The bias shows with a fifteenth of the samples."""
    sg = SpeculativeGenerator(target, TOK, None, ModelDrafter(draft_model), gamma=2)
    counts, _, _ = sample(sg, CONTROL_SAMPLES)
    assert chi_square_p_value(counts, joint, CONTROL_SAMPLES) < 1e-9


def test_prompt_lookup_sampling_has_the_target_distribution_with_prefix_hits(target, joint):
    cache = KVCacheTrie.for_model(target, capacity_tokens=4096)
    sg = SpeculativeGenerator(target, TOK, cache, PromptLookupDrafter(), gamma=3)
    counts, accepted, rejected = sample(sg, SAMPLES)
    assert accepted > SAMPLES // 10 and rejected > SAMPLES // 2
    assert cache.stats()["hit_tokens"] == (SAMPLES - 1) * (len(PROMPT) - 1)
    assert cache.stats()["locked_tokens"] == 0
    _check_exact(counts, joint)


def test_prompt_lookup_control_without_rejection_correction_fails_the_test(
    target, joint, no_rejection_correction
):
    """The bias shows with a fifteenth of the samples."""
    sg = SpeculativeGenerator(target, TOK, None, PromptLookupDrafter(), gamma=3)
    counts, _, _ = sample(sg, CONTROL_SAMPLES)
    assert chi_square_p_value(counts, joint, CONTROL_SAMPLES) < 1e-9


@pytest.fixture(scope="module")
def tiny_target():
    return tiny_llama(torch.float64, seed=0, vocab_size=16)


@pytest.mark.parametrize("drafter", ["prompt-lookup", "trie"])
@pytest.mark.parametrize(("which", "requests", "new_tokens"), [("hash", 400, 3), ("tiny-llama", 20, 12)])
def test_point_mass_drafters_reproduce_target_only_sampling_seed_for_seed(
    target, tiny_target, drafter, which, requests, new_tokens
):
    """With a point-mass drafter every emitted token is the target's own sample, drawn in order
    from the same generator, so a seeded request gives exactly what target-only sampling gives."""
    model = target if which == "hash" else tiny_target
    prompt = [*PROMPT, *PROMPT]
    cache = KVCacheTrie.for_model(model, capacity_tokens=8192)
    plain = CachedGenerator(model, TOK, None)
    draft = PromptLookupDrafter() if drafter == "prompt-lookup" else TrieDrafter(cache)
    sg = SpeculativeGenerator(model, TOK, cache, draft, gamma=3)
    accepted = 0
    for seed in range(requests):
        args = dict(max_new_tokens=new_tokens, seed=seed, ignore_eos=True, **SAMPLING)
        r = sg.generate(prompt, **args)
        assert r.token_ids == plain.generate(prompt, **args).token_ids, f"seed {seed}"
        accepted += r.spec.accepted
    assert accepted > 0
