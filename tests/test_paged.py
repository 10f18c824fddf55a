"""Packed forwards over the pool (kvblocks.engine.attention) equal one request at a time with a DynamicCache.

Three requests run as a mixed schedule: a prompt prefilled in two chunks, a prompt that shares
the first prompt's leading tokens by pointing at its slots (computed in the same forward), a third
prompt arriving later, and decode tokens of the others in the same forwards. Every returned logit
row must equal the solo run's at the same position: within 1e-10 in float64, and the greedy tokens
must be the same in float32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import VOCAB, WINDOW, tiny_model

from kvblocks.adapters import hf
from kvblocks.adapters.hf_trie import KVCacheTrie
from kvblocks.cache.layout import KVLayout
from kvblocks.cache.pool import KVPool
from kvblocks.cache.trie import PoolFullError
from kvblocks.engine.attention import dispatch
from kvblocks.engine.attention.batch import PackedBatch, Segment
from kvblocks.engine.attention.cascade import Cascade
from kvblocks.engine.attention.forward import PackedForward
from kvblocks.engine.attention.per_segment import stacked_bias, stacked_heads_attention

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "gpt2", "gpt_neox", "opt"]
DECODE = 4


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    first = rng.integers(0, VOCAB, 20).tolist()
    second = first[:6] + rng.integers(0, VOCAB, 7).tolist()  # shares 6 tokens with the first
    return [first, second, rng.integers(0, VOCAB, 9).tolist()]


@torch.inference_mode()
def solo(model, ids: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """Logits of the last prompt position and of each greedy decode step, one request alone."""
    cache = hf.empty_cache(model.config)
    logits = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1]
    rows, tokens = [logits], []
    for _ in range(DECODE):
        tokens.append(int(logits.argmax()))
        logits = model(input_ids=torch.tensor([tokens[-1:]]), past_key_values=cache, use_cache=True).logits[
            0, -1
        ]
        rows.append(logits)
    return rows, tokens


# attention modes: one call per segment; short segments in one call (the CUDA default); cascade (the
# CPU default) cutting runs of 4 slots or more, so the shared 6-token prefix is read as a shared run,
# its short segments attended in place by the CPU kernel (the default where it builds) or gathered
MODES = {
    "per-segment": {"attention": "per-segment"},
    "grouped": {"attention": "grouped"},
    "cascade": {"attention": "cascade", "cascade_min": 4},
    "cascade-gathered": {"attention": "cascade", "cascade_min": 4, "direct": False},
}


def packed(
    model, ps: list[list[int]], mode: str = "per-segment"
) -> tuple[list[list[torch.Tensor]], list[list[int]]]:
    """The same requests through packed forwards, mixing chunks, shared slots and decodes, with the
    attention of `MODES[mode]`."""
    pool = KVPool(KVLayout(next(model.parameters()).dtype, tuple(hf.describe_layers(model))), 256, "cpu")
    runner = PackedForward(model, pool, **MODES[mode])
    first, second, third = ps
    slots = [pool.alloc(len(first)), None, pool.alloc(len(third))]
    slots[1] = np.concatenate([slots[0][:6], pool.alloc(len(second) - 6)])  # the shared prefix's slots
    rows: list[list[torch.Tensor]] = [[], [], []]
    tokens: list[list[int]] = [[], [], []]
    held = [0, 0, 0]  # positions with KV in the pool

    def segment(i: int, new: list[int], keep: int = 1) -> Segment:
        held[i] += len(new)
        if held[i] > len(slots[i]):  # decode tokens get a fresh slot each
            slots[i] = np.concatenate([slots[i], pool.alloc(held[i] - len(slots[i]))])
        return Segment(new, slots[i][: held[i]], keep)

    def record(i: int, logits: torch.Tensor) -> None:
        rows[i].append(logits[-1])
        tokens[i].append(int(logits[-1].argmax()))

    held[1] = 6  # its first 6 positions are the first request's, written by the first chunk below
    out = runner.forward([segment(0, first[:12]), segment(1, second[6:])])
    record(1, out[1])
    out = runner.forward([segment(0, first[12:], keep=2), segment(1, tokens[1][-1:])])
    record(0, out[0])
    record(1, out[1])
    out = runner.forward([segment(2, third), segment(0, tokens[0][-1:])])
    record(2, out[0])
    record(0, out[1])
    while any(len(t) <= DECODE for t in tokens):
        live = [i for i in range(3) if len(tokens[i]) <= DECODE]
        out = runner.forward([segment(i, tokens[i][-1:]) for i in live])
        for i, logits in zip(live, out):
            record(i, logits)
    return rows, [t[:DECODE] for t in tokens]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_forwards_equal_one_request_at_a_time_in_float64(arch, mode):
    model = tiny_model(arch, torch.float64)
    ps = prompts()
    reference = [solo(model, p) for p in ps]
    rows, tokens = packed(model, ps, mode)
    for i, (ref_rows, ref_tokens) in enumerate(reference):
        assert tokens[i] == ref_tokens, (arch, i)
        assert len(rows[i]) == len(ref_rows) == DECODE + 1
        worst = max(float((a - b).abs().max()) for a, b in zip(rows[i], ref_rows))
        assert worst < 1e-10, (arch, i, worst)


@pytest.mark.parametrize("mode", ["per-segment", "cascade"])
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_forwards_give_the_same_greedy_tokens_in_float32(arch, mode):
    model = tiny_model(arch, torch.float32)
    ps = prompts(seed=1)
    _, tokens = packed(model, ps, mode)
    assert tokens == [solo(model, p)[1] for p in ps], arch


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_requests_sharing_a_prefix_attend_it_in_one_run_and_get_their_solo_logits(arch):
    """Cascade attention: four requests whose keys start with the same stored prefix slots (as the
    trie hands them out) read those slots as one shared run, merged with each request's own keys by
    log-sum-exp; every logit row equals the request alone within 1e-10 (float64)."""
    model = tiny_model(arch, torch.float64)
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, VOCAB, 12).tolist()
    ps = [prefix + rng.integers(0, VOCAB, n).tolist() for n in (3, 5, 1, 8)]
    pool = KVPool(KVLayout(torch.float64, tuple(hf.describe_layers(model))), 128, "cpu")
    runner = PackedForward(model, pool, attention="cascade", cascade_min=4)
    shared = pool.alloc(len(prefix))
    runner.forward([Segment(prefix, shared)])
    pool.alloc(1)  # no request's own slots continue the prefix's run (the trie's own tokens would)
    slots = [np.concatenate([shared, pool.alloc(len(p) - len(prefix))]) for p in ps]
    outs = runner.forward([Segment(p[len(prefix) :], s) for p, s in zip(ps, slots)])

    def one_run(segments: list[Segment]) -> None:
        batch = PackedBatch(pool, segments, Cascade(4))
        assert [r.rows for r in batch.cascade.runs] == [slice(0, len(ps))]  # one run: every request's row

    decode_against_solo(model, runner, ps, slots, outs, one_run)


def decode_against_solo(model, runner: PackedForward, ps, slots, outs, check=None) -> None:
    """From each request's prompt logits `outs`, `DECODE - 1` packed greedy steps of all of them
    (new slots from the runner's pool, `check(segments)` before each); every logit row and token
    equals the request alone (`solo`) within 1e-10."""
    rows = [[o[-1]] for o in outs]
    tokens = [[int(o[-1].argmax())] for o in outs]
    for _ in range(DECODE - 1):
        slots = [np.concatenate([s, runner.pool.alloc(1)]) for s in slots]
        segments = [Segment(t[-1:], s) for t, s in zip(tokens, slots)]
        if check is not None:
            check(segments)
        for i, o in enumerate(runner.forward(segments)):
            rows[i].append(o[-1])
            tokens[i].append(int(o[-1].argmax()))
    for p, r, t in zip(ps, rows, tokens):
        ref_rows, ref_tokens = solo(model, p)
        assert t == ref_tokens[: len(t)]
        assert max(float((a - b).abs().max()) for a, b in zip(r, ref_rows)) < 1e-10


def test_ordinary_forwards_are_unchanged_after_install():
    model, twin = tiny_model("llama", torch.float32), tiny_model("llama", torch.float32)
    dispatch.install(model)
    dispatch.install(model)  # idempotent
    assert model.config._attn_implementation == "kvblocks_paged_sdpa"
    ids = torch.tensor([prompts()[0]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, twin(ids).logits)
    (rows, tokens), (twin_rows, twin_tokens) = solo(model, prompts()[2]), solo(twin, prompts()[2])
    assert tokens == twin_tokens and all(torch.equal(a, b) for a, b in zip(rows, twin_rows))


def test_unsupported_models_and_bad_segments_are_refused():
    bloom = tiny_model("bloom")
    assert not dispatch.supports(bloom) and not dispatch.supports(tiny_model("falcon"))
    with pytest.raises(NotImplementedError, match="model type 'bloom'"):
        dispatch.install(bloom)
    model = tiny_model("llama", torch.float64)
    pool = KVPool(KVLayout(torch.float64, tuple(hf.describe_layers(model))), 16, "cpu")
    runner = PackedForward(model, pool)
    with pytest.raises(ValueError, match="at least one segment"):
        runner.forward([])
    with pytest.raises(ValueError, match="a slot for each position"):
        runner.forward([Segment([1, 2, 3], pool.alloc(2))])
    with pytest.raises(ValueError, match="keep"):
        runner.forward([Segment([1], pool.alloc(1), keep=2)])


def test_windowed_layers_never_read_slots_before_their_window():
    """A trie prefix need not hold a windowed layer's KV beyond the window: poisoned with NaN, the
    slots before it change nothing (mistral: every layer has the window)."""
    model = tiny_model("mistral", torch.float64)
    ids = prompts()[0]
    pool = KVPool(KVLayout(torch.float64, tuple(hf.describe_layers(model))), 64, "cpu")
    runner = PackedForward(model, pool)
    slots = pool.alloc(len(ids) + 1)
    first = runner.forward([Segment(ids, slots[: len(ids)])])[0][-1]
    token = int(first.argmax())
    stale = pool.index(slots[: len(ids) + 1 - WINDOW])
    for layer in pool.layers:
        layer.index_fill_(0, stale, float("nan"))
    after = runner.forward([Segment([token], slots)])[0][-1]
    rows, _ = solo(model, ids)
    assert float((after - rows[1]).abs().max()) < 1e-10


# ---- a request's slots pass to the trie (insert as bookkeeping) --------------------------------


def kv_of(model, cache, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return hf.extract(cache, hf.describe_layers(model), 0, length)


def test_a_request_computed_in_pool_slots_passes_to_the_trie_without_a_copy():
    model = tiny_model("llama", torch.float64)
    trie = KVCacheTrie.for_model(model, capacity_tokens=96)
    runner = PackedForward(model, trie.pool)
    first, second, _ = prompts()
    slots = trie.reserve(len(first) + 1)
    token = int(runner.forward([Segment(first, slots[:-1])])[0][-1].argmax())
    runner.forward([Segment([token], slots)])  # one decode step: its KV lands in the last slot
    free = trie.pool.num_free
    assert trie.adopt([*first, token], slots, 0) == len(first) + 1
    assert trie.pool.num_free == free and trie.stats()["resident_tokens"] == len(first) + 1

    # the second request hits the shared 6 tokens and reads them from the trie's own slots
    hit = trie.match(second)
    assert hit.length == 6
    own = trie.reserve(len(second) - 6)
    logits = runner.forward([Segment(second[6:], np.concatenate([hit._slots, own]))])[0][-1]
    assert float((logits - solo(model, second)[0][0]).abs().max()) < 1e-10
    assert trie.adopt(second, np.concatenate([hit._slots, own]), 6) == len(second) - 6
    hit.release()

    # what the trie holds is the KV a one-request run computes, position by position
    for ids in ([*first, token], second):
        with trie.match([*ids, 0]) as found:
            assert found.length == len(ids)
            cached = kv_of(model, found.to_hf_cache(), len(ids))
        reference = hf.empty_cache(model.config)
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]), past_key_values=reference, use_cache=True)
        for (k, v), (rk, rv) in zip(cached, kv_of(model, reference, len(ids))):
            assert float((k - rk).abs().max()) < 1e-10 and float((v - rv).abs().max()) < 1e-10


def test_adopting_tokens_another_request_stored_frees_the_duplicate_slots():
    model = tiny_model("llama", torch.float64)
    trie = KVCacheTrie.for_model(model, capacity_tokens=64)
    runner = PackedForward(model, trie.pool)
    ids = prompts()[2]
    a, b = trie.reserve(len(ids)), trie.reserve(len(ids))
    runner.forward([Segment(ids, a), Segment(ids, b)])  # the same prompt computed twice at once
    assert trie.adopt(ids, a, 0) == len(ids)
    assert trie.adopt(ids, b, 0) == 0  # already resident: b's slots go back to the pool
    assert trie.pool.num_free == 64 - len(ids) == 64 - trie.stats()["resident_tokens"]
    with pytest.raises(ValueError, match="as many slots"):
        trie.adopt(ids, a[:3], 0)
    with pytest.raises(ValueError, match="before `start` are resident"):
        trie.adopt([*prompts()[0]], trie.reserve(20), 5)


def test_reserve_evicts_what_it_may_and_refuses_what_is_locked():
    model = tiny_model("llama", torch.float64)
    trie = KVCacheTrie.for_model(model, capacity_tokens=32)
    ids = prompts()[0]
    slots = trie.reserve(len(ids))
    PackedForward(model, trie.pool).forward([Segment(ids, slots)])
    trie.adopt(ids, slots, 0)
    assert len(trie.reserve(20)) == 20  # evicts 8 of the 20 resident tokens
    assert trie.stats()["evicted_tokens"] == 8
    with trie.match(ids) as hit:  # the 12 left are locked now
        assert hit.length == 12
        with pytest.raises(PoolFullError, match="1 slots asked for, 0 free"):
            trie.reserve(1)


def test_stacked_query_heads_attend_as_grouped_query_attention():
    """The off-CPU segment path (query heads of a K/V head stacked along the rows, the mask repeated
    to match) gives what SDPA with `enable_gqa` gives, here on the CPU in float64."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, n, length, dim = 8, 2, 5, 13, 4
    q = torch.randn(heads, n, dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(kv_heads, length, dim, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    groups = heads // kv_heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, scale=0.5, enable_gqa=True
    )[0].transpose(0, 1)
    stacked = stacked_heads_attention(q, k, v, mask.repeat(groups, 1), 0.5, groups)
    assert torch.allclose(stacked, expected, atol=1e-12, rtol=0)
    bias = stacked_bias(mask, groups, torch.float64)  # what a GPU forward passes, made once
    assert bias.shape == (groups * n, length) and bias.stride(0) % 8 == 0
    assert torch.allclose(stacked_heads_attention(q, k, v, bias, 0.5, groups), expected, atol=1e-12, rtol=0)
