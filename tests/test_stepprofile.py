"""The step profile of `kvblocks bench packed`: attention is timed by the paged attention's own
clock and told from the rest by its profiler range, shares add up, the output head counts as a
matrix product, and the FLOP count is the model's."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from tiny_models import tiny_model

from kvblocks.adapters import hf
from kvblocks.bench import stepprofile
from kvblocks.cache.layout import KVLayout
from kvblocks.cache.pool import KVPool
from kvblocks.engine.attention.batch import Segment
from kvblocks.engine.attention.dispatch import attention_clock
from kvblocks.engine.attention.forward import PackedForward


def test_a_packed_step_splits_into_attention_matmul_and_the_rest():
    model = tiny_model("llama", torch.float32)
    pool = KVPool(KVLayout(torch.float32, tuple(hf.describe_layers(model))), 128, "cpu")
    runner = PackedForward(model, pool)
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


def test_the_attention_clock_adds_up_packed_attention_calls_on_its_thread_only():
    model = tiny_model("llama", torch.float32)
    pool = KVPool(KVLayout(torch.float32, tuple(hf.describe_layers(model))), 128, "cpu")
    runner = PackedForward(model, pool)
    segments = [Segment([3, 4, 5], pool.alloc(3)), Segment([6], pool.alloc(1))]
    with attention_clock() as spent:
        start = time.process_time()
        runner.forward(segments)
        elapsed = time.process_time() - start
        assert 0 < spent[0] <= elapsed
        before = spent[0]
        worker = threading.Thread(target=runner.forward, args=(segments,))
        worker.start()
        worker.join()
        assert spent[0] == before  # another thread's forward is not this clock's
    runner.forward(segments)
    assert spent[0] == before  # closed


def test_the_reordered_output_head_counts_as_matmul():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    weight = torch.randn(32, 16)
    packed, rows = torch.ops.mkldnn._reorder_linear_weight(weight, 4), torch.randn(4, 16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")
    spent = stepprofile.split_events(prof.events())
    assert spent["matmul"] > 0 and spent["matmul"] > spent["other kernels"]  # its allocation is apart
