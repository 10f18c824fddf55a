"""The CPU attention kernel over pool slots (kvblocks.engine.kernel, csrc/attend.cpp).

It is built here with the machine's compiler (CI has one; a build failure fails these tests rather
than skipping them). Against a float64 reference; a row's bits the same alone, among other segments,
with its keys split differently between shared and own, and elsewhere in the pool; the fallback
where it cannot be built, by name.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import tiny_model

from kvblocks.adapters import hf
from kvblocks.cache.layout import KVLayout
from kvblocks.cache.pool import KVPool
from kvblocks.engine import kernel
from kvblocks.engine.attention.batch import PackedBatch, Segment
from kvblocks.engine.attention.cascade import Cascade
from kvblocks.engine.attention.direct import direct_refusal
from kvblocks.engine.attention.fixed_cuts import FixedCuts, FixedCutsPlan
from kvblocks.engine.attention.forward import PackedForward


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernel.library() is not None, kernel.reason()


def _attend(query, pool, groups, dtype, lse=True):
    plan = kernel.Plan.of(
        [
            (np.asarray(shared, dtype=np.int64), [(np.asarray(r), np.asarray(s)) for r, s in members])
            for shared, members in groups
        ]
    )
    tokens, heads, dim = query.shape[2], query.shape[1], query.shape[3]
    out = torch.full((tokens, heads, dim), float("nan"), dtype=dtype)
    sums = torch.full((tokens, heads), float("nan"), dtype=kernel.lse_dtype(dtype)) if lse else None
    kernel.attend(query, pool, plan, dim**-0.5, out, sums)
    return out, sums


def _reference(query, pool, rows, keys, dim):
    """float64 attention of `rows` over the slots `keys`, causal at the end (the new tokens are last)."""
    kv = pool[torch.as_tensor(keys)].double()
    groups = query.shape[1] // pool.shape[2]
    k = kv[:, 0].transpose(0, 1).repeat_interleave(groups, 0)
    v = kv[:, 1].transpose(0, 1).repeat_interleave(groups, 0)
    q = query[0][:, rows].double()  # [Hq, w, D]
    scores = q @ k.transpose(1, 2) * dim**-0.5
    n, w = len(keys), len(rows)
    hidden = torch.arange(n)[None, :] > torch.arange(n - w, n)[:, None]
    scores.masked_fill_(hidden, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1), torch.logsumexp(scores, -1).T


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 16), (4, 4, 32), (8, 1, 128), (2, 1, 24)]
)
def test_the_kernel_attends_like_a_float64_reference(dtype, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(dim)
    pool = torch.randn(600, 2, kv_heads, dim, generator=g, dtype=dtype)
    query = torch.randn(1, 12, heads, dim, generator=g, dtype=dtype).transpose(
        1, 2
    )  # strided, as transformers
    rng = np.random.default_rng(dim)
    scattered = rng.permutation(np.arange(200, 600))
    # a group of three over a shared run of 150 slots (widths 1, 3 and 4, own keys anywhere), and a
    # segment alone with no shared keys; rows not in packed order
    members = [([0], scattered[:7]), ([5, 6, 7], scattered[7:40]), ([1, 2, 3, 4], scattered[40:44])]
    groups = [(np.arange(10, 160), members), ([], [([11, 9, 10], scattered[44:300])])]
    out, lse = _attend(query, pool, groups, dtype)
    # bfloat16: computed in float32, the output rounded to bfloat16 (a relative 2^-9), the lse not
    tolerance, relative = {torch.float64: (1e-12, 0), torch.float32: (2e-6, 0)}.get(dtype, (2e-6, 2**-8))
    for rows, own in members:
        o, s = _reference(query, pool, rows, np.concatenate([np.arange(10, 160), own]), dim)
        assert torch.allclose(out[rows].double(), o, atol=tolerance, rtol=relative)
        assert torch.allclose(lse[rows].double(), s, atol=tolerance * 10, rtol=0)
    o, s = _reference(query, pool, [11, 9, 10], scattered[44:300], dim)
    assert torch.allclose(out[[11, 9, 10]].double(), o, atol=tolerance, rtol=relative)
    assert torch.isnan(out[8]).all()  # a row no segment has is left as it was
    without, _ = _attend(query, pool, groups, dtype, lse=False)
    assert torch.equal(without[:8], out[:8])


def test_a_bfloat16_pool_is_computed_as_its_float32_widening_and_rounded_once():
    """bfloat16 storage, float32 arithmetic: the same bits as the float32 kernel over the same values
    widened, the output rounded to bfloat16 once (to nearest even, as torch rounds), the lse not."""
    heads, kv_heads, dim = 9, 3, 64
    g = torch.Generator().manual_seed(2)
    pool = torch.randn(700, 2, kv_heads, dim, generator=g).to(torch.bfloat16)
    query = torch.randn(1, 10, heads, dim, generator=g).to(torch.bfloat16).transpose(1, 2)
    rng = np.random.default_rng(2)
    groups = [
        (np.arange(5, 200), [([0], rng.permutation(700)[:90]), ([1, 2, 3], np.arange(300, 340))]),
        ([], [([9, 4, 6], rng.permutation(700)[:400])]),
    ]
    out, lse = _attend(query, pool, groups, torch.bfloat16)
    wide, wide_lse = _attend(query.float(), pool.float(), groups, torch.float32)
    rows = [0, 1, 2, 3, 4, 6, 9]
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.equal(out[rows], wide[rows].to(torch.bfloat16))
    assert torch.equal(lse[rows], wide_lse[rows])
    assert torch.isnan(out[[5, 7, 8]]).all()


def test_the_kernel_refuses_outputs_of_the_wrong_dtype():
    pool = torch.zeros(8, 2, 1, 16, dtype=torch.bfloat16)
    query = torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16)
    plan = kernel.Plan.of([(np.zeros(0, dtype=np.int64), [(np.array([0]), np.arange(4))])])
    out = torch.zeros(1, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="log-sum-exps in at least float32"):
        kernel.attend(query, pool, plan, 0.25, out, torch.zeros(1, 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="in the pool's dtype"):
        kernel.attend(query, pool, plan, 0.25, out.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_row_has_the_same_bits_however_its_keys_are_split_and_wherever_they_lie(dtype):
    """What batch-invariant forwards rely on: a row's result depends on its query and its keys only."""
    heads, kv_heads, dim = 9, 3, 64
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(3000, 2, kv_heads, dim, generator=g, dtype=dtype)
    query = torch.randn(1, 20, heads, dim, generator=g, dtype=dtype).transpose(1, 2)
    keys = np.arange(100, 1100)  # 1,000 keys: the row is a 2-token segment at rows 3, 4
    alone = _attend(query, pool, [([], [([3, 4], keys)])], dtype)
    moved = pool.clone()
    moved[1500:2500] = pool[100:1100]
    rng = np.random.default_rng(0)
    for split in (1, 37, 64, 500, 998):
        others = [([r], rng.integers(0, 3000, int(rng.integers(1, 300)))) for r in (0, 1, 2, 5, 6, 7)]
        for p, groups in (
            (pool, [(keys[:split], [*others[:3], ([3, 4], keys[split:]), *others[3:]])]),
            (pool, [([], others[:2]), (keys[:split], [([3, 4], keys[split:])])]),
            (moved, [(keys[:split] + 1400, [([3, 4], keys[split:] + 1400), others[4]])]),
        ):
            out, lse = _attend(query, p, groups, dtype)
            assert torch.equal(out[[3, 4]], alone[0][[3, 4]]) and torch.equal(lse[[3, 4]], alone[1][[3, 4]])


def _runner_pool(model, capacity=256):
    dtype = next(model.parameters()).dtype
    return KVPool(KVLayout(dtype, tuple(hf.describe_layers(model))), capacity, "cpu")


def test_packed_forwards_use_the_kernel_for_short_segments_and_gather_for_prefill_chunks():
    model = tiny_model("llama", torch.float64)
    pool = _runner_pool(model)
    runner = PackedForward(model, pool)
    assert runner.attention.direct and runner.attention.direct_reason is None
    shared = pool.alloc(40)
    long = Segment(list(range(1, 31)), np.concatenate([shared, pool.alloc(30)]))  # a 30-token chunk
    short = Segment([5, 6], np.concatenate([shared, pool.alloc(2)]))
    # the short segment's keys all go to the kernel (the shared run once per group), the chunk's to the
    # cascade plan (its shared run read in place by the fused kernel, its own keys gathered) ...
    batch = PackedBatch(pool, [long, short], Cascade(runner.attention.min_run, direct=True))
    assert batch.direct.groups == 1 and list(batch.direct.arrays[2]) == list(shared)
    assert [p.rows for p in batch.cascade.runs] == [slice(0, 30)]
    assert [own.segments for own in batch.cascade.own] == [1]
    # ... and batch-invariant, the same, the chunk's to the blocks plan
    batch = PackedBatch(pool, [long, short], FixedCuts(direct=True, sizes=[32, 16]))
    assert batch.direct.groups == 1 and list(batch.direct.arrays[2]) == list(shared)
    assert isinstance(batch.cascade, FixedCutsPlan) and batch.cascade.plain == [0]  # it spans a cut


def test_where_the_kernel_cannot_be_built_packed_forwards_gather_and_say_why(monkeypatch, tmp_path):
    monkeypatch.setattr(kernel, "_state", {})
    monkeypatch.setenv("KVBLOCKS_HOME", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    assert kernel.library() is None
    assert "could not build or load the kernel: false failed" in kernel.reason()
    model = tiny_model("llama", torch.float32)
    runner = PackedForward(model, _runner_pool(model))
    assert not runner.attention.direct and "false failed" in runner.attention.direct_reason
    with pytest.raises(NotImplementedError, match="the attention kernel cannot be used: could not build"):
        PackedForward(model, _runner_pool(model), direct=True)
    monkeypatch.setattr(kernel, "_state", {})
    monkeypatch.setenv(kernel.ENV, "0")
    assert kernel.library() is None and kernel.reason() == "KVBLOCKS_KERNEL=0"
    monkeypatch.setattr(kernel, "_state", {})
    monkeypatch.delenv(kernel.ENV)
    monkeypatch.delenv("CXX")
    assert kernel.library() is not None  # built into the new home
    assert list(tmp_path.glob("kernels/attend-*.so"))


def test_the_kernel_is_refused_by_name_where_it_does_not_apply():
    model = tiny_model("llama", torch.float32)
    pool = KVPool(KVLayout(torch.bfloat16, tuple(hf.describe_layers(model))), 64, "cpu")
    assert "over a pool of their dtype (model torch.float32, pool torch.bfloat16)" in direct_refusal(
        model, pool
    )
    runner = PackedForward(model, _runner_pool(model), attention="per-segment")
    assert (
        not runner.attention.direct and runner.attention.direct_reason == "it serves cascade attention only"
    )
    assert not PackedForward(model, _runner_pool(model), direct=False).attention.direct


def test_kvblocks_stats_shows_whether_the_kernel_is_in_use():
    from rich.console import Console

    from kvblocks.cli.client import _rates, _stats_table

    now = {
        "model": "m",
        "engine": {"active": 1, "queued": 0, "cuda_graphs": None},
        "cache": {"capacity_tokens": 8},
    }
    console = Console(width=160, record=True)
    for direct, shown in (
        ({"in_use": True, "reason": None}, "in use"),
        ({"in_use": False, "reason": "KVBLOCKS_KERNEL=0"}, "off: KVBLOCKS_KERNEL=0"),
    ):
        now["engine"]["attention_kernel"] = direct
        console.print(_stats_table(now, _rates(now, None), "t"))
        assert shown in console.export_text()
