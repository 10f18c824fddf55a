"""Cascade attention's plan and its exactness where the batched own-key calls pad (kvblocks.engine.paged).

Requests share a stored prefix (one run of pool slots) and have own keys of different lengths and
different numbers of new tokens: the plan batches own keys by width with bounded padding, reads the
shared run in place, and every logit row equals the request alone within 1e-10 in float64.
"""

from __future__ import annotations

import numpy as np
import torch
from test_paged import DECODE, solo
from tiny_models import VOCAB, tiny_model

from kvblocks.adapters import hf
from kvblocks.cache.layout import KVLayout
from kvblocks.cache.pool import KVPool
from kvblocks.engine import paged
from kvblocks.engine.paged import PagedRunner, Segment


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
    plan = paged.PagedBatch(pool, segments, cascade_min=32).cascade
    assert [r.keys for r in plan.runs] == [slice(int(slots[0][0]), int(slots[0][0]) + 40)]
    assert plan.plain == []
    batches = sorted((o.width, o.segments, o.length) for o in plan.own)
    assert batches == [(1, 1, 3), (1, 1, 9), (1, 2, 2), (2, 1, 30)]  # own keys 1-2 | 3 | 9, and the chunk
    assert all(o.allowed is None for o in plan.own if o.width == 1 and o.segments == 1)


def test_masks_are_made_once_per_forward_for_every_layer():
    model = tiny_model("llama", torch.float64)
    pool = _pool(model)
    slots = _shared_slots(pool, 40, [2, 3])
    plan = paged.PagedBatch(pool, [Segment([1], s) for s in slots], cascade_min=32).cascade
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
    runner = PagedRunner(model, pool, cascade=True, cascade_min=4)
    slots = _shared_slots(pool, len(prefix), [len(p) - len(prefix) for p in ps])
    runner.forward([Segment(prefix, slots[0][: len(prefix)])])
    outs = runner.forward([Segment(p[len(prefix) :], s) for p, s in zip(ps, slots)])
    rows = [[o[-1]] for o in outs]
    tokens = [[int(o[-1].argmax())] for o in outs]
    for _ in range(DECODE - 1):
        slots = [np.concatenate([s, pool.alloc(1)]) for s in slots]
        for i, o in enumerate(runner.forward([Segment(t[-1:], s) for t, s in zip(tokens, slots)])):
            rows[i].append(o[-1])
            tokens[i].append(int(o[-1].argmax()))
    for p, r, t in zip(ps, rows, tokens):
        ref_rows, ref_tokens = solo(model, p)
        assert t == ref_tokens[: len(t)]
        assert max(float((a - b).abs().max()) for a, b in zip(r, ref_rows)) < 1e-10


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
    runner = PagedRunner(model, pool, cascade=True, cascade_min=32)
    (slots,) = _shared_slots(pool, len(prefix), [len(prompt) - len(prefix)])
    runner.forward([Segment(prefix, slots[: len(prefix)])])
    segment = Segment(prompt[len(prefix) :], slots)
    plan = paged.PagedBatch(pool, [segment], cascade_min=32).cascade
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
        flash_out, flash_lse = paged._fused(q, k, v, 0.3, mask)[:2]
        out, lse = paged._attend(q, k.transpose(-1, -2), v, 0.3, mask)
        assert torch.allclose(out, flash_out, atol=1e-12, rtol=0)
        assert torch.allclose(lse, flash_lse, atol=1e-12, rtol=0)
