"""The step profile of `kvblocks bench packed`: attention is told from the rest by the paged
attention's profiler range, shares add up, and the FLOP count is the model's."""

from __future__ import annotations

import numpy as np
import torch
from tiny_models import tiny_model

from kvblocks.adapters import hf
from kvblocks.bench import stepprofile
from kvblocks.cache.layout import KVLayout
from kvblocks.cache.pool import KVPool
from kvblocks.engine.paged import PagedRunner, Segment


def test_a_packed_step_splits_into_attention_matmul_and_the_rest():
    model = tiny_model("llama", torch.float32)
    pool = KVPool(KVLayout(torch.float32, tuple(hf.describe_layers(model))), 128, "cpu")
    runner = PagedRunner(model, pool)
    segments = [Segment([3, 4, 5], pool.alloc(3)), Segment([6], pool.alloc(1))]
    profile = stepprofile.profile_step(lambda: runner.forward(segments), repeats=3)
    assert profile.seconds > 0
    assert set(profile.shares) == set(stepprofile.CATEGORIES)
    assert abs(sum(profile.shares.values()) - 1) < 1e-9
    assert profile.shares["attention"] > 0 and profile.shares["matmul"] > 0


def test_operators_outside_the_attention_range_are_not_attention():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        a = torch.randn(8, 8)
        torch.mm(a, a)
    spent = stepprofile.split_events(prof.events())
    assert spent["attention"] == 0 and spent["matmul"] > 0


def test_step_flops_count_every_linear_weight_twice_per_row():
    model = tiny_model("llama", torch.float32)
    weights = sum(i * o for i, o in stepprofile.linear_shapes(model))
    assert stepprofile.step_flops(model, tokens=5, keys_read=0) == 2 * weights * 5
    assert stepprofile.step_flops(model, 1, 10) > stepprofile.step_flops(model, 1, 0)
    assert stepprofile.matmul_peak(model, rows=8, seconds=0.05) > 0
    assert np.isfinite(stepprofile.matmul_peak(model, rows=8, seconds=0.05))
