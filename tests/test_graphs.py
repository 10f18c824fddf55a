"""Graphed packed forwards (kvblocks.engine.graphs), checked on the CPU without capture.

A graphed forward pads a batch to a fixed layout (rows per segment, keys per segment, segments) and
attends through masks built from positions; capture itself needs CUDA and is checked on a lent GPU
(tests/test_cuda.py). Here the padded forward runs eagerly (`capture=False`) and must give every
request what it gets alone (within 1e-10 in float64), write no pool slot but its own and the scratch
slot, fall back to the eager path where its layout does not fit, and say so.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import IdTokenizer
from test_batch_engine import run_all, workload
from test_paged import DECODE, packed, prompts, solo
from tiny_models import VOCAB, tiny_model

from kvblocks import CachedGenerator, GenerationParams, KVCacheTrie
from kvblocks.adapters import hf
from kvblocks.cache.layout import KVLayout
from kvblocks.cache.pool import KVPool
from kvblocks.engine import graphs
from kvblocks.engine.attention.batch import Segment
from kvblocks.engine.attention.forward import PackedForward, graphs_default
from kvblocks.engine.batch import BatchEngine
from kvblocks.engine.graphs import GraphedForwards, Layout, bucket
from kvblocks.engine.loop import Engine

# families whose attention the static layout covers; the others window or soft-cap their scores
PLAIN = ["llama", "qwen2", "qwen3", "phi3", "gpt2", "gpt_neox", "opt"]
MASKED = ["mistral", "gemma2", "gemma3"]


def graphed(runner: PackedForward, **kwargs) -> GraphedForwards:
    """Give `runner` graphed forwards without capture, over a scratch slot of its pool; by default
    every layout is taken from its first forward."""
    kwargs = {"capture_after": 1} | kwargs
    runner.graphs = GraphedForwards(
        runner.model, runner.pool, runner.pool.alloc(1)[0], capture=False, **kwargs
    )
    return runner.graphs


def test_layouts_pad_to_buckets_and_refuse_what_padding_would_waste():
    def seg(new: int, total: int, keep: int = 1) -> Segment:
        return Segment([1] * new, np.arange(total, dtype=np.int32), keep)

    assert bucket([seg(64, 4064)]) == Layout(segments=1, width=64, length=4096, keep=1)
    assert bucket([seg(1, 300)] * 5) == Layout(segments=8, width=1, length=512, keep=1)
    assert bucket([seg(1, 10)] * 33) == Layout(segments=40, width=1, length=256, keep=1)
    assert bucket([seg(5, 30, keep=5), seg(1, 20)]) == Layout(segments=2, width=8, length=256, keep=5)
    assert bucket([seg(64, 100)] + [seg(1, 100)] * 15) is None  # a prefill chunk beside decodes
    assert bucket([seg(300, 300)]) is None  # compute-bound: more than MAX_ROWS rows
    assert bucket([seg(100, 100)], max_rows=64) is None
    assert bucket([seg(1, 1 << 20)] * 16, groups=8) is None  # a mask of 16 x 8 x 2^20 elements
    assert bucket([seg(1, 1 << 19)] * 16, groups=8) is not None


@pytest.mark.parametrize("arch", PLAIN)
def test_graphed_forwards_equal_one_request_at_a_time_in_float64(arch, monkeypatch):
    """test_paged's schedule (chunked prompts, a prefix shared by slots, decodes beside prefills)
    with every forward through the padded layout."""
    stats = _schedule_against_solo(arch, monkeypatch)
    assert stats["disabled"] is None and stats["eager"] == 0 and stats["replays"] >= 3 + DECODE


@pytest.mark.parametrize("arch", MASKED)
def test_windowed_or_soft_capped_models_fall_back_to_eager_and_say_why(arch, monkeypatch):
    stats = _schedule_against_solo(arch, monkeypatch)
    assert "sliding-window or soft-capped" in stats["disabled"]
    assert stats["replays"] == 0 and stats["graphs"] == 0 and stats["eager"] >= 3 + DECODE


def _schedule_against_solo(arch: str, monkeypatch) -> dict:
    """test_paged's schedule with the runner's forwards graphed (no capture): every request's logits
    within 1e-10 of its solo run in float64. Returns the graphed forwards' stats."""
    model = tiny_model(arch, torch.float64)
    made = []
    monkeypatch.setattr(PackedForward, "forward", _graphed_forward(made))
    ps = prompts()
    rows, tokens = packed(model, ps, "per-segment")
    for i, p in enumerate(ps):
        ref_rows, ref_tokens = solo(model, p)
        assert tokens[i] == ref_tokens, (arch, i)
        worst = max(float((a - b).abs().max()) for a, b in zip(rows[i], ref_rows))
        assert worst < 1e-10, (arch, i, worst)
    return made[0].stats()


def _graphed_forward(made: list):
    """`PackedForward.forward` that first gives its runner graphed forwards (kept in `made`)."""
    original = PackedForward.forward

    def forward(self, segments):
        if self.graphs is None:
            made.append(graphed(self))
        return original(self, segments)

    return forward


@torch.inference_mode()
def test_padding_rows_write_only_the_scratch_slot_and_padding_keys_are_never_read():
    model = tiny_model("llama", torch.float64)
    layout = KVLayout(torch.float64, tuple(hf.describe_layers(model)))
    pools = [KVPool(layout, 1024, "cpu") for _ in range(2)]
    for t, u in zip(*(p.layers for p in pools)):
        u.copy_(t.normal_())  # padding keys read the scratch slot: its garbage must not reach a row
    runner, eager = (PackedForward(model, p, attention="per-segment") for p in pools)
    forwards = graphed(runner)
    eager.pool.alloc(1)  # the same slots on both pools
    rng = np.random.default_rng(4)
    a, b = rng.integers(0, VOCAB, 300).tolist(), rng.integers(0, VOCAB, 37).tolist()
    sa, sb = (_same_slots(pools, len(ids)) for ids in (a, b))
    for r in (runner, eager):  # the prefixes: too many rows to pad, so eager on both
        r.forward([Segment(a[:-5], sa[:-5]), Segment(b[:-1], sb[:-1])])
    assert forwards.stats()["eager"] == 1 and forwards.stats()["replays"] == 0
    segments = [Segment(a[-5:], sa, keep=2), Segment(b[-1:], sb)]  # 2 x 8 rows over 2 x 512 keys
    before = [t.clone() for t in pools[0].layers]
    got, want = runner.forward(segments), eager.forward(segments)
    assert forwards.stats()["replays"] == 1
    assert [g.shape for g in got] == [w.shape for w in want] == [(2, VOCAB), (1, VOCAB)]
    for g, w in zip(got, want):
        assert float((g - w).abs().max()) < 1e-10
    written = {int(s) for s in (*sa[-5:], *sb[-1:])}
    for old, new in zip(before, pools[0].layers):
        rows = set(torch.nonzero((old != new).flatten(1).any(dim=1)).flatten().tolist())
        assert written <= rows <= written | {forwards.scratch}


def _same_slots(pools: list[KVPool], n: int) -> np.ndarray:
    got = [p.alloc(n) for p in pools]
    assert np.array_equal(*got)
    return got[0]


def _llama_runner(**kwargs) -> tuple[PackedForward, GraphedForwards, np.ndarray]:
    """A float32 llama's runner with graphed forwards (`graphed(**kwargs)`) and 1,200 slots of its pool."""
    model = tiny_model("llama", torch.float32)
    pool = KVPool(KVLayout(torch.float32, tuple(hf.describe_layers(model))), 2048, "cpu")
    runner = PackedForward(model, pool, attention="per-segment")
    return runner, graphed(runner, **kwargs), pool.alloc(1200)


def test_least_recently_used_layouts_leave_first():
    runner, forwards, slots = _llama_runner(max_graphs=2)
    for total in (100, 400, 100, 700, 100):  # key buckets 256, 512, 256, 768, 256
        runner.forward([Segment([1], slots[:total])])
    stats = forwards.stats()
    assert stats["graphs"] == 2 and stats["evictions"] == 1 and stats["replays"] == 5


def test_a_layout_is_captured_when_it_recurs_and_a_one_off_runs_eagerly():
    runner, forwards, slots = _llama_runner(capture_after=2)
    runner.forward([Segment([1] * 40, slots[:40])])  # a one-off prompt: eager, no capture
    for total in range(41, 46):  # decodes: the first eager, then captured and replayed
        runner.forward([Segment([1], slots[:total])])
    stats = forwards.stats()
    assert stats["eager"] == 2 and stats["captures"] == 0 and stats["graphs"] == 1 and stats["replays"] == 4


def test_cuda_graphs_are_refused_off_cuda_and_in_batch_invariant_mode():
    model = tiny_model("llama", torch.float32)
    pool = KVPool(KVLayout(torch.float32, tuple(hf.describe_layers(model))), 256, "cpu")
    with pytest.raises(ValueError, match="CUDA graphs run on a CUDA device"):
        PackedForward(model, pool, cuda_graphs=True)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        GraphedForwards(model, pool, 0, capture=True)
    assert PackedForward(model, pool).graphs is None  # off by default on a CPU
    assert not graphs_default(torch.device("cuda"), invariant=True)
    assert not graphs_default(torch.device("cuda"), invariant=False, grouped=False)
    assert graphs_default(torch.device("cuda"), invariant=False)


def test_batch_engine_through_graphed_forwards_gives_one_request_at_a_time_tokens():
    """The whole engine (queueing, chunked prefills under a small budget, shared prefixes) with its
    runner's forwards padded: where a layout fits they replay, elsewhere they run eagerly."""
    model = tiny_model("llama", torch.float32)
    prompts_ = workload(seed=5, n=8)
    params = [GenerationParams(max_new_tokens=6, ignore_eos=True) for _ in prompts_]
    trie = KVCacheTrie.for_model(model, capacity_tokens=1024)
    engine = BatchEngine(CachedGenerator(model, IdTokenizer(), trie), max_batch_size=4, max_batch_tokens=24)
    scratch = trie.reserve(1)
    runner = engine.runner.packed
    runner.graphs = GraphedForwards(model, trie.pool, int(scratch[0]), capture=False, capture_after=1)
    engine.start()
    try:
        got = [r["tokens"] for r in run_all(engine, prompts_, params)]
    finally:
        engine.stop()
    alone = Engine(CachedGenerator(model, IdTokenizer(), KVCacheTrie.for_model(model, capacity_tokens=1024)))
    alone.start()
    try:
        want = [r["tokens"] for r in run_all(alone, prompts_, params)]
    finally:
        alone.stop()
    assert got == want
    stats = runner.graphs.stats()
    assert stats["replays"] > 0 and stats["disabled"] is None
    assert graphs.MAX_GRAPHS >= stats["graphs"] > 1


def test_kvblocks_stats_shows_cuda_graph_counters():
    from rich.console import Console

    from kvblocks.cli.client import _rates, _stats_table

    graphs_ = {"replays": 90, "captures": 3, "evictions": 0, "eager": 14, "graphs": 3}
    graphs_ |= {"capture_seconds": 0.3, "warmup_seconds": 0.2, "disabled": None}
    now = {
        "model": "m",
        "engine": {"active": 1, "queued": 0, "cuda_graphs": graphs_},
        "cache": {"capacity_tokens": 8},
    }
    console = Console(width=160, record=True)
    console.print(_stats_table(now, _rates(now, None), "t"))
    assert "90 / 14 (3 captured, 3 held)" in console.export_text()
    now["engine"]["cuda_graphs"] = graphs_ | {"disabled": "NotImplementedError: windows"}
    console.print(_stats_table(now, _rates(now, None), "t"))
    assert "off: NotImplementedError: windows" in console.export_text()


def test_serve_refuses_cuda_graphs_off_cuda_by_name():
    import argparse

    from kvblocks.cli.build import cuda_graphs
    from kvblocks.errors import UserError

    with pytest.raises(UserError, match="--cuda-graphs needs a CUDA device, not --device cpu"):
        cuda_graphs(argparse.Namespace(cuda_graphs=True, device="cpu"))
    assert cuda_graphs(argparse.Namespace(cuda_graphs=False, device="cpu")) is False
    assert cuda_graphs(argparse.Namespace(cuda_graphs=None, device="cuda:0")) is None
    assert cuda_graphs(argparse.Namespace(cuda_graphs=True, device="cuda")) is True


def test_speculative_rounds_through_graphed_forwards_match_the_one_request_path():
    """Draft/verify rounds keep every row's logits: layouts keep that many rows per segment."""
    from test_batch_engine import summary

    from kvblocks.specdec import SpeculativeGenerator
    from kvblocks.specdec.drafters import PromptLookupDrafter

    model = tiny_model("llama", torch.float64)
    prompts_ = [p * 2 for p in workload(seed=9)]  # repeats: the lookup drafter finds something
    params = [GenerationParams(max_new_tokens=12)] * 4 + [
        GenerationParams(max_new_tokens=12, temperature=0.8, seed=5)
    ]
    prompts_ = prompts_[: len(params)]

    def generator(cache):
        return SpeculativeGenerator(
            model, IdTokenizer(), cache, PromptLookupDrafter(), gamma=3, adaptive=True
        )

    one = Engine(generator(KVCacheTrie.for_model(model, capacity_tokens=4096))).start()
    trie = KVCacheTrie.for_model(model, capacity_tokens=1024)
    batched = BatchEngine(generator(trie), max_batch_size=6, max_batch_tokens=80)
    runner = batched.runner.packed
    runner.graphs = GraphedForwards(model, trie.pool, int(trie.reserve(1)[0]), capture=False, capture_after=1)
    batched.start()
    try:
        assert summary(run_all(batched, prompts_, params)) == summary(run_all(one, prompts_, params))
    finally:
        batched.stop()
        one.stop()
    stats = runner.graphs.stats()
    assert stats["replays"] > 0 and stats["disabled"] is None
    assert any(layout.keep > 1 for layout in runner.graphs._entries)  # verify rounds were replayed
