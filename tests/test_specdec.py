"""Speculative decoding (`kvblocks.specdec`) in greedy mode: exactly the target's own output.

Every test compares against target-only greedy decoding (`CachedGenerator(model, tok, None)`)
token for token, and an `on_round` observer checks the cache invariants after every round:
the target cache holds exactly len(committed) - 1 tokens, nothing enters a trie before the
request ends, then only committed tokens do, and every lock is released. Models are float64 so
that the multi-token verify forward cannot flip a near-tie argmax.
"""

from __future__ import annotations

import pytest
import torch
from conftest import IdTokenizer, tiny_llama
from tiny_models import WINDOW, tiny_model

from kvblocks import CachedGenerator, KVCacheTrie
from kvblocks.adapters import hf
from kvblocks.specdec import (
    ModelDrafter,
    PromptLookupDrafter,
    Round,
    SpeculativeGenerator,
    TrieDrafter,
    truncated_model,
)

EOS = 26  # generated mid-sequence by tiny_llama(seed=0) for three of the prompts, never by the others
MAX_NEW = 16
CAPACITY = 4096
GAMMAS = [1, 2, 4, 8]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2024)
    random = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (3, 5, 8, 12)]
    repetitive = [[5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 40, 41, 90, 40, 41, 40]]
    return random + repetitive


PROMPTS = _prompts()
TOK = IdTokenizer()


@pytest.fixture(scope="module")
def target():
    return tiny_llama(torch.float64, seed=0, eos_token_id=EOS)


@pytest.fixture(scope="module")
def drafter_models(target):
    return {
        "identical": target,
        "self-truncated": truncated_model(target, 1),
        "unrelated": tiny_llama(
            torch.float64, seed=1, hidden_size=32, intermediate_size=64, num_hidden_layers=1
        ),
    }


@pytest.fixture(scope="module")
def expected(target):
    """Target-only greedy output per (prompt, ignore_eos)."""
    plain = CachedGenerator(target, TOK, None)
    out = {}
    for ignore_eos in (False, True):
        for prompt in PROMPTS:
            out[tuple(prompt), ignore_eos] = plain.generate(
                prompt, max_new_tokens=MAX_NEW, ignore_eos=ignore_eos
            )
    stops = [r.finish_reason == "stop" for (_, ignore), r in out.items() if not ignore]
    assert any(stops) and not all(stops), "EOS must end some requests early and not others"
    return {key: r.token_ids for key, r in out.items()}


class Invariants:
    """`on_round` observer for one trie-backed generator; `finish` checks a request once it ended.

    Mid-request only committed tokens may enter a trie (the generator commits the prompt once it
    is computed, so interleaved requests can share it). Each round's rejected draft is recorded
    with its residency then; neither during the rest of the request nor after it may a rejected
    draft become resident, and no lock may outlive the request.
    """

    def __init__(self, cache: KVCacheTrie | None, draft_cache: KVCacheTrie | None = None) -> None:
        self.tries = [t for t in (cache, draft_cache) if t is not None]
        self.cache = cache
        self.rounds: list[Round] = []
        self.rejected: list[tuple[KVCacheTrie, list[int], int]] = []
        self.before: list[dict] = []

    def start(self) -> None:
        self.rounds, self.rejected = [], []
        self.before = [t.stats() for t in self.tries]

    def __call__(self, r: Round) -> None:
        assert hf.seq_length(r.target_past) == len(r.committed) - 1
        assert r.target_past.get_seq_length() == len(r.committed) - 1
        assert r.committed[-1] == r.token and r.committed[-1 - r.accepted : -1] == r.drafts[: r.accepted]
        for trie, before in zip(self.tries, self.before):
            now = trie.stats()
            grown = now["inserted_tokens"] - before["inserted_tokens"]
            assert grown <= len(r.committed) and now["resident_tokens"] - before["resident_tokens"] == grown
        self._check_rejected_invisible()
        if r.accepted < len(r.drafts):
            rejected = [*r.committed[:-1], r.drafts[r.accepted]]
            for trie in self.tries:
                self.rejected.append((trie, rejected, trie.cached_length(rejected)))
        self.rounds.append(r)

    def finish(self, prompt: list[int], generated: list[int]) -> None:
        for trie in self.tries:
            assert trie.stats()["locked_tokens"] == 0, "a lock outlived its request"
        sequence = [*prompt, *generated]
        if self.cache is not None:
            assert self.cache.cached_length(sequence) >= len(sequence) - 1
        self._check_rejected_invisible()

    def _check_rejected_invisible(self) -> None:
        for trie, rejected, during in self.rejected:
            prefix = len(rejected) - 1
            assert trie.cached_length(rejected) <= max(prefix, during), "a rejected draft reached the trie"


def _make_drafter(kind: str, drafter_models: dict, draft_cache: KVCacheTrie | None):
    if kind == "prompt-lookup":
        return PromptLookupDrafter()
    return ModelDrafter(drafter_models[kind], draft_cache)


def _run_pass(sg: SpeculativeGenerator, check: Invariants, expected: dict, ignore_eos: bool) -> list:
    """Generate every prompt once; returns each request's (drafts, accepted) per round."""
    trace = []
    for prompt in PROMPTS:
        check.start()
        r = sg.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=ignore_eos)
        assert r.token_ids == expected[tuple(prompt), ignore_eos], f"prompt {prompt}"
        check.finish(prompt, r.token_ids)
        assert r.spec.rounds == len(check.rounds)
        trace.append([(list(x.drafts), x.accepted) for x in check.rounds])
    return trace


@pytest.mark.parametrize("ignore_eos", [False, True], ids=["eos-stops", "ignore-eos"])
@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("kind", ["identical", "self-truncated", "unrelated", "prompt-lookup"])
def test_speculative_greedy_equals_target_greedy_with_and_without_prefix_hits(
    target, drafter_models, expected, kind, gamma, ignore_eos
):
    """Three passes over the prompts: no caches; cold tries; warm tries (hits on target and drafter).
    The drafts themselves must not depend on whether the drafter's prefix came from its trie."""
    check = Invariants(None)
    uncached = SpeculativeGenerator(
        target, TOK, None, _make_drafter(kind, drafter_models, None), gamma, on_round=check
    )
    reference = _run_pass(uncached, check, expected, ignore_eos)
    assert sum(accepted for trace in reference for _, accepted in trace) > 0 or kind == "unrelated"

    cache = KVCacheTrie.for_model(target, capacity_tokens=CAPACITY)
    draft_cache = (
        None
        if kind == "prompt-lookup"
        else KVCacheTrie.for_model(drafter_models[kind], capacity_tokens=CAPACITY)
    )
    check = Invariants(cache, draft_cache)
    sg = SpeculativeGenerator(
        target, TOK, cache, _make_drafter(kind, drafter_models, draft_cache), gamma, on_round=check
    )
    assert _run_pass(sg, check, expected, ignore_eos) == reference

    draft_hits = draft_cache.stats()["hit_tokens"] if draft_cache else 0
    target_hits = cache.stats()["hit_tokens"]
    assert _run_pass(sg, check, expected, ignore_eos) == reference
    full_hits = sum(len(p) - 1 for p in PROMPTS)
    assert cache.stats()["hit_tokens"] - target_hits == full_hits
    if draft_cache is not None:
        assert draft_cache.stats()["hit_tokens"] - draft_hits == full_hits


@pytest.mark.parametrize("kind", ["self-truncated", "unrelated"])
def test_model_drafter_proposes_from_committed_tokens_only_also_after_hits(target, drafter_models, kind):
    """Each round's drafts equal the drafter model's own greedy output on the committed tokens, so
    its cache (rolled back every round, re-attached from its trie) never holds a rejected draft.
    The second turn extends the first, so its drafter hit covers tokens generated in turn one."""
    draft_model = drafter_models[kind]
    fresh = CachedGenerator(draft_model, TOK, None)
    cache = KVCacheTrie.for_model(target, capacity_tokens=CAPACITY)
    draft_cache = KVCacheTrie.for_model(draft_model, capacity_tokens=CAPACITY)
    check = Invariants(cache, draft_cache)
    sg = SpeculativeGenerator(target, TOK, cache, ModelDrafter(draft_model, draft_cache), 4, on_round=check)
    rejections = 0

    def request(ids: list[int], least_drafter_hit: int) -> list[int]:
        nonlocal rejections
        check.start()
        hits = draft_cache.stats()["hit_tokens"]
        r = sg.generate(ids, max_new_tokens=MAX_NEW, ignore_eos=True)
        check.finish(ids, r.token_ids)
        assert draft_cache.stats()["hit_tokens"] - hits >= least_drafter_hit
        for x in check.rounds:
            before = x.committed[: len(x.committed) - 1 - x.accepted]
            # the last token left is the target's own: that round drafts nothing
            assert len(x.drafts) == min(4, MAX_NEW - (len(before) - len(ids)) - 1)
            if x.drafts:
                assert (
                    x.drafts
                    == fresh.generate(before, max_new_tokens=len(x.drafts), ignore_eos=True).token_ids
                )
            rejections += x.accepted < len(x.drafts)
        return r.token_ids

    for prompt in PROMPTS[:4]:
        generated = request(prompt, 0)
        request(prompt, len(prompt) - 1)
        # the drafter never runs its own last draft, so its cache may end two tokens short
        request([*prompt, *generated, 7, 8], len(prompt) + MAX_NEW - 2)
    assert rejections > 0


def _round_robin(streams: list) -> list:
    """Advance the streams one piece at a time, in turn, as the server's engine does."""
    results, active = [None] * len(streams), list(range(len(streams)))
    while active:
        for i in list(active):
            piece = next(streams[i], None)
            if piece is None:
                active.remove(i)
            elif piece.result is not None:
                results[i] = piece.result
    return results


def test_interleaved_requests_keep_their_own_drafter_state(target, drafter_models, expected):
    """One generator serves many requests at once (the engine interleaves their streams): each
    request's drafter cache, trie lock and namespace must stay its own."""
    draft_model = drafter_models["self-truncated"]
    fresh = CachedGenerator(draft_model, TOK, None)
    cache = KVCacheTrie.for_model(target, capacity_tokens=CAPACITY)
    draft_cache = KVCacheTrie.for_model(draft_model, capacity_tokens=CAPACITY)
    rounds: list[Round] = []
    sg = SpeculativeGenerator(
        target, TOK, cache, ModelDrafter(draft_model, draft_cache), 4, on_round=rounds.append
    )
    prompts = PROMPTS[:4]
    for _ in range(2):  # the second time both target and drafter hit
        streams = [sg.stream(p, max_new_tokens=MAX_NEW, ignore_eos=True) for p in prompts]
        for prompt, r in zip(prompts, _round_robin(streams)):
            assert r.token_ids == expected[tuple(prompt), True]
        assert cache.stats()["locked_tokens"] == 0 and draft_cache.stats()["locked_tokens"] == 0
    for x in rounds:
        before = x.committed[: len(x.committed) - 1 - x.accepted]
        if x.drafts:  # none in a request's last round (its last token is the target's own)
            assert x.drafts == fresh.generate(before, max_new_tokens=len(x.drafts), ignore_eos=True).token_ids

    # the trie drafter drafts from each request's own namespace (salt = tenant)
    salted = KVCacheTrie.for_model(target, capacity_tokens=CAPACITY)
    plain = CachedGenerator(target, TOK, salted)
    prompt = PROMPTS[0]
    plain.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=True, salt="a")
    plain.generate(prompt, max_new_tokens=MAX_NEW, temperature=1.0, seed=0, ignore_eos=True, salt="b")
    sg = SpeculativeGenerator(target, TOK, salted, TrieDrafter(salted), 4)
    streams = [sg.stream(prompt, max_new_tokens=MAX_NEW, ignore_eos=True, salt=s) for s in ("a", "b")]
    a, b = _round_robin(streams)
    assert a.token_ids == b.token_ids == expected[tuple(prompt), True]
    assert a.spec.rejected_rounds == 0, "tenant a drafts its own (greedy) history, never b's"
    assert b.spec.rejected_rounds > 0


@pytest.mark.parametrize("ignore_eos", [False, True], ids=["eos-stops", "ignore-eos"])
@pytest.mark.parametrize("gamma", GAMMAS)
def test_trie_drafter_greedy_equals_target_greedy_and_repeats_are_never_rejected(
    target, expected, gamma, ignore_eos
):
    """The trie first holds sampled continuations (drafts the target rejects), then its own greedy ones."""
    cache = KVCacheTrie.for_model(target, capacity_tokens=CAPACITY)
    sampler = CachedGenerator(target, TOK, cache)
    for seed, prompt in enumerate(PROMPTS):
        sampler.generate(prompt, max_new_tokens=MAX_NEW, temperature=1.0, seed=seed, ignore_eos=True)
    check = Invariants(cache)
    sg = SpeculativeGenerator(target, TOK, cache, TrieDrafter(cache), gamma, on_round=check)
    first = _run_pass(sg, check, expected, ignore_eos)
    assert any(accepted < len(drafts) for trace in first for drafts, accepted in trace)
    repeat = _run_pass(sg, check, expected, ignore_eos)
    assert all(accepted == len(drafts) for trace in repeat for drafts, accepted in trace)
    assert sum(len(drafts) for trace in repeat for drafts, _ in trace) > sum(
        len(drafts) for trace in first for drafts, _ in trace
    )


@pytest.mark.parametrize("kind", ["self-truncated", "prompt-lookup"])
def test_adaptive_gamma_is_exact_and_follows_grow_shrink_rule(target, drafter_models, expected, kind):
    max_gamma = 6
    cache = KVCacheTrie.for_model(target, capacity_tokens=CAPACITY)
    check = Invariants(cache)
    drafter = _make_drafter(kind, drafter_models, None)
    sg = SpeculativeGenerator(
        target, TOK, cache, drafter, gamma=1, adaptive=True, max_gamma=max_gamma, on_round=check
    )
    seen = set()
    for ignore_eos in (False, True):
        for prompt in PROMPTS:
            check.start()
            r = sg.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=ignore_eos)
            assert r.token_ids == expected[tuple(prompt), ignore_eos]
            check.finish(prompt, r.token_ids)
            gamma = 1
            for x in check.rounds:
                left = MAX_NEW - (len(x.committed) - 1 - x.accepted - len(prompt))
                if kind == "self-truncated":  # fewer only for the tokens left or after an end of sequence
                    ended = not ignore_eos and x.drafts[-1:] == [EOS]
                    assert len(x.drafts) == min(gamma, left - 1) or ended
                assert len(x.drafts) <= gamma
                seen.add(gamma)
                if x.drafts:
                    gamma = min(gamma + 1, max_gamma) if x.accepted == len(x.drafts) else max(gamma - 1, 1)
    assert len(seen) > 2, "gamma must actually adapt"


@pytest.fixture(scope="module")
def sliding():
    """A mistral target whose window is shorter than prompt + output, so rollback crosses it."""
    model = tiny_model("mistral", torch.float64)
    assert model.config.sliding_window == WINDOW
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (6, 11, 15)]
    prompts.append([3, 4, 5, 3, 4, 5, 3, 4, 5, 3])
    plain = CachedGenerator(model, TOK, None)
    expected = {tuple(p): plain.generate(p, max_new_tokens=24).token_ids for p in prompts}
    return model, prompts, expected


@pytest.mark.parametrize("gamma", [2, 8])
@pytest.mark.parametrize("kind", ["self-truncated", "prompt-lookup"])
def test_sliding_window_target_is_exact_across_rollbacks_and_hits(sliding, kind, gamma):
    model, prompts, expected = sliding
    draft_model = truncated_model(model, 1) if kind == "self-truncated" else None
    cache = KVCacheTrie.for_model(model, capacity_tokens=CAPACITY)
    draft_cache = (
        KVCacheTrie.for_model(draft_model, capacity_tokens=CAPACITY) if draft_model is not None else None
    )
    drafter = ModelDrafter(draft_model, draft_cache) if draft_model is not None else PromptLookupDrafter()
    check = Invariants(cache, draft_cache)
    sg = SpeculativeGenerator(model, TOK, cache, drafter, gamma, on_round=check)
    rejections = 0
    for _ in range(2):
        for prompt in prompts:
            check.start()
            r = sg.generate(prompt, max_new_tokens=24)
            assert r.token_ids == expected[tuple(prompt)]
            check.finish(prompt, r.token_ids)
            rejections += r.spec.rejected_rounds
    assert rejections > 0


def test_spec_stats_match_a_hand_count_of_the_rounds(target, drafter_models, expected):
    rounds: list[Round] = []
    gamma = 4
    sg = SpeculativeGenerator(
        target, TOK, None, ModelDrafter(drafter_models["self-truncated"]), gamma, on_round=rounds.append
    )
    alphas = []
    for prompt in PROMPTS:
        rounds.clear()
        s = sg.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=True).spec
        drafted = [len(x.drafts) for x in rounds]
        accepted = [x.accepted for x in rounds]
        rejected_rounds = sum(n < d for n, d in zip(accepted, drafted))
        assert (s.gamma, s.rounds, s.drafted, s.accepted) == (gamma, len(rounds), sum(drafted), sum(accepted))
        assert s.rejected_rounds == rejected_rounds
        assert s.alpha == pytest.approx(sum(accepted) / (sum(accepted) + rejected_rounds))
        assert s.tokens_per_call == pytest.approx(sum(n + 1 for n in accepted) / len(rounds))
        assert s.draft_efficiency == pytest.approx(sum(accepted) / sum(drafted))
        by_position = [
            sum(n > i for n, d in zip(accepted, drafted) if d > i) / sum(d > i for d in drafted)
            for i in range(gamma)
        ]
        assert s.acceptance_by_position == pytest.approx(by_position)
        assert s.as_dict()["alpha"] == s.alpha
        alphas.append(s.alpha)
    assert 0.0 < max(alphas) < 1.0, "some drafts accepted, some rejected"


def test_identical_drafter_accepts_everything_and_unrelated_one_almost_nothing(target, drafter_models):
    gamma = 4
    for kind, alpha in (("identical", 1.0), ("unrelated", None)):
        sg = SpeculativeGenerator(target, TOK, None, ModelDrafter(drafter_models[kind]), gamma)
        for prompt in PROMPTS:
            s = sg.generate(prompt, max_new_tokens=4 * (gamma + 1), ignore_eos=True).spec
            if alpha is not None:
                assert (s.alpha, s.draft_efficiency, s.tokens_per_call) == (1.0, 1.0, gamma + 1)
                assert s.acceptance_by_position == [1.0] * gamma
            else:
                assert s.alpha < 0.5 and s.tokens_per_call < 2


@pytest.mark.parametrize("ignore_eos", [False, True], ids=["eos-stops", "ignore-eos"])
def test_output_logits_has_one_row_per_generated_token_equal_to_target_only(
    target, drafter_models, ignore_eos
):
    """Rounds commit several tokens at once; requests that stop mid-round (EOS, max_new_tokens)
    still report exactly the rows of the tokens they returned."""
    plain = CachedGenerator(target, TOK, None)
    sg = SpeculativeGenerator(target, TOK, None, ModelDrafter(drafter_models["identical"]), gamma=4)
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_new_tokens=7, ignore_eos=ignore_eos, output_logits=True)
        got = sg.generate(prompt, max_new_tokens=7, ignore_eos=ignore_eos, output_logits=True)
        assert got.token_ids == want.token_ids
        assert len(got.logits) == len(want.logits) == len(want.token_ids)
        for a, b in zip(got.logits, want.logits):
            assert torch.allclose(a, b, rtol=0.0, atol=1e-12)


def test_drafts_never_run_past_the_context_window():
    context = 24
    model = tiny_llama(torch.float64, seed=0, max_position_embeddings=context)
    prompt = PROMPTS[3]
    expected = CachedGenerator(model, TOK, None).generate(prompt, max_new_tokens=64).token_ids
    assert len(prompt) + len(expected) == context
    rounds: list[Round] = []
    sg = SpeculativeGenerator(model, TOK, None, ModelDrafter(model), gamma=8, on_round=rounds.append)
    assert sg.generate(prompt, max_new_tokens=64).token_ids == expected
    for x in rounds:
        verified = len(x.committed) - 1 - x.accepted + len(x.drafts)  # tokens the verify forward held
        assert verified <= context - 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafter_with_a_larger_vocabulary_never_feeds_unknown_ids_to_the_target(
    target, expected, temperature
):
    """A drafter whose vocabulary is larger than the target's (padded embeddings) proposes ids the
    target lacks; those are rejected outright and never reach the target's embedding."""
    wide = tiny_llama(torch.float64, seed=2, vocab_size=256, hidden_size=32, intermediate_size=64)
    with torch.no_grad():  # make the drafter love the ids the target does not have
        wide.lm_head.weight[128:] *= 20
    sg = SpeculativeGenerator(target, TOK, None, drafter=ModelDrafter(wide), gamma=4)
    for prompt in PROMPTS[:3]:
        r = sg.generate(prompt, max_new_tokens=12, temperature=temperature, seed=7, ignore_eos=True)
        assert all(t < 128 for t in r.token_ids)
        if temperature == 0.0:
            ref = CachedGenerator(target, TOK, None).generate(prompt, max_new_tokens=12, ignore_eos=True)
            assert r.token_ids == ref.token_ids


@pytest.mark.parametrize("mode", ["blend", "concat"])
def test_kv_blocks_modes_are_refused_by_name(target, mode):
    """Block reuse is proven for one-request decoding only: a speculative generator refuses it."""
    from kvblocks.generate.params import ParamError

    sg = SpeculativeGenerator(
        target, TOK, KVCacheTrie.for_model(target, capacity_tokens=CAPACITY), PromptLookupDrafter()
    )
    with pytest.raises(ParamError, match="kv_mode 'exact' only") as info:
        sg.generate(PROMPTS[0], max_new_tokens=2, kv_mode=mode)
    assert info.value.param == "kv_mode"
