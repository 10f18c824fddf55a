"""`--quantization int8`: int8 products that never saturate, the same for a row at every row count,
a model of its own (namespace, labels), and inside it the server's guarantees: a request's tokens
and log-probabilities are the same batched, cached and alone."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from conftest import IdTokenizer, tiny_llama
from server_proc import start_server, stop_cleanly, tiny_model_dir
from test_dtype import assert_alone_bits_batched_and_cached
from tiny_models import tiny_model

from kvblocks import CachedGenerator, KVCacheTrie, models
from kvblocks.cache.namespace import namespace_for
from kvblocks.cli import args as cli_args
from kvblocks.cli.commands import main
from kvblocks.engine import quant
from kvblocks.specdec import ModelDrafter, PromptLookupDrafter, SpeculativeGenerator, TreeShape

pytestmark = pytest.mark.skipif(not quant.available(), reason="this torch has no FBGEMM quantised linear")


def linear(k: int, n: int, bias: bool = True, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n, bias=bias)


def test_a_row_is_the_same_at_every_row_count_and_near_the_float_product():
    layer = linear(96, 200)
    q = quant.Int8Linear(layer)
    assert q.probe(layer) is None
    x = torch.randn(300, 96, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = q(x)
        for rows in (1, 3, 4, 7, 16, 33, 128, 299):
            assert torch.equal(q(x[:rows]), full[:rows])
            assert torch.equal(q(x[rows - 1 : rows + 1]), full[rows - 1 : rows + 1])  # any neighbours
        assert torch.equal(q(x.view(3, 100, 96)), full.view(3, 100, 200))  # a batch of sequences
        plain = layer(x)
    assert float((full - plain).norm() / plain.norm()) < 0.03


def reference(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The scheme's product in float64 from its integers, written out independently of FBGEMM: each
    row over its largest magnitude, in [-1, 1] quantised to u8 (scale 2/255, zero point 128), in
    float32 as FBGEMM rounds it."""
    w = layer.weight.detach().double()
    sw = w.abs().amax(1) / quant.WEIGHT_MAX
    qw = torch.round(w / sw[:, None]).clamp(-quant.WEIGHT_MAX, quant.WEIGHT_MAX)
    size = x.abs().amax(1, keepdim=True)
    sx = torch.tensor(2 / 255, dtype=torch.float32)  # FBGEMM multiplies by the float32 inverse
    qx = (torch.round(x / size * (1 / sx)) + 128).clamp(0, 255).double() - 128
    return (qx @ qw.T) * float(sx) * sw * size.double() + layer.bias.detach().double()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_sums_do_not_saturate(sign):
    """Every weight and activation at its largest magnitude: without VNNI a u8 x s8 pair is added in
    16 bits with saturation, which 8-bit weights would hit (2 x 255 x 127 > 32767); 7-bit ones
    cannot, so the sums are the integers' (a saturated one would be about half)."""
    layer = linear(512, 64)
    with torch.no_grad():
        layer.weight.fill_(0.5)
        layer.weight[::2] *= -1
    x = torch.full((4, 512), 3.0 * sign)
    x[1, ::2] *= -1  # alternating: the extremes of the u8 range side by side
    x[2, :256] *= -1
    got = quant.Int8Linear(layer)(x)
    torch.testing.assert_close(got.double(), reference(layer, x), rtol=1e-5, atol=1e-4)
    assert float(got[0].abs().min()) > 0.9 * 512 * 0.5 * 3


def test_random_products_are_the_schemes_integers():
    layer = linear(640, 48, seed=3)
    x = torch.randn(9, 640) * torch.logspace(-2, 2, 640)  # channels of very different sizes
    got, want = quant.Int8Linear(layer)(x).double(), reference(layer, x)
    # an activation a hair from a rounding edge may round the other way in FBGEMM's arithmetic: one
    # step of one element, at most (saturation or another scheme would be far off)
    step = 2 / 255 * layer.weight.detach().abs().amax().double() * x.abs().amax(1, keepdim=True).double()
    assert bool(((got - want).abs() <= 1e-5 + 1.01 * step).all())
    assert int(((got - want).abs() <= 1e-5 * want.abs() + 1e-5).all(1).sum()) >= 6  # most rows exactly


def test_a_row_scaled_by_a_power_of_two_scales_its_output_exactly():
    """A row's quantisation depends on its shape only: the row over its largest magnitude."""
    layer = linear(640, 48, bias=False, seed=3)
    q = quant.Int8Linear(layer)
    x = torch.randn(9, 640) * torch.logspace(-2, 2, 640)  # channels of very different sizes
    with torch.inference_mode():
        assert torch.equal(q(x * 8), q(x) * 8)
        assert torch.equal(q(x / 1024), q(x) / 1024)
        assert torch.equal(q(torch.zeros(2, 640)), torch.zeros(2, 48))  # a zero row is no division by 0


def test_quantize_replaces_every_linear_head_included_and_is_a_model_of_its_own():
    model = tiny_model("qwen2")
    plain = namespace_for(model)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert model.get_output_embeddings() in linears
    assert quant.quantize(model, "none") == 0 and quant.scheme(model) == "none"
    assert quant.quantize(model, "int8") == len(linears) > 0
    assert quant.scheme(model) == "int8"
    assert [m for m in model.modules() if type(m) is torch.nn.Linear] == []
    assert isinstance(model.get_output_embeddings(), quant.Int8Linear)
    assert sum(isinstance(m, quant.Int8Linear) for m in model.modules()) == len(linears)
    assert quant.nbytes(model) == sum(m.in_features * m.out_features + 4 * m.out_features for m in linears)
    quantized = namespace_for(model)
    assert quantized.model != plain.model and quantized.dtype == plain.dtype == "float32"
    assert quant.quantize(model, "int8") == 0  # once
    again = tiny_model("qwen2")  # the same weights quantised again: the same namespace (shared tiers)
    quant.quantize(again, "int8")
    assert namespace_for(again) == quantized
    with pytest.raises(quant.QuantizationError, match="unknown quantization 'int4'"):
        quant.quantize(model, "int4")


def test_a_probe_that_fails_refuses_the_quantization_by_name(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(quant, "PROBE_TOLERANCE", 0.0)
    with pytest.raises(quant.QuantizationError, match="int8 is not exact on this CPU: the int8 product is"):
        quant.quantize(model, "int8")
    assert quant.scheme(model) == "none"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_requests_get_their_alone_uncached_bits_batched_and_cached(arch):
    model = tiny_model(arch)
    quant.quantize(model, "int8")
    assert_alone_bits_batched_and_cached(model)


def test_the_real_model_quantised_keeps_most_of_its_next_tokens():
    """SmolLM2 on a chat reply it wrote itself, teacher-forced: the int8 model's next token is the
    float model's at most positions and its distribution stays close (measured 0.98 and 0.026 nats;
    BENCHMARKS.md, quantization, has the real 0.5B and 1.5B models)."""
    model, tokenizer = models.load(None, "float32")
    messages = [
        {"role": "user", "content": "Write a Python function that reverses a string, and explain it."}
    ]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    prompt = ids["input_ids"]
    with torch.inference_mode():
        text = model.generate(prompt, max_new_tokens=48, do_sample=False)
        want = F.log_softmax(model(text).logits[0, prompt.shape[1] - 1 : -1].float(), -1)
        quant.quantize(model, "int8")
        got = F.log_softmax(model(text).logits[0, prompt.shape[1] - 1 : -1].float(), -1)
    agree = float((want.argmax(-1) == got.argmax(-1)).float().mean())
    kl = float((want.exp() * (want - got)).sum(-1).mean())
    assert agree >= 0.85 and kl < 0.05, (agree, kl)


def test_the_server_labels_every_response_of_an_int8_model():
    server = start_server(
        "--model", str(tiny_model_dir()), "--served-model-name", "m", "--quantization", "int8"
    )
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        chat = client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        assert chat.model_extra["quantization"] == "int8"
        chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=4, stream=True))
        assert chunks and all(c.model_extra["quantization"] == "int8" for c in chunks)
        done = client.completions.create(model="m", prompt="hello", max_tokens=3)
        assert done.model_extra["quantization"] == "int8"
        response = client.responses.create(model="m", input="hi", max_output_tokens=4)
        assert response.model_extra["quantization"] == "int8"
        assert client.models.list().data[0].model_extra["quantization"] == "int8"
        with httpx.Client(base_url=server.url) as c:
            assert c.get("/server_info").json()["quantization"] == "int8"
        assert "with int8 weights" in server.stderr() and "approximate" in server.stderr()
    finally:
        stop_cleanly(server)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--dtype", "bfloat16"], "--quantization int8 runs its activations in float32"),
        (["--device", "cuda"], "--quantization int8 runs on CPU only (FBGEMM), not on cuda"),
    ],
)
def test_serve_refuses_what_int8_cannot_run_by_name(argv, named, capsys):
    model = str(tiny_model_dir())
    capsys.readouterr()  # the model's first writing reports its progress
    assert main(["serve", "--port", "0", "--model", model, "--quantization", "int8", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and named in err, err


def test_the_flags_offer_the_schemes_the_package_has():
    assert cli_args.QUANTIZATION_SCHEMES == quant.SCHEMES


@pytest.mark.parametrize("tree", [None, TreeShape(budget=8, depth=4, width=2)], ids=["chain", "tree"])
def test_int8_speculative_greedy_is_the_int8_targets_greedy(tree):
    """Verify forwards of several rows go through the same row-invariant int8 products as one-row
    steps: a float drafter's proposals, right or wrong, never change the quantised target's reply,
    and the cache the rounds fill gives the same reply again."""
    model = tiny_llama(torch.float32, seed=0, eos_token_id=2)
    quant.quantize(model, "int8")
    plain = CachedGenerator(model, IdTokenizer(), None, packed="all")
    cache = KVCacheTrie.for_model(model, capacity_tokens=4096)
    drafters = [PromptLookupDrafter(), ModelDrafter(tiny_llama(torch.float32, seed=1, eos_token_id=2))]
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3, 7, 1, 2]]
    wants = [plain.generate(prompt, max_new_tokens=16, ignore_eos=True).token_ids for prompt in prompts]
    drafted = 0
    for drafter in drafters:
        sg = SpeculativeGenerator(model, IdTokenizer(), cache, drafter, gamma=4, tree=tree)
        for prompt, want in zip(prompts, wants):
            for _ in range(2):  # the second from the cache the first filled
                r = sg.generate(prompt, max_new_tokens=16, ignore_eos=True)
                assert r.token_ids == want
                drafted += r.spec.drafted
    assert drafted > 0
