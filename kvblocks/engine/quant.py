"""Opt-in int8 products on CPU (`--quantization int8`): fewer multiply-adds per token, approximate.

In float32 a token costs about two multiply-adds per weight, and on a CPU without AVX-512 the core's
fused multiply-adds are the bound, in prefill and in a decode step of 16 rows alike (Qwen2.5-Coder-
1.5B: about 3 GFLOP a token at 80-90 GFLOP/s; BENCHMARKS.md, weights). 8-bit integer products do
four multiply-adds in a float32 lane's width (`vpmaddubsw`), which is how llama.cpp's quantised
models run fast on such a core. This module runs a model's linear layers that way with oneDNN's
quantised linear, the one PyTorch's own int8 CPU inference lowers to (`torch.ops.onednn`):

- weights: per output channel, symmetric, 7 bits (-63..63), quantised once and prepacked for oneDNN;
- activations: per token (per row), symmetric, 8 bits, quantised on every call;
- products: integer sums in int32, then scaled by the row's and the channel's scales in float32.

Why 7-bit weights: without VNNI the product multiplies unsigned 8-bit activations by signed 8-bit
weights and adds pairs in 16 bits with saturation; 2 x 255 x 63 = 32,130 fits, 2 x 255 x 127 does
not, and a saturated sum would be silently wrong. Measured on the real Qwen2.5-Coder-0.5B, 7-bit
weights with 8-bit activations keep the fp32 model's next token more often than the reverse
(BENCHMARKS.md, quantization).

Exactness scope. The output is not the float model's: it is another, quantised model, labelled so
in every response (`quantization`) and in its own cache namespace (the fingerprint hashes the
quantised weights, `weight_digest`). Within it the guarantees hold: a row's integer sums are exact
whatever the row count, its blocking or the other rows, and its scales depend on that row alone, so
a request's products are the same batched or alone, cached or not. `probe` checks that once per
shape before a model is served (1 to 300 rows), and a failure refuses the quantisation by name.

The bound: the int8 copy is a quarter of the float32 weights (the float weights of the quantised
layers are dropped), plus a float32 scale per output channel. The output head stays in the model's
dtype: it is read for the kept rows only, and its logits are what a reply is chosen from.
"""

from __future__ import annotations

import functools

import torch
import xxhash

SCHEMES = ("none", "int8")
WEIGHT_MAX = 63  # 7 bits: no 16-bit pair sum of u8 x s8 can saturate (2 * 255 * 63 < 2**15)
ACTIVATION_MAX = 127
_ZERO_POINT = 128  # activations travel as u8: q + 128
PROBE_ROWS = (1, 2, 4, 5, 16, 17, 64)  # each must match the same rows of a 300-row product
PROBE_TOLERANCE = 0.05  # relative error against the float product on random inputs (measured ~0.02)


class QuantizationError(ValueError):
    """A model or machine this quantisation cannot serve exactly (said by name)."""


@functools.cache
def available() -> bool:
    """Whether this torch has oneDNN's quantised linear (a CPU build with oneDNN)."""
    ops = torch.ops.onednn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "qlinear_prepack")
        and hasattr(ops, "qlinear_pointwise")
    )


class Int8Linear(torch.nn.Module):
    """A linear layer as int8 weights and per-token int8 activations (see the module's notes).

    `weight_scale` (float32, one per output channel) and `weight_digest` (16 bytes: the int8 weights'
    and scales' hash) are buffers, so the model's fingerprint, and with it its cache namespace, is
    that of the quantised weights; the prepacked weight is oneDNN's opaque copy, not a buffer."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().to(torch.float32)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / WEIGHT_MAX
        q = torch.round(w / scale[:, None]).clamp_(-WEIGHT_MAX, WEIGHT_MAX).to(torch.int8)
        digest = xxhash.xxh3_128(b"int8:w7a8:")
        digest.update(q.numpy().data)
        digest.update(scale.numpy().data)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_digest", torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8))
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(torch.float32), False)
        self._zero = torch.zeros(self.out_features, dtype=torch.int64)
        self._packed = torch.ops.onednn.qlinear_prepack(q, [16, self.in_features])

    @property
    def nbytes(self) -> int:
        """Bytes of the int8 weights and their scales."""
        return self.in_features * self.out_features + 4 * self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).to(torch.float32)
        scale = (
            rows.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / ACTIVATION_MAX
        )
        q = (
            torch.round(rows / scale)
            .clamp_(-ACTIVATION_MAX, ACTIVATION_MAX)
            .add_(_ZERO_POINT)
            .to(torch.uint8)
        )
        y = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, _ZERO_POINT, self._packed, self.weight_scale, self._zero,
            None, 1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip
        y = y * scale if self.bias is None else torch.addcmul(self.bias, y, scale)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 w7a8"

    def probe(self, linear: torch.nn.Linear) -> str | None:
        """Why this layer's product is not usable (None: it is): a row must come out the same in
        every row count of `PROBE_ROWS` as in 300 rows, and near `linear`'s float product."""
        g = torch.Generator().manual_seed(0)
        x = torch.randn(300, self.in_features, generator=g)
        with torch.inference_mode():
            full = self(x)
            for rows in PROBE_ROWS:
                if not torch.equal(self(x[:rows]), full[:rows]):
                    return f"a row's int8 product changes with the row count ({rows} rows vs 300)"
            plain = torch.nn.functional.linear(
                x, linear.weight.float(), None if linear.bias is None else linear.bias.float()
            )
            error = float((full - plain).norm() / plain.norm().clamp_min(torch.finfo(torch.float32).tiny))
        if not error <= PROBE_TOLERANCE:
            return f"the int8 product is {error:.3f} off the float one (relative; at most {PROBE_TOLERANCE})"
        return None


def scheme(model: torch.nn.Module) -> str:
    """The quantisation `quantize` gave `model` ("none" if it never ran)."""
    return getattr(model, "kvblocks_quantization", "none")


def quantize(model: torch.nn.Module, name: str = "int8") -> int:
    """Replace every linear layer of `model` but its output head with an `Int8Linear`; returns how
    many. Raises `QuantizationError` where it cannot serve (not CPU, no oneDNN, a probe fails).
    "none" does nothing. Run it before the model's cache is made (the namespace hashes the result)."""
    if name not in SCHEMES:
        raise QuantizationError(f"unknown quantization '{name}'; choose one of {', '.join(SCHEMES)}")
    if name == "none":
        return 0
    if scheme(model) == name:
        return 0
    if not available():
        raise QuantizationError("--quantization int8 needs a torch built with oneDNN (its quantised linear)")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = [
        (parent, child_name, child)
        for parent in model.modules()
        for child_name, child in parent.named_children()
        if type(child) is torch.nn.Linear and child is not head
    ]
    devices = {child.weight.device.type for _, _, child in found}
    if devices - {"cpu"}:
        raise QuantizationError(
            f"--quantization int8 runs on CPU only (oneDNN); the model is on {', '.join(sorted(devices))}"
        )
    checked: set[tuple[int, int, bool]] = set()
    for parent, child_name, child in found:
        layer = Int8Linear(child)
        shape = (child.in_features, child.out_features, child.bias is not None)
        if shape not in checked:
            why = layer.probe(child)
            if why is not None:
                raise QuantizationError(f"--quantization int8 is not exact on this CPU: {why}")
            checked.add(shape)
        setattr(parent, child_name, layer)
    model.kvblocks_quantization = name
    return len(found)


def nbytes(model: torch.nn.Module) -> int:
    """Bytes of the model's int8 weights and scales (0 if not quantised)."""
    return sum(m.nbytes for m in model.modules() if isinstance(m, Int8Linear))
