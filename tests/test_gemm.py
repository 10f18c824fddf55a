"""The bfloat16 and float32 products of few rows over weights packed once (`kvblocks.engine.gemm`,
csrc/linear.cpp): a row's result is the same at every row count and in every lane, close to torch's
product, and the packed layers take it for bfloat16 where it is built (float32 without AVX-512)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model

from kvblocks.engine import gemm, head
from kvblocks.models import cpu_flags

pytestmark = pytest.mark.skipif(gemm.library() is None, reason="no AVX512-BF16 here, or no compiler")


def _layer(n: int, k: int, bias: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    return w, (torch.randn(n, generator=g).to(torch.bfloat16) if bias else None)


@pytest.mark.parametrize(
    ("n", "k", "bias"), [(24, 64, False), (100, 96, True), (7, 2, True), (257, 130, False), (30, 1100, True)]
)
def test_a_row_is_the_same_at_every_row_count_and_close_to_torch(n, k, bias):
    w, b = _layer(n, k, bias)
    packed = gemm.pack(w)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    full = gemm.linear(x, packed, n, b)
    assert full.shape == (40, n) and full.dtype == torch.bfloat16
    for rows in (1, 2, 3, 4, 15, 16, 17, 33):
        assert torch.equal(gemm.linear(x[:rows], packed, n, b), full[:rows])  # fewer rows
        assert torch.equal(gemm.linear(x[40 - rows :], packed, n, b), full[40 - rows :])  # other lanes
    reference = F.linear(x.double(), w.double(), None if b is None else b.double())
    # float32 sums of bfloat16 products, rounded once to bfloat16: torch's product rounds alike
    torch.testing.assert_close(
        full.double(), reference, rtol=2**-8, atol=2**-8 * float(reference.abs().max())
    )
    torch_bf16 = F.linear(x, w, b).double()
    assert (full.double() - reference).abs().max() <= 2 * (torch_bf16 - reference).abs().max() + 1e-6


def test_inputs_of_any_layout_and_leading_shape_give_the_contiguous_rows_result():
    w, b = _layer(48, 32, True)
    packed = gemm.pack(w)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)[..., ::2]
    out = gemm.linear(x, packed, 48, b)
    assert out.shape == (2, 5, 48)
    assert torch.equal(out.reshape(10, 48), gemm.linear(x.reshape(10, 32).contiguous(), packed, 48, b))


def test_an_odd_number_of_input_features_is_refused_and_left_to_onednn():
    w, _ = _layer(8, 5, False)
    with pytest.raises(ValueError, match="even number of input features"):
        gemm.pack(w)
    layer = torch.nn.Linear(5, 8, bias=False).to(torch.bfloat16)
    assert not head.KernelLinear.eligible(layer)


def test_bfloat16_layers_take_the_kernel_and_float32_ones_where_the_cpu_has_no_avx512():
    packed = head.PackedLinears.of(tiny_model("qwen2", torch.bfloat16))
    assert packed is not None and all(isinstance(p, head.KernelLinear) for p in packed.layers.values())
    packed32 = head.PackedLinears.of(tiny_model("qwen2"))
    assert packed32 is not None
    kinds = {type(p) for p in packed32.layers.values()}
    assert kinds == ({head.KernelLinear} if gemm.float32() else {head.PackedHead})
    assert gemm.float32() == ("avx512f" not in (cpu_flags() or ()))  # built here: AVX2 and FMA


@pytest.mark.parametrize(
    ("n", "k", "bias"), [(24, 64, False), (100, 97, True), (7, 1, True), (257, 130, False)]
)
def test_a_float32_row_is_the_same_at_every_row_count_and_within_rounding_of_torch(n, k, bias):
    if not gemm.float32():
        pytest.skip("float32 layers keep oneDNN on a CPU with AVX-512")
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(n, k, generator=g), (torch.randn(n, generator=g) if bias else None)
    packed = gemm.pack(w)
    x = torch.randn(40, k, generator=g)
    full = gemm.linear(x, packed, n, b)
    assert full.shape == (40, n) and full.dtype == torch.float32
    for rows in (1, 2, 3, 4, 5, 15, 16, 17, 33):
        assert torch.equal(gemm.linear(x[:rows], packed, n, b), full[:rows])  # fewer rows
        assert torch.equal(gemm.linear(x[40 - rows :], packed, n, b), full[40 - rows :])  # other lanes
    reference = F.linear(x.double(), w.double(), None if b is None else b.double())
    # k float32 roundings of a chain of fused multiply-adds, as any float32 product has
    torch.testing.assert_close(
        full.double(), reference, rtol=0, atol=k * 2**-24 * float(reference.abs().max())
    )


def test_the_peak_rate_is_measured_for_both_dtypes():
    for dtype in (torch.bfloat16, torch.float32):
        rate = gemm.peak(dtype, seconds=0.02)
        assert rate is not None and rate > 1e8  # instructions per second of one core
    assert gemm.peak(torch.float64) is None
