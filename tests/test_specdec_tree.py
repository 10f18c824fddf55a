"""Draft trees (`kvblocks.specdec.tree`): several continuations verified in one target forward.

Greedy output equals target-only greedy decoding in every mode (the one-request path with a 4-D
tree mask; the packed engine alone, batched with other requests' decodes and prefills, per attention
mode, batch-invariant); sampling keeps the target's distribution (chi-square, trees of several shapes
and both kinds of siblings: point masses and i.i.d. draws); rejected nodes never reach the trie and
their slots go back to the pool.
"""

from __future__ import annotations

import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from conftest import IdTokenizer, tiny_llama
from test_batch_engine import no_leaks, run_all, workload
from test_specdec_sampling import PROMPT, SAMPLING, HashLM, _table, chi_square_p_value
from tiny_models import tiny_model

from kvblocks import CachedGenerator, GenerationParams, KVCacheTrie
from kvblocks.adapters import hf
from kvblocks.engine.batch import BatchEngine
from kvblocks.engine.loop import Engine
from kvblocks.generate.sampling import distribution
from kvblocks.specdec import (
    DraftTree,
    ModelDrafter,
    PromptLookupDrafter,
    SpeculativeGenerator,
    TreeShape,
    TrieDrafter,
    truncated_model,
)
from kvblocks.specdec.cost import StepCost, best_cut
from kvblocks.specdec.drafters import NgramIndex
from kvblocks.specdec.tree import Shape, depth_first, grow, merge

TOK = IdTokenizer()


# ---- the tree itself -----------------------------------------------------------------------------


def test_merged_chains_share_prefixes_in_depth_first_order_within_the_budget():
    tree = merge([[1, 2, 3], [1, 2, 4], [1, 5], [6, 7]], budget=6)
    assert tree.tokens == [1, 2, 3, 4, 5, 6]
    assert tree.parents == [-1, 0, 1, 1, 0, -1]
    assert tree.depths() == [1, 2, 3, 3, 2, 1]
    assert merge([[1, 2, 3], [6, 7]], budget=4).tokens == [1, 2, 3, 6]  # the budget cuts the second
    assert DraftTree.chain([4, 5, 6]).is_chain and not tree.is_chain
    ancestors = tree.ancestors()
    assert ancestors[3].tolist() == [True, True, False, True, False, False]  # 4 sees 1, 2, itself
    assert ancestors[5].tolist() == [False] * 5 + [True]


def test_depth_first_reorders_nodes_made_level_by_level():
    # chain 10 -> 11 -> 12, then a sibling of 10 and a sibling of 11 (made after the chain)
    tree = depth_first([10, 11, 12, 20, 21], [-1, 0, 1, -1, 0])
    assert tree.tokens == [10, 11, 12, 21, 20]
    assert tree.parents == [-1, 0, 1, 0, -1]
    assert tree.truncated(budget=4, depth=2).tokens == [10, 11, 21, 20]


def test_trie_branches_are_ranked_by_how_often_they_were_taken():
    model = tiny_llama(torch.float32, seed=0)
    cache = KVCacheTrie.for_model(model, capacity_tokens=512)
    prompt = [3, 4, 5]
    gen = CachedGenerator(model, TOK, cache)
    for tail in ([7, 8, 9], [7, 8, 10], [11, 12], [11, 12]):  # 11 12 stored once, then matched again
        ids = prompt + tail
        cache.insert(ids, _prefilled(gen, ids))
    cache.match_or_miss([*prompt, 11, 12]).release()  # one more hit on the 11 branch
    tokens, parents = cache.continuations(prompt, budget=8, depth=3, width=4)
    tree = DraftTree(tokens, parents)
    assert tokens[0] == 11 and set(tokens) == {7, 8, 9, 10, 11, 12}
    assert tree.depth == 3 and len(tree.children(-1)) == 2
    assert cache.continuations(prompt, budget=8, depth=3, width=1)[0] == [11, 12]
    assert cache.continuations(prompt, budget=2, depth=3, width=4)[0] == [11, 12]
    assert cache.continuations([9, 9], budget=8, depth=3, width=4) == ([], [])


def _prefilled(gen: CachedGenerator, ids: list[int]):
    past = hf.empty_cache(gen.model.config)
    gen.runner.forward(ids, past)
    return past


def test_prompt_lookup_proposes_each_earlier_match_as_a_branch():
    drafter = PromptLookupDrafter(max_ngram=2)
    committed = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2]
    assert drafter.lookups(committed, depth=3, width=3) == [[4, 8, 1], [3, 9, 1]]
    session = drafter.start(committed, None)
    tree = session.propose_tree(committed, 8, 3, 3, GenerationParams().sampling, None)
    assert tree.tokens == [4, 8, 1, 3, 9, 1] and tree.parents == [-1, 0, 1, -1, 3, 4]


def test_shape_widens_on_side_branches_and_narrows_to_a_chain_when_trees_do_not_pay():
    limit = TreeShape(budget=16, depth=4, width=4)
    shape = Shape(limit)
    tree = merge([[1, 2, 3, 4], [5, 6, 7, 8], [9]], 16)
    for _ in range(Shape.PATIENCE * 3):
        shape.after(tree, [0, 1])  # along the first branch only
    assert shape.width == 1 and shape.budget == limit.depth
    for _ in range(Shape.PROBE):
        shape.after(DraftTree.chain([1, 2, 3, 4]), [0])
    assert shape.width == 2  # probes a tree again
    shape.after(tree, [4, 5])  # a side branch: what only a tree finds
    assert shape.width == 3 and shape.budget == 16
    assert shape.for_batch(others=0) == (16, 3)
    budget, width = shape.for_batch(others=2)
    assert limit.depth <= budget < 16 and width == 3  # a smaller tree beside a few requests
    assert shape.for_batch(others=16) == (limit.depth, 1)  # a full batch: a chain


# ---- dynamic trees: grown best first, cut to the most tokens a second ---------------------------------


def test_grow_runs_deep_where_branches_are_sure_and_forks_where_they_are_not():
    # after (): 1 sure; after (1,): a fork 2 | 3 at 0.5 / 0.45; below each, sure again
    def expand(path):
        if not path:
            return [(1, 0.95)]
        if path == (1,):
            return [(2, 0.5), (3, 0.45), (4, 0.05)]
        return [(path[-1] * 10 % 97, 0.95)]

    tree = grow(expand, budget=7, depth=8, width=2)
    assert len(tree) == 7 and tree.tokens[:2] == [1, 2]
    assert 4 not in tree.tokens  # beyond the width
    assert tree.children(0) == [1, tree.tokens.index(3)]  # the fork holds both branches
    assert tree.depth > 4  # the 0.5 branch goes deeper than the 0.45 one
    for i, p in enumerate(tree.parents):
        assert p < 0 or tree.scores[i] <= tree.scores[p]
    for k in range(len(tree) + 1):  # every best-first prefix is a tree of the best nodes
        cut = tree.best(k)
        assert len(cut) == k and sorted(cut.scores, reverse=True) == sorted(tree.scores, reverse=True)[:k]
    assert grow(expand, budget=20, depth=3, width=3).depth == 3
    assert len(grow(lambda path: [], budget=8, depth=4, width=2)) == 0


def test_nothing_grows_below_an_end_token():
    def expand(path):  # 1 -> 2 (the end) -> 3 -> ..., and a weaker 4 beside 1
        return [(path[-1] + 1 if path else 1, 0.9), (4, 0.2)] if len(path) < 6 else []

    tree = grow(expand, budget=8, depth=6, width=2, ends=frozenset({2}))
    end = tree.tokens.index(2)
    assert tree.children(end) == [] and 3 not in tree.path_tokens(range(end + 1))
    assert len(tree) == 8  # the budget went to the other branches
    ended = DraftTree([1, 2, 3, 2, 5], [-1, 0, 1, -1, 3]).ended(frozenset({2}))
    assert ended.tokens == [1, 2, 2] and ended.parents == [-1, 0, -1]


def test_ngram_index_follows_every_earlier_occurrence_and_keeps_up_with_the_committed_tokens():
    text = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 4]
    index = NgramIndex(1, 2)
    index.update(text[:5])
    index.update(text)  # incrementally, then compared with a fresh build
    fresh = NgramIndex(1, 2)
    fresh.update(text)
    assert index.ends == fresh.ends
    assert index.following([1, 2]) == [(4, 2), (3, 1)]  # the most frequent first
    assert index.following([7, 9]) == [(1, 1)]  # no 2-gram: the 1-gram
    assert index.following([5]) == []
    index.update([1, 2, 5])  # not an extension: rebuilt
    assert index.following([1]) == [(2, 1)]
    expand = NgramIndex(1, 2).expander(text, sure=0.9)
    assert expand(()) == [(8, 0.9)]  # after ... 2 4: 8
    assert expand((8,)) == [(1, 0.9)]
    assert [t for t, _ in expand((8, 1, 2))] == [4, 3] and abs(
        sum(p for _, p in expand((8, 1, 2))) - 0.9
    ) < 1e-9


def test_prompt_lookup_grows_a_scored_tree_deeper_than_the_chain_through_every_fork():
    drafter = PromptLookupDrafter(max_ngram=2)
    committed = [1, 2, 3, 9, 1, 2, 4, 8, 5, 6, 1, 2, 4, 8, 5, 6, 7, 7, 1]
    tree = drafter.start(committed, None).grow_tree(committed, 32, 12, 3, 0.9)
    assert tree.scores is not None and tree.depth > 4
    assert tree.tokens[0] == 2 and sorted(tree.tokens[i] for i in tree.children(0)) == [3, 4]


def test_step_cost_fits_its_samples_and_a_round_is_cut_to_the_most_tokens_per_second():
    cost = StepCost()
    for rows in (1, 8, 16, 32, 1, 8):
        cost.add(rows, 0.2 + 0.01 * rows)
    assert abs(cost.a - 0.2) < 1e-6 and abs(cost.b - 0.01) < 1e-6
    cost.add(8, 30.0)  # one forward stalled by a loaded machine: each row count's median is fitted
    assert abs(cost.a - 0.2) < 1e-6 and abs(cost.b - 0.01) < 1e-6
    single = StepCost(1.0, 0.1)
    single.add(4, 0.7)  # one row count: the prior's shape, scaled to the time measured
    assert abs(single.seconds(4) - 0.7) < 1e-9 and abs(single.b / single.a - 0.1) < 1e-9
    with pytest.raises(ValueError):
        StepCost(0.0, 0.1)
    scores = [0.95, 0.9, 0.85, 0.8, 0.3, 0.2, 0.1, 0.05]
    assert best_cut(scores, StepCost(1.0, 0.0)) == len(scores)  # free rows: every node
    assert best_cut(scores, StepCost(1.0, 100.0)) == 0  # dear rows: none
    alone = best_cut(scores, cost)
    assert 4 <= alone < len(scores)  # the sure nodes pay for their rows, the unlikely do not
    assert best_cut(scores, cost, others=16) < alone  # beside 16 requests a row delays them all
    # the cut maximises expected tokens per second: no other k does better
    rate = [(1 + sum(scores[:k])) / cost.seconds(1 + k) for k in range(len(scores) + 1)]
    assert rate[alone] == max(rate)


def test_step_cost_finds_where_rows_stop_being_free():
    # a CPU kernel that streams the weights once: 1 to 8 rows in one row's time, then 10 ms a row
    cost = StepCost()
    for rows in (1, 4, 8, 16, 32):
        cost.add(rows, 0.08 + 0.01 * max(0, rows - 8))
    assert cost.knee == 8 and abs(cost.a - 0.08) < 1e-9 and abs(cost.b - 0.01) < 1e-9
    assert cost.seconds(5) == cost.seconds(1) and abs(cost.seconds(24) - 0.24) < 1e-9
    linear = StepCost()  # a product that repacks per call: every row costs, knee 0 (the smaller of equals)
    for rows in (1, 4, 8, 16, 32):
        linear.add(rows, 0.08 + 0.01 * rows)
    assert linear.knee == 0 and abs(linear.b - 0.01) < 1e-9
    scores = [0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.3]
    assert best_cut(scores, cost) == len(scores)  # rows under the knee are free: take every node
    assert best_cut(scores, cost) > best_cut(scores, linear)
    beside = best_cut(scores, cost, others=16)  # past the knee every node must pay for its row
    assert beside < len(scores)
    rate = [(17 + sum(scores[:k])) / cost.seconds(17 + k) for k in range(len(scores) + 1)]
    assert rate[beside] == max(rate)
    noisy = StepCost()
    for rows, t in ((1, 0.1), (8, 0.09), (16, 0.08)):  # slower with more rows: noise, not a price
        noisy.add(rows, t)
    assert noisy.b == 0.0 and noisy.a > 0
    with pytest.raises(ValueError):
        StepCost(1.0, 0.1, knee=-1)


def test_scored_shape_measures_how_sure_the_drafter_is():
    shape = Shape(TreeShape(budget=16, depth=8, width=2))
    sure = shape.sure
    tree = DraftTree([1, 2, 3, 4], [-1, 0, 1, 2], scores=[0.8, 0.64, 0.51, 0.41])
    for _ in range(10):
        shape.after(tree, [0, 1, 2, 3])  # always accepted to the leaf
    assert shape.sure > sure
    for _ in range(30):
        shape.after(tree, [])  # rejected at once
    assert shape.sure < 0.3


@pytest.mark.parametrize("kind", ["lookup", "trie"])
def test_scored_trees_give_target_greedy_whatever_a_row_costs(target, kind):
    plain = CachedGenerator(target, TOK, None)
    drafted = {}
    for rows, b in (("cheap", 0.0001), ("dear", 3.0)):
        cost = StepCost(1.0, b, learn=False)
        cache = KVCacheTrie.for_model(target, capacity_tokens=4096)
        shape = TreeShape(budget=24, depth=12, width=3)
        sg = SpeculativeGenerator(target, TOK, cache, _drafter(kind, target, cache), tree=shape, cost=cost)
        deep, drafted[rows] = 0, 0
        for prompt in _prompts():
            want = plain.generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids
            for _ in range(2):
                r = sg.generate(prompt, max_new_tokens=24, ignore_eos=True)
                assert r.token_ids == want
                deep = max(deep, len(r.spec.drafted_at))
                drafted[rows] += r.spec.drafted
        assert rows == "dear" or deep > 4  # cheap rows: deeper than a chain of 4
        assert cache.stats()["locked_tokens"] == 0
    # a dear row must be a surer token (the trie's repeated answers are sure all the way)
    assert drafted["dear"] < drafted["cheap"] or kind == "trie"


# ---- greedy: exactly the target's output -----------------------------------------------------------

EOS = 26
SHAPES = [TreeShape(budget=8, depth=4, width=3, adaptive=False), TreeShape(budget=12, depth=3, width=4)]


def _prompts() -> list[list[int]]:
    return [
        [5, 6, 7, 5, 6, 7, 5, 6],
        [40, 41, 40, 41, 90, 40, 41, 40],
        [1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3, 7, 1, 2],
    ]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(torch.float64, seed=0, eos_token_id=EOS)


def _drafter(kind: str, model, cache):
    if kind == "lookup":
        return PromptLookupDrafter()
    if kind == "trie":
        return TrieDrafter(cache)
    return ModelDrafter(truncated_model(model, 1))


def test_verify_forwards_run_on_the_packed_weights_and_keep_target_greedy():
    from kvblocks.engine import head

    model = tiny_llama(torch.float32, seed=0, eos_token_id=EOS)
    plain = CachedGenerator(model, TOK, None, packed="all")  # the same products, one row a forward
    sg = SpeculativeGenerator(model, TOK, None, PromptLookupDrafter(), tree=SHAPES[1])
    unpacked = SpeculativeGenerator(model, TOK, None, PromptLookupDrafter(), tree=SHAPES[1], packed="none")
    assert unpacked.runner.linears is None
    if head.available():  # on a CPU with oneDNN (or kvblocks' kernel): every linear layer packed
        assert sg.runner.linears is plain.runner.linears is not None  # one copy per model
        assert len(sg.runner.linears.layers) == sum(type(m) is torch.nn.Linear for m in model.modules())
    trees = 0
    for prompt in _prompts():
        want = plain.generate(prompt, max_new_tokens=16, ignore_eos=True).token_ids
        r = sg.generate(prompt, max_new_tokens=16, ignore_eos=True)
        assert r.token_ids == want
        trees += r.spec.tree_rounds
    assert trees > 0


@pytest.mark.parametrize("shape", SHAPES, ids=["fixed", "adaptive"])
@pytest.mark.parametrize("kind", ["lookup", "trie", "model"])
def test_tree_greedy_equals_target_greedy_and_rejected_nodes_never_reach_the_trie(target, kind, shape):
    plain = CachedGenerator(target, TOK, None)
    cache = KVCacheTrie.for_model(target, capacity_tokens=4096)
    rounds = []

    def observe(rd) -> None:  # the cache holds exactly the committed tokens but the last
        assert hf_length(rd.target_past) == len(rd.committed) - 1
        rounds.append(rd)

    sg = SpeculativeGenerator(target, TOK, cache, _drafter(kind, target, cache), tree=shape, on_round=observe)
    trees = 0
    for prompt in _prompts():
        expected = plain.generate(prompt, max_new_tokens=20, ignore_eos=True).token_ids
        # the trie: a wrong branch taken twice, the right one once, then the prompt itself
        runs = (
            [[*prompt, 99], [*prompt, 99], prompt + expected[:6], prompt] if kind == "trie" else [prompt] * 2
        )
        answered = []
        for ids in runs:
            want = plain.generate(ids, max_new_tokens=20, ignore_eos=True).token_ids
            rounds.clear()
            r = sg.generate(ids, max_new_tokens=20, ignore_eos=True)
            assert r.token_ids == want
            assert r.spec.rounds == len(rounds) and r.spec.emitted >= len(want)
            trees += r.spec.tree_rounds
            # only committed tokens were stored: the trie holds this request's answer as it was given
            assert cache.cached_length(ids + want[:-1]) == len(ids) + len(want) - 1
            answered.append(ids + want)
        _assert_only_committed(cache, prompt, answered)
    assert trees > 0, "some rounds must have verified a real tree"
    assert cache.stats()["locked_tokens"] == 0


@pytest.mark.parametrize("shape", [*SHAPES, None], ids=["fixed", "adaptive", "chain"])
def test_rounds_draft_nothing_past_the_end_of_sequence_or_the_budget(target, shape, monkeypatch):
    # the prompt repeats a run that ends with the end of sequence: lookup drafts across it
    prompt = [5, 6, 7, EOS, 8, 9] * 3 + [5, 6]
    plain = CachedGenerator(target, TOK, None)
    sg = SpeculativeGenerator(target, TOK, None, PromptLookupDrafter(), gamma=8, tree=shape)
    seen: list[tuple[list[int], list[int], int]] = []  # (tokens, parents, tokens left)
    name = "propose" if shape is None else "propose_tree"
    original = getattr(SpeculativeGenerator, name)

    def spy(self, *args, out=None, **kw):
        if shape is None:
            *args, out = args
        made = original(self, *args, out=out, **kw)
        tree = DraftTree.chain(made[0]) if shape is None else made
        seen.append((tree.tokens, tree.parents, out.left))
        return made

    monkeypatch.setattr(SpeculativeGenerator, name, spy)
    for tokens in (3, 5, 24):
        seen.clear()
        want = plain.generate(prompt, max_new_tokens=tokens).token_ids
        assert sg.generate(prompt, max_new_tokens=tokens).token_ids == want
        for drafted, parents, left in seen:
            assert DraftTree(drafted, parents).depth <= left - 1
            assert all(p < 0 or drafted[p] != EOS for p in parents), "a node below the end of sequence"
        assert tokens < 24 or any(EOS in drafted for drafted, _, _ in seen)


def _assert_only_committed(cache: KVCacheTrie, prompt: list[int], answered: list[list[int]]) -> None:
    """Every branch the trie holds after `prompt` is a prefix of a request's committed tokens."""
    tree = DraftTree(*cache.continuations(prompt, 512, 64, 16))
    for node in range(len(tree)):
        path = [node]
        while tree.parents[path[0]] >= 0:
            path.insert(0, tree.parents[path[0]])
        seq = prompt + tree.path_tokens(path)
        assert any(full[: len(seq)] == seq for full in answered), "a rejected draft reached the trie"


def hf_length(past) -> int:
    return hf.seq_length(past)


# ---- the packed engine -----------------------------------------------------------------------------


def _engine_prompts() -> list[list[int]]:
    return [p * 2 for p in workload(seed=9)]  # repeats: prompt lookup finds several matches


@pytest.mark.parametrize(
    ("arch", "batch"),
    [
        ("llama", {}),
        ("llama", {"attention": "per-segment"}),
        ("llama", {"attention": "grouped"}),
        ("llama", {"invariant": True}),
        ("qwen2", {"attention": "cascade"}),
    ],
)
def test_packed_tree_rounds_beside_other_requests_give_target_greedy_and_free_rejected_slots(arch, batch):
    model = tiny_model(arch, torch.float64)
    prompts = _engine_prompts()
    # seeded sampling too: with point-mass siblings every emitted token is the target's own sample,
    # drawn in order from the request's generator, so it equals target-only sampling seed for seed
    params = [GenerationParams(max_new_tokens=12)] * (len(prompts) - 2) + [
        GenerationParams(max_new_tokens=12, temperature=0.8, seed=5),
        GenerationParams(max_new_tokens=12, temperature=1.1, top_p=0.9, seed=6),
    ]
    shape = TreeShape(budget=8, depth=3, width=3, adaptive=False)
    spec = SpeculativeGenerator(
        model, TOK, KVCacheTrie.for_model(model, 4096), PromptLookupDrafter(), tree=shape
    )
    plain = Engine(CachedGenerator(model, TOK, KVCacheTrie.for_model(model, 4096))).start()
    cache = KVCacheTrie.for_model(model, capacity_tokens=4096)
    engine = BatchEngine(
        SpeculativeGenerator(model, TOK, cache, PromptLookupDrafter(), tree=shape),
        max_batch_size=6,
        max_batch_tokens=80,
        **batch,
    ).start()
    alone = BatchEngine(
        SpeculativeGenerator(
            model, TOK, KVCacheTrie.for_model(model, 4096), PromptLookupDrafter(), tree=shape
        )
    ).start()
    try:
        want = [r["tokens"] for r in run_all(plain, prompts, params)]
        together = run_all(engine, prompts, params)
        assert [r["tokens"] for r in together] == want
        assert [r["tokens"] for r in run_all(alone, prompts[:1], params[:1])] == want[:1]  # batch 1
        assert [spec.generate(p, params=pr).token_ids for p, pr in zip(prompts[:2], params)] == want[:2]
        stats = [r["result"].spec for r in together]
        assert sum(s.tree_rounds for s in stats) > 0 and sum(s.drafted - s.accepted for s in stats) > 0
        deadline = time.monotonic() + 10
        while engine.active:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        no_leaks(cache, len(engine.runner.scratch) if batch.get("invariant") else 0)
        answered = [p + r["tokens"] for p, r in zip(prompts, together)]
        for prompt in prompts:  # the trie holds committed tokens only: no rejected node went in
            _assert_only_committed(cache, prompt, answered)
    finally:
        for e in (plain, engine, alone):
            e.stop()


def test_packed_scored_trees_cut_by_the_batch_give_target_greedy_and_free_rejected_slots():
    """Adaptive lookup trees in the packed engine: grown best first and cut by a step cost that
    counts the other requests' rows (cheap rows, so real trees form beside them)."""
    model = tiny_model("llama", torch.float64)
    prompts = _engine_prompts()
    params = [GenerationParams(max_new_tokens=16)] * len(prompts)
    shape = TreeShape(budget=16, depth=8, width=3)
    plain = Engine(CachedGenerator(model, TOK, KVCacheTrie.for_model(model, 4096))).start()
    cache = KVCacheTrie.for_model(model, capacity_tokens=4096)
    cost = StepCost(1.0, 0.002, learn=False)
    engine = BatchEngine(
        SpeculativeGenerator(model, TOK, cache, PromptLookupDrafter(), tree=shape, cost=cost),
        max_batch_size=6,
        max_batch_tokens=96,
    ).start()
    try:
        want = [r["tokens"] for r in run_all(plain, prompts, params)]
        together = run_all(engine, prompts, params)
        assert [r["tokens"] for r in together] == want
        stats = [r["result"].spec for r in together]
        assert sum(s.tree_rounds for s in stats) > 0
        deadline = time.monotonic() + 10
        while engine.active:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        no_leaks(cache, 0)
    finally:
        for e in (plain, engine):
            e.stop()


def test_a_target_with_sliding_window_or_recurrent_layers_is_refused_by_name():
    for arch in ("gemma3", "mistral"):
        model = tiny_model(arch, torch.float64)
        with pytest.raises(ValueError, match="sliding-window layers: draft chains instead"):
            SpeculativeGenerator(model, TOK, None, PromptLookupDrafter(), tree=TreeShape())


# ---- sampling: the target's distribution, exactly ----------------------------------------------------


class TreeHashLM(HashLM):
    """`HashLM` that reads a tree: each new token's context hash continues the nearest key its
    attention mask lets it see (its parent), so a node that saw a sibling, or a cache that kept a
    rejected node, changes every later distribution."""

    def forward(self, input_ids, past_key_values, use_cache=True, logits_to_keep=0, attention_mask=None):
        layer = past_key_values.layers[0]
        cached = layer.values.shape[-2] if layer.is_initialized else 0
        known = layer.values[0, 0, :, 0].tolist() if cached else []
        tokens = input_ids[0].tolist()
        hashes = []
        for j, token in enumerate(tokens):
            own = cached + j
            if attention_mask is None:
                parent = own - 1
            else:
                seen = torch.nonzero(attention_mask[0, 0, j, :own] == 0).flatten().tolist()
                parent = seen[-1] if seen else -1
            h = 0 if parent < 0 else int((known + hashes)[parent])
            hashes.append((h * 1_000_003 + token + 1) % 2_147_483_647)
        keys = input_ids.to(self.table.dtype)[:, None, :, None]
        values = torch.tensor(hashes, dtype=self.table.dtype).view(1, 1, -1, 1)
        past_key_values.update(keys, values, 0)
        rows = torch.tensor(hashes[-logits_to_keep:] if logits_to_keep else hashes) % 1009
        return SimpleNamespace(logits=self.table[rows][None], past_key_values=past_key_values)


@pytest.fixture(scope="module")
def hash_target():
    return TreeHashLM(_table(0))


@pytest.fixture(scope="module")
def hash_joint(hash_target) -> dict[tuple[int, ...], float]:
    """The target's exact probability of every 3-token continuation of PROMPT."""
    plain = CachedGenerator(hash_target, TOK, None)
    params = GenerationParams(**SAMPLING).sampling
    out = {(): 1.0}
    for _ in range(3):
        longer = {}
        for seq, prob in out.items():
            p = distribution(
                plain.runner.forward([*PROMPT, *seq], hf.empty_cache(hash_target.config))[-1], params
            )
            for x in torch.nonzero(p).flatten().tolist():
                longer[(*seq, x)] = prob * float(p[x])
        out = longer
    return out


def _sample(sg: SpeculativeGenerator, n: int) -> tuple[Counter, int, int]:
    counts, accepted, trees = Counter(), 0, 0
    for seed in range(n):
        r = sg.generate(PROMPT, max_new_tokens=3, seed=seed, ignore_eos=True, **SAMPLING)
        counts[tuple(r.token_ids)] += 1
        accepted += r.spec.accepted
        trees += r.spec.tree_rounds
    return counts, accepted, trees


SAMPLES = 10_000  # the control fails at 2,000 already
TREE_SHAPES = [TreeShape(budget=6, depth=2, width=3, adaptive=False), TreeShape(budget=5, depth=3, width=2)]


@pytest.mark.parametrize("shape", TREE_SHAPES, ids=["wide", "deep-adaptive"])
def test_model_drafter_trees_of_iid_siblings_sample_the_target_distribution(hash_target, hash_joint, shape):
    draft = TreeHashLM(_table(0) + 1.2 * _table(1))
    sg = SpeculativeGenerator(hash_target, TOK, None, ModelDrafter(draft), tree=shape)
    counts, accepted, trees = _sample(sg, SAMPLES)
    assert accepted > SAMPLES // 2 and trees > SAMPLES
    assert set(counts) <= set(hash_joint)
    assert chi_square_p_value(counts, hash_joint, SAMPLES) > 1e-3


def test_control_without_the_sibling_residual_fails_the_test(hash_target, hash_joint, monkeypatch):
    """Forgetting r = norm(max(0, r - q)) between siblings is biased, and the test sees it."""
    import importlib

    monkeypatch.setattr(importlib.import_module("kvblocks.specdec.tree"), "residual", lambda r, q: r)
    draft = TreeHashLM(_table(0) + 1.2 * _table(1))
    sg = SpeculativeGenerator(hash_target, TOK, None, ModelDrafter(draft), tree=TREE_SHAPES[0])
    counts, _, _ = _sample(sg, 2_000)
    assert chi_square_p_value(counts, hash_joint, 2_000) < 1e-9


def test_trie_trees_of_earlier_samples_sample_the_target_distribution(hash_target, hash_joint):
    """Every request's sample goes into the trie, so later requests draft trees of many branches."""
    cache = KVCacheTrie.for_model(hash_target, capacity_tokens=1 << 16)
    shape = TreeShape(budget=8, depth=3, width=4, adaptive=False)
    sg = SpeculativeGenerator(hash_target, TOK, cache, TrieDrafter(cache), tree=shape)
    counts, accepted, trees = _sample(sg, SAMPLES)
    assert accepted > SAMPLES and trees > SAMPLES // 2
    assert chi_square_p_value(counts, hash_joint, SAMPLES) > 1e-3
    assert cache.stats()["locked_tokens"] == 0


def test_serve_flags_follow_sglangs_speculative_flags_and_refuse_what_cannot_be_served():
    from kvblocks.cli.build import tree_shape
    from kvblocks.cli.commands import UserError, build_parser

    parser = build_parser()
    args = parser.parse_args(
        ["serve", "--draft", "trie", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "12",
         "--speculative-num-steps", "5"]
    )  # fmt: skip
    assert tree_shape(args) == TreeShape(budget=12, depth=5, width=4, adaptive=True)
    args = parser.parse_args(["serve", "--draft", "lookup", "--draft-tree-width", "3", "--draft-tree-fixed"])
    assert tree_shape(args) == TreeShape(budget=8, depth=4, width=3, adaptive=False)
    assert tree_shape(parser.parse_args(["serve", "--draft", "trie"])) is None  # chains by default
    with pytest.raises(UserError, match="at least --gamma"):
        tree_shape(parser.parse_args(["serve", "--draft-tree-width", "2", "--draft-tree-tokens", "2"]))
    with pytest.raises(UserError, match="must be >= 1"):
        tree_shape(parser.parse_args(["serve", "--draft-tree-width", "0"]))
