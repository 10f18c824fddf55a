"""Cascade attention's plan and its exactness where the batched own-key calls pad (kvblocks.engine.attention).

Requests share a stored prefix (one run of pool slots) and have own keys of different lengths and
different numbers of new tokens: the plan batches own keys by width with bounded padding, reads the
shared run in place, and every logit row equals the request alone within 1e-10 in float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_paged import decode_against_solo, solo
from tiny_models import VOCAB, tiny_model

from kvblocks.adapters import hf
from kvblocks.cache.layout import KVLayout
from kvblocks.cache.pool import KVPool
from kvblocks.engine import kernel
from kvblocks.engine.attention import strategy
from kvblocks.engine.attention.batch import PackedBatch, Segment
from kvblocks.engine.attention.cascade import Cascade
from kvblocks.engine.attention.fixed_cuts import FixedCuts
from kvblocks.engine.attention.forward import PackedForward
from kvblocks.engine.attention.fused import attend, fused
from kvblocks.engine.attention.probes import probe_blocks_invariance
from kvblocks.engine.scheduler import chunk_ends


@pytest.fixture(autouse=True, params=["kernel", "gathered"])
def keys_read(request, monkeypatch):
    """Every test twice: short segments attended in place by the CPU kernel (the default where it
    builds), and every segment by the cascade plans over gathered keys (where it does not)."""
    if request.param == "gathered":
        monkeypatch.setattr(strategy, "direct_refusal", lambda model, pool: "gathered (test)")
    else:
        assert kernel.library() is not None, kernel.reason()
    return request.param


def _pool(model, capacity: int = 256) -> KVPool:
    dtype = next(model.parameters()).dtype
    return KVPool(KVLayout(dtype, tuple(hf.describe_layers(model))), capacity, "cpu")


def _shared_slots(pool: KVPool, prefix: int, own: list[int]) -> list[np.ndarray]:
    """Slots of requests whose first `prefix` positions are one stored run and the rest their own."""
    shared = pool.alloc(prefix)
    pool.alloc(1)  # no request's own slots continue the shared run
    return [np.concatenate([shared, pool.alloc(n)]) for n in own]


def test_own_keys_are_batched_by_width_with_padding_at_most_twofold():
    model = tiny_model("llama", torch.float64)
    pool = _pool(model)
    own = [1, 2, 3, 9, 30]
    slots = _shared_slots(pool, 40, own)
    widths = [1, 1, 1, 1, 2]
    segments = [Segment([1] * w, s) for w, s in zip(widths, slots)]
    plan = PackedBatch(pool, segments, Cascade(32)).cascade
    assert [r.keys for r in plan.runs] == [slice(int(slots[0][0]), int(slots[0][0]) + 40)]
    assert plan.plain == []
    batches = sorted((o.width, o.segments, o.length) for o in plan.own)
    assert batches == [(1, 1, 3), (1, 1, 9), (1, 2, 2), (2, 1, 30)]  # own keys 1-2 | 3 | 9, and the chunk
    assert all(o.allowed is None for o in plan.own if o.width == 1 and o.segments == 1)


def test_masks_are_made_once_per_forward_for_every_layer():
    model = tiny_model("llama", torch.float64)
    pool = _pool(model)
    slots = _shared_slots(pool, 40, [2, 3])
    plan = PackedBatch(pool, [Segment([1], s) for s in slots], Cascade(32)).cascade
    (own,) = plan.own
    bias = own.bias(2, torch.float64)
    assert bias is own.bias(2, torch.float64)
    assert bias.shape == (2, 1, 2, 3)
    assert torch.isinf(bias[0, 0, :, 2]).all() and (bias[1] == 0).all()  # the shorter one's padding key


@torch.inference_mode()
def test_uneven_own_keys_and_widths_give_each_request_its_solo_logits_in_float64():
    model = tiny_model("qwen2", torch.float64)
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, VOCAB, 10).tolist()
    ps = [prefix + rng.integers(0, VOCAB, n).tolist() for n in (1, 2, 7, 13, 4)]
    pool = _pool(model)
    runner = PackedForward(model, pool, attention="cascade", cascade_min=4)
    slots = _shared_slots(pool, len(prefix), [len(p) - len(prefix) for p in ps])
    runner.forward([Segment(prefix, slots[0][: len(prefix)])])
    outs = runner.forward([Segment(p[len(prefix) :], s) for p, s in zip(ps, slots)])
    decode_against_solo(model, runner, ps, slots, outs)


@torch.inference_mode()
def test_a_request_alone_reads_its_stored_prefix_in_place_and_gets_its_solo_logits():
    """A lone request whose own slots do not continue its stored prefix's run (the usual case once
    the pool has turned over) is cut at the run's end like a batched one: the run is a view, only its
    own keys are gathered, and its rows equal the request alone within 1e-10 in float64."""
    model = tiny_model("llama", torch.float64)
    rng = np.random.default_rng(5)
    prefix = rng.integers(0, VOCAB, 40).tolist()
    prompt = prefix + rng.integers(0, VOCAB, 6).tolist()
    pool = _pool(model)
    runner = PackedForward(model, pool, attention="cascade", cascade_min=32)
    (slots,) = _shared_slots(pool, len(prefix), [len(prompt) - len(prefix)])
    runner.forward([Segment(prefix, slots[: len(prefix)])])
    segment = Segment(prompt[len(prefix) :], slots)
    plan = PackedBatch(pool, [segment], Cascade(32)).cascade
    assert [r.keys for r in plan.runs] == [slice(int(slots[0]), int(slots[0]) + len(prefix))]
    assert plan.plain == [] and [o.length for o in plan.own] == [6]
    (logits,) = runner.forward([segment])
    ref_rows, _ = solo(model, prompt)
    assert float((logits[-1] - ref_rows[0]).abs().max()) < 1e-10


def test_the_matrix_product_attention_used_off_the_cpu_equals_the_cpu_flash_kernel():
    """`_fused` off the CPU is `_attend` (matrix products and a log-sum-exp): the same outputs and
    log-sum-exps as the CPU flash kernel, masked and not, in float64."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 6, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 3, 11, 8, generator=g, dtype=torch.float64) for _ in range(2))
    bias = torch.zeros(2, 1, 6, 11, dtype=torch.float64)
    bias[0, 0, :, 7:] = float("-inf")
    for mask in (None, bias):
        flash_out, flash_lse = fused(q, k, v, 0.3, mask)[:2]
        out, lse = attend(q, k.transpose(-1, -2), v, 0.3, mask)
        assert torch.allclose(out, flash_out, atol=1e-12, rtol=0)
        assert torch.allclose(lse, flash_lse, atol=1e-12, rtol=0)


def _invariant(model, pool: KVPool) -> PackedForward:
    """A batch-invariant runner whose cascade cuts blocks of 64, 32 and 16 positions (prompt chunk 16)."""
    return PackedForward(model, pool, invariant=True, chunk=16, cascade_cuts=(64, 32, 16))


def _prefill(runner: PackedForward, ids: list[int], slots: np.ndarray, begin: int = 0) -> torch.Tensor:
    """`ids[begin:]` in chunks cut at multiples of 16, as the batch-invariant engine cuts prompts;
    the logits of the last chunk."""
    for end in chunk_ends(begin, len(ids), 16):
        (logits,) = runner.forward([Segment(ids[begin:end], slots[:end])])
        begin = end
    return logits


def test_the_invariant_plan_cuts_blocks_at_fixed_positions_and_reads_stored_runs_in_place():
    model = tiny_model("llama", torch.float64)
    pool = _pool(model, 512)
    stored = pool.alloc(70)  # a prefix the trie stored in one piece
    pool.alloc(1)
    own = [pool.alloc(n) for n in (2, 30)]
    slots = [np.concatenate([stored, own[0]]), np.concatenate([stored[:40], own[1]])]
    segments = [Segment([1], slots[0]), Segment([1], slots[1]), Segment([1, 2], slots[0], keep=2)]
    plan = PackedBatch(pool, segments, FixedCuts(sizes=(32, 16))).cascade
    first = int(stored[0])
    # request 0 (new token at 71): 32-blocks [0, 32) [32, 64), both in its stored run, read in place,
    # then its tail [64, 72) padded to 16; request 1 (new token at 69): [0, 32) in place, with request
    # 0's first block in the same call, then [32, 64), which holds its own slots from 40 on: gathered
    runs = {(part.keys.start - first, part.keys.stop - first, n, fold) for part, n, fold in plan.runs}
    assert runs == {(0, 64, 2, 0), (0, 32, 1, 0)}
    ((private, target),) = plan.private
    assert (private.segments, private.length, private.min_rows) == (1, 32, 4)
    assert target.tolist() == [1 + 1 * 4]  # row 1, fold 1 (the batch packs 4 rows)
    assert [(o.segments, o.length, rows, t) for o, rows, t in plan.tails] == [(2, 16, 2, None)]
    assert plan.plain == [2] and plan.depth == 2  # a speculative round keeps its own call
    # new token at 90, stored run to 70: the 16-block [64, 80) is gathered in the tail's call
    mixed = np.concatenate([stored, pool.alloc(21)])
    plan = PackedBatch(pool, [Segment([1], mixed)], FixedCuts(sizes=(32, 16))).cascade
    assert plan.private == [] and plan.depth == 3
    ((call, rows, target),) = plan.tails
    assert (call.segments, call.length, rows, target.tolist()) == (2, 16, 1, [2])  # fold 2 of 1 row
    assert call.allowed[0, 0].tolist() == [True] * 11 + [False] * 5 and call.allowed[1].all()
    # a prompt's last token (89) in one run of slots: 32-blocks to 64, then a 16-block, all in place
    run = pool.alloc(90)
    late = PackedBatch(pool, [Segment([1], run)], FixedCuts(sizes=(32, 16))).cascade
    runs = {
        (part.keys.start - int(run[0]), part.keys.stop - int(run[0]), n, fold) for part, n, fold in late.runs
    }
    assert runs == {(0, 64, 2, 0), (64, 80, 1, 2)} and late.private == [] and late.depth == 3


@torch.inference_mode()
def test_the_invariant_cascade_gives_each_request_its_solo_logits_in_float64():
    model = tiny_model("qwen2", torch.float64)
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, VOCAB, 37).tolist()
    ps = [prefix + rng.integers(0, VOCAB, n).tolist() for n in (1, 9, 30, 4)]
    pool = _pool(model, 512)
    runner = _invariant(model, pool)
    slots = _shared_slots(pool, len(prefix), [len(p) - len(prefix) for p in ps])
    _prefill(runner, prefix, slots[0])
    outs = [_prefill(runner, p, s, len(prefix)) for p, s in zip(ps, slots)]
    decode_against_solo(model, runner, ps, slots, outs)


@torch.inference_mode()
def test_a_row_has_the_same_bits_read_in_place_alone_or_gathered_in_a_batch():
    """fp32: the same K/V once in one run of slots, read in place by the request alone, and once
    scattered over the pool, gathered among other requests: the request's logits are bit-identical."""
    model = tiny_model("llama", torch.float32)
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, VOCAB, 75).tolist()
    pool = _pool(model, 1024)
    runner = _invariant(model, pool)
    alone = pool.alloc(len(prompt) + 1)
    _prefill(runner, prompt, alone)
    assert (
        PackedBatch(pool, [Segment([7], alone)], FixedCuts(sizes=runner.attention.cuts)).cascade.private == []
    )
    (ref,) = runner.forward([Segment([7], alone)])
    scattered = np.concatenate([pool.alloc(2)[:1] for _ in range(len(prompt) + 1)])
    for layer in pool.layers:
        layer[pool.index(scattered[:-1])] = layer[pool.index(alone[:-1])]
    others = [np.concatenate([alone[:40], pool.alloc(n)]) for n in (3, 25)]
    for s, n in zip(others, (3, 25)):
        runner.forward([Segment(rng.integers(0, VOCAB, n).tolist(), s)])
    segments = [Segment([5], others[0]), Segment([7], scattered), Segment([9], others[1])]
    plan = PackedBatch(pool, segments, FixedCuts(sizes=runner.attention.cuts)).cascade
    assert plan.runs and sum(own.segments for own, _ in plan.private) >= 2
    assert torch.equal(runner.forward(segments)[1], ref)
    # read in place together with a 16-token prefill chunk over the same stored blocks: the shared
    # calls have 2 x 16 + 2 query rows, which the kernel would split 32 + 2 without padding
    chunk = Segment(rng.integers(0, VOCAB, 16).tolist(), np.concatenate([alone[:64], pool.alloc(16)]))
    plan = PackedBatch(pool, [chunk, Segment([7], alone)], FixedCuts(sizes=runner.attention.cuts)).cascade
    assert [part.rows for part, _, _ in plan.runs] == [slice(0, 17)]
    assert torch.equal(runner.forward([chunk, Segment([7], alone)])[1], ref)


def test_what_the_invariant_cascade_relies_on_holds_on_this_cpu(monkeypatch):
    assert probe_blocks_invariance("cpu", torch.float32)
    assert probe_blocks_invariance("cpu", torch.float64)
    assert probe_blocks_invariance("cpu", torch.float32, 16)  # the tiny models' head dim
    model = tiny_model("llama", torch.float32)
    pool = _pool(model)
    assert PackedForward(model, pool, invariant=True, chunk=64).attention.cuts == [2048, 256, 64]
    assert (
        PackedForward(model, pool, invariant=True, chunk=48, attention="per-segment").attention.cuts is None
    )
    assert PackedForward(model, pool, invariant=True, chunk=48).attention.cuts == [2304, 288, 96]
    assert PackedForward(model, pool, invariant=True, chunk=40).attention.cuts == [2240, 320, 80]
    rounded = PackedForward(model, pool, invariant=True, chunk=16, cascade_cuts=(48, 32))
    assert rounded.attention.cuts == [64, 32]
    # where the probe fails, invariant mode keeps one call per request and refuses cascade by name
    monkeypatch.setattr(strategy, "probe_blocks_invariance", lambda device, dtype, dim: False)
    assert PackedForward(model, pool, invariant=True, chunk=64).attention.cuts is None
    with pytest.raises(NotImplementedError, match="batch-invariant cascade attention"):
        PackedForward(model, pool, invariant=True, chunk=64, attention="cascade")
