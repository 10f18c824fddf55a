"""The output head and the linear layers reordered for oneDNN (kvblocks.engine.head): used inside
packed forwards only, row for row the same at any row count from 4 up, within float rounding of
`F.linear`, and never stale."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_models import VOCAB, tiny_model

from kvblocks.adapters import hf
from kvblocks.cache.layout import KVLayout
from kvblocks.cache.pool import KVPool
from kvblocks.engine import gemm, head
from kvblocks.engine.attention.batch import Segment
from kvblocks.engine.attention.forward import PackedForward

pytestmark = pytest.mark.skipif(not head.available(), reason="this torch has no oneDNN linear")


def _head_input(model, rows: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, rows, model.config.hidden_size, generator=g)


def test_packed_rows_are_the_same_at_every_row_count_and_close_to_linear():
    model = tiny_model("llama")
    packed = head.PackedHead.of(model)
    assert packed is not None and packed is head.PackedHead.of(model)  # one per head
    x = _head_input(model, 40)[0]
    full = packed(x)
    for rows in (4, 5, 16, 39):
        assert torch.equal(packed(x[:rows]), full[:rows])
        assert torch.equal(packed(x[40 - rows :]), full[40 - rows :])
    plain = F.linear(x, model.get_output_embeddings().weight)
    torch.testing.assert_close(full, plain, rtol=1e-5, atol=1e-5)


def test_a_bfloat16_head_is_packed_where_onednn_or_the_kernel_has_bfloat16_and_stays_row_invariant():
    model = tiny_model("llama", torch.bfloat16)
    packed = head.PackedHead.of(model)
    if torch.bfloat16 not in head._dtypes() and gemm.library() is None:
        assert packed is None
        return
    assert packed is not None
    x = _head_input(model, 40)[0].to(torch.bfloat16)
    full = packed(x)
    assert full.dtype == torch.bfloat16
    for rows in (1, 2, 3, 5, 16, 39):
        assert torch.equal(packed(x[:rows]), full[:rows])
        assert torch.equal(packed(x[40 - rows :]), full[40 - rows :])
    plain = F.linear(x, model.get_output_embeddings().weight).detach()
    torch.testing.assert_close(full.float(), plain.float(), rtol=2**-7, atol=2**-7 * float(plain.abs().max()))


def test_only_forwards_in_scope_on_this_thread_take_the_packed_head():
    model = tiny_model("llama")
    module = model.get_output_embeddings()
    packed = head.PackedHead.of(model)
    x = _head_input(model, 7)
    plain = F.linear(x, module.weight)
    assert torch.equal(module(x), plain)
    with head.scope(packed):
        assert torch.equal(module(x), packed(x))
        seen = []
        other = threading.Thread(target=lambda: seen.append((module(x), F.linear(x, module.weight))))
        other.start()
        other.join()
        assert torch.equal(*seen[0])  # another thread keeps the plain head
    assert torch.equal(module(x), plain)


def test_a_weight_written_in_place_or_replaced_is_reordered_again():
    model = tiny_model("llama")
    module = model.get_output_embeddings()
    packed = head.PackedHead.of(model)
    x = _head_input(model, 4)[0]
    before = packed(x)
    with torch.no_grad():
        module.weight.mul_(2)
    torch.testing.assert_close(packed(x), 2 * before, rtol=1e-5, atol=1e-5)
    module.weight = torch.nn.Parameter(torch.zeros_like(module.weight))
    assert torch.equal(packed(x), torch.zeros_like(before))


def test_a_head_moved_to_another_dtype_falls_back_to_its_own_forward():
    model = tiny_model("llama")
    packed = head.PackedHead.of(model)
    model.to(torch.float64)
    x = _head_input(model, 3).double()
    with head.scope(packed):
        assert torch.equal(
            model.get_output_embeddings()(x), F.linear(x, model.get_output_embeddings().weight)
        )


def test_no_packed_head_off_float32_and_a_copied_model_keeps_a_plain_head():
    assert head.PackedHead.of(tiny_model("llama", torch.float64)) is None
    model = tiny_model("llama")
    packed = head.PackedHead.of(model)
    twin = copy.deepcopy(model)
    x = _head_input(model, 5)
    with head.scope(packed):
        out = twin.get_output_embeddings()(x)
    assert torch.equal(out, F.linear(x, twin.get_output_embeddings().weight))


@pytest.mark.parametrize("invariant", [False, True])
def test_packed_runner_logits_match_a_runner_without_the_packed_head(invariant):
    model = tiny_model("llama")
    layout = KVLayout(torch.float32, tuple(hf.describe_layers(model)))
    pool = KVPool(layout, 256, "cpu")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (9, 14, 20)]
    out = {}
    for packed in (True, False):
        runner = PackedForward(model, pool, invariant=invariant, packed_weights="all" if packed else "none")
        assert (runner.head is not None) is packed
        segments = [Segment(p, pool.alloc(len(p)), keep=len(p)) for p in prompts]
        out[packed] = runner.forward(segments)
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_linear_layer_is_packed_in_scope_only_and_rows_do_not_depend_on_the_row_count(dtype):
    model = tiny_model("qwen2", dtype)  # q/k/v carry biases
    packed = head.PackedLinears.of(model)
    assert packed is not None and packed is head.PackedLinears.of(model)  # one per model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert set(packed.layers) == set(linears)
    assert packed.nbytes == sum(m.weight.numel() * m.weight.element_size() for m in linears)
    g = torch.Generator().manual_seed(2)
    for module in linears:
        x = torch.randn(300, module.in_features, generator=g).to(dtype)
        plain = F.linear(x, module.weight, module.bias)
        assert torch.equal(module(x), plain)  # outside the scope: the layer's own forward
        with head.scope(packed):
            full = module(x)
            for rows in head.LAYER_PROBE_ROWS:
                assert torch.equal(module(x[:rows]), full[:rows])
        tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
        torch.testing.assert_close(full, plain, rtol=tol, atol=tol * float(plain.abs().max()))


def test_a_shape_whose_probe_fails_keeps_its_own_forward(monkeypatch):
    model = tiny_model("llama")
    calls = []

    def probe(self):
        calls.append((type(self), *self.module.weight.shape))
        return self.module.weight.shape[0] != 128  # the MLP's up and gate projections fail

    monkeypatch.setattr(head.PackedHead, "probe", probe)
    packed = head.PackedLinears.of(model)
    ups = [m for name, m in model.named_modules() if name.endswith(("up_proj", "gate_proj"))]
    assert ups and not set(ups) & set(packed.layers)
    assert len(calls) == len(set(calls))  # once per kind (the kernel's, oneDNN's) and shape
    x = torch.randn(5, 64)
    with head.scope(packed):
        assert torch.equal(ups[0](x), F.linear(x, ups[0].weight))


def test_a_bfloat16_packed_step_is_batch_invariant_and_greedy_equal_to_the_plain_layers():
    model = tiny_model("qwen2", torch.bfloat16)
    layout = KVLayout(torch.bfloat16, tuple(hf.describe_layers(model)))
    pool = KVPool(layout, 512, "cpu")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (9, 14, 20)]
    runner = PackedForward(model, pool, invariant=True, chunk=8)
    plain = PackedForward(model, pool, invariant=True, chunk=8, packed_weights="none")
    assert runner.head is not None and plain.head is None
    slots = [pool.alloc(len(p)) for p in prompts]
    together = runner.forward([Segment(p, s, keep=len(p)) for p, s in zip(prompts, slots)])
    for p, s, batched in zip(prompts, slots, together):
        alone = runner.forward([Segment(p, s, keep=len(p))])[0]
        assert torch.equal(alone, batched)
        reference = plain.forward([Segment(p, s, keep=len(p))])[0]
        assert torch.equal(alone.argmax(-1), reference.argmax(-1))


def test_packed_weights_choose_every_layer_the_head_only_or_none_and_say_what_they_cost():
    model = tiny_model("qwen2")
    layout = KVLayout(torch.float32, tuple(hf.describe_layers(model)))
    pool = KVPool(layout, 256, "cpu")
    every = PackedForward(model, pool, invariant=True, chunk=8, packed_weights="all").head
    only = PackedForward(model, pool, invariant=True, chunk=8, packed_weights="head").head
    assert isinstance(every, head.PackedLinears) and isinstance(only, head.PackedHead)
    assert PackedForward(model, pool, invariant=True, chunk=8, packed_weights="none").head is None
    weight = model.get_output_embeddings().weight
    assert only.nbytes == weight.numel() * weight.element_size()
    linears = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert only.nbytes < every.nbytes <= linears
    with pytest.raises(ValueError, match="packed_weights must be one of all, head, none"):
        PackedForward(model, pool, invariant=True, chunk=8, packed_weights="some")
