"""Opt-in int8 products on CPU (`--quantization int8`): fewer multiply-adds per token, approximate.

In float32 a token costs about two multiply-adds per weight, and on a CPU without AVX-512 the core's
fused multiply-adds are the bound, in prefill and in a decode step of 16 rows alike (Qwen2.5-Coder-
1.5B: about 3 GFLOP a token at 80-90 GFLOP/s; BENCHMARKS.md, weights). 8-bit integer products do
four multiply-adds in a float32 lane's width (`vpmaddubsw`), which is how llama.cpp's quantised
models run fast on such a core. This module runs a model's linear layers that way with FBGEMM's
dynamically quantised linear, as PyTorch ships it (`torch.ops.quantized.linear_dynamic`):

- weights: per output channel, symmetric, 7 bits (-63..63), quantised and packed once;
- activations: per token (per row), 8 bits, quantised on every call;
- products: integer sums in int32, then scaled back in float32.

FBGEMM picks one activation range for the whole input (its min and max), which would make a row's
rounding depend on the other rows. So each row is first divided by its own largest magnitude, and one
extra row holding +1 and -1 pins the input's range to [-1, 1]: the range, and with it every row's
quantisation, is then the same whatever else is in the batch, and the row's result is multiplied back
by its magnitude (and the bias added) afterwards. oneDNN's quantised linear (`torch.ops.onednn`) takes
a scale per input and needs no such pin, but at 16 rows it ran the 1.5B's layers 1.3-1.7x slower
than FBGEMM on an AVX2 core, and a decode step is 16 rows (BENCHMARKS.md, quantization).

Why 7-bit weights: without VNNI the product multiplies unsigned 8-bit activations by signed 8-bit
weights and adds pairs in 16 bits with saturation; 2 x 255 x 63 = 32,130 fits, 2 x 255 x 127 does
not, and a saturated sum would be silently wrong. Measured on the real Qwen2.5-Coder-0.5B, 7-bit
weights with 8-bit activations keep the fp32 model's next token more often than the reverse.

Exactness scope. The output is not the float model's: it is another, quantised model, labelled so
in every response (`quantization`) and in its own cache namespace (the fingerprint hashes the
quantised weights, `weight_digest`). Within it the guarantees hold: a row's integer sums are exact
whatever the row count, its blocking or the other rows, and its scales depend on that row alone, so
a request's products are the same batched or alone, cached or not. `probe` checks that once per
shape before a model is served (1 to 300 rows), and a failure refuses the quantisation by name.

The bound: the int8 copy is a quarter of the float32 weights (the float weights of the quantised
layers are dropped; a head tied to the input embeddings keeps them there), plus a float32 scale per
output channel. The output head is quantised too: on Qwen2.5-Coder-1.5B it is 233M weights, and in
int8 a 16-row decode step's head took 52 ms against 128 ms packed in float32 (1 row: 19 against
72 ms), with the teacher-forced next tokens as close to the float model's (0.982 against 0.979 with
a float head, mean KL 0.0048 against 0.0037 nats; BENCHMARKS.md, quantization).
"""

from __future__ import annotations

import functools
import warnings

import torch
import xxhash

SCHEMES = ("none", "int8")
WEIGHT_MAX = 63  # 7 bits: no 16-bit pair sum of u8 x s8 can saturate (2 * 255 * 63 < 2**15)
ENGINE = "fbgemm"
PROBE_ROWS = (1, 2, 4, 5, 16, 17, 64)  # each must match the same rows of a 300-row product
PROBE_TOLERANCE = 0.05  # relative error against the float product on random inputs (measured ~0.02)


class QuantizationError(ValueError):
    """A model or machine this quantisation cannot serve exactly (said by name)."""


@functools.cache
def available() -> bool:
    """Whether this torch has FBGEMM's dynamically quantised linear (x86 CPU builds)."""
    ops = torch.ops.quantized
    return (
        ENGINE in torch.backends.quantized.supported_engines
        and hasattr(ops, "linear_prepack")
        and hasattr(ops, "linear_dynamic")
    )


class Int8Linear(torch.nn.Module):
    """A linear layer as int8 weights and per-token int8 activations (see the module's notes).

    `weight_scale` (float32, one per output channel) and `weight_digest` (16 bytes: the int8 weights'
    and scales' hash) are buffers, so the model's fingerprint, and with it its cache namespace, is
    that of the quantised weights; the packed weight is FBGEMM's opaque copy, not a buffer."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().to(torch.float32)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / WEIGHT_MAX
        q = torch.round(w / scale[:, None]).clamp_(-WEIGHT_MAX, WEIGHT_MAX).to(torch.int8)
        digest = xxhash.xxh3_128(b"int8:w7a8:fbgemm-pinned:")  # the scheme names the namespace too
        digest.update(q.numpy().data)
        digest.update(scale.numpy().data)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_digest", torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8))
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(torch.float32), False)
        pin = torch.zeros(1, self.in_features)
        pin[0, 0], pin[0, -1] = 1.0, -1.0
        self._pin = pin  # the extra row that fixes the input's range to [-1, 1]
        zero = torch.zeros(self.out_features, dtype=torch.int64)
        previous = torch.backends.quantized.engine
        try:
            torch.backends.quantized.engine = ENGINE
            with warnings.catch_warnings():  # quantised tensors are deprecated in torch; the op is not gone
                warnings.simplefilter("ignore")
                weight = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
                self._packed = torch.ops.quantized.linear_prepack(weight, None)
        finally:
            torch.backends.quantized.engine = previous

    @property
    def nbytes(self) -> int:
        """Bytes of the int8 weights and their scales."""
        return self.in_features * self.out_features + 4 * self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).to(torch.float32)
        size = rows.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        pinned = torch.cat([rows / size, self._pin])
        y = torch.ops.quantized.linear_dynamic(pinned, self._packed, False)[:-1]
        y = y * size if self.bias is None else torch.addcmul(self.bias, y, size)
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
    """Replace every linear layer of `model`, its output head included, with an `Int8Linear`;
    returns how many. Raises `QuantizationError` where it cannot serve (not CPU, no FBGEMM, a probe
    fails). "none" does nothing. Run it before the model's cache is made (the namespace hashes the
    result)."""
    if name not in SCHEMES:
        raise QuantizationError(f"unknown quantization '{name}'; choose one of {', '.join(SCHEMES)}")
    if name == "none":
        return 0
    if scheme(model) == name:
        return 0
    if not available():
        raise QuantizationError(
            "--quantization int8 needs a torch with FBGEMM's quantised linear (x86 CPU builds)"
        )
    found = [
        (parent, child_name, child)
        for parent in model.modules()
        for child_name, child in parent.named_children()
        if type(child) is torch.nn.Linear and child.in_features > 1
    ]
    devices = {child.weight.device.type for _, _, child in found}
    if devices - {"cpu"}:
        raise QuantizationError(
            f"--quantization int8 runs on CPU only (FBGEMM); the model is on {', '.join(sorted(devices))}"
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
    setattr(model, "kvblocks_quantization", name)  # noqa: B010  # nn.Module's typed __setattr__
    return len(found)


def nbytes(model: torch.nn.Module) -> int:
    """Bytes of the model's int8 weights and scales (0 if not quantised)."""
    return sum(m.nbytes for m in model.modules() if isinstance(m, Int8Linear))
