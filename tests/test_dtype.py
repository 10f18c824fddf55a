"""The dtype a model runs in: `--dtype auto` decided per machine, and bf16 kept exact where it is served.

bf16 is served by the batch-invariant packed engine only, without speculative rounds
(`kvblocks.cli.build.half_refusal`): there a request's rows round the same alone, in a batch and
after a cache hit (device or Redis), so its greedy tokens and log-probabilities are bit-identical
across all of them. These tests check that on tiny random models of the families the real models are (llama,
qwen2), with prompts that cross several of the engine's 64-position cuts and a 256-position block,
and on the real SmolLM2; and that every other configuration refuses an explicit bf16 by name and
turns `auto` into float32.
"""

from __future__ import annotations

import json
import threading

import httpx
import numpy as np
import pytest
import torch
from conftest import IdTokenizer
from redis_server import RedisServer
from server_proc import start_server, stop_cleanly, tiny_model_dir
from tiny_models import VOCAB, tiny_model

from kvblocks import CachedGenerator, GenerationParams, KVCacheTrie, models
from kvblocks.cli.build import serve_dtype
from kvblocks.cli.commands import build_parser, main
from kvblocks.engine.batch import BatchEngine
from kvblocks.engine.scheduler import CHUNK

NATIVE = models.native_bf16()


# ---- the default dtype ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        ("fpu sse avx2 avx512f avx512bw", False),
        ("fpu avx512f avx512_bf16 avx512_vnni", True),
        ("fpu amx_bf16 amx_tile amx_int8", True),
        ("fpu avx512_bf16x", False),  # a flag is a whole word
    ],
)
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path, flags, native):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: some cpu avx512_bf16\nflags\t\t: {flags}\n\n")
    assert models.native_bf16(info) is native


def test_auto_is_bf16_on_a_cpu_with_native_bf16_and_float32_elsewhere(monkeypatch):
    monkeypatch.setattr(models, "native_bf16", lambda: True)
    assert models.default_dtype("cpu") == "bfloat16"
    assert models.default_dtype("cuda:0") == models.default_dtype("cuda") == "float32"
    monkeypatch.setattr(models, "native_bf16", lambda: False)
    assert models.default_dtype("cpu") == "float32"


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", "--model", str(tiny_model_dir()), *argv])


REFUSALS = [
    (["--max-batch-size", "1"], "--max-batch-size 1"),
    (["--no-cache"], "--no-cache"),
    (["--no-batch-invariant"], "--no-batch-invariant"),
    (["--draft", "lookup"], "with --draft"),  # SmolLM2 bf16: 1 of 6 greedy replies changed
    (["--device", "cuda"], "not exact on cuda"),
]


@pytest.mark.parametrize(("argv", "named"), REFUSALS[:4])  # on cuda auto is float32 from the start
def test_auto_falls_back_to_float32_where_bf16_is_not_exact_and_says_why(argv, named, monkeypatch, capsys):
    monkeypatch.setattr(models, "native_bf16", lambda: True)
    args = serve_args(*argv)
    assert serve_dtype(args) == args.dtype == "float32"
    assert named in capsys.readouterr().err
    assert serve_dtype(serve_args()) == "bfloat16"  # the same machine, the packed engine's defaults
    assert serve_dtype(serve_args("--device", "cuda")) == "float32"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(("argv", "named"), REFUSALS)
def test_serve_refuses_an_explicit_half_dtype_where_it_is_not_exact_by_name(argv, named, dtype, capsys):
    assert main(["serve", "--port", "0", "--model", str(tiny_model_dir()), "--dtype", dtype, *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and f"--dtype {dtype}:" in err and named in err, err


def test_serve_refuses_bf16_for_a_family_without_the_packed_engine(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bloom", "hidden_size": 64, "n_head": 4}))
    assert main(["serve", "--port", "0", "--model", str(tmp_path), "--dtype", "bfloat16"]) == 2
    assert "model type 'bloom' has no path" in capsys.readouterr().err
    assert main(["serve", "--port", "0", "--dtype", "bf16"]) == 2
    assert "unknown --dtype 'bf16'" in capsys.readouterr().err


def test_the_server_reports_the_dtype_auto_chose_at_start_and_in_its_info():
    expected = "bfloat16" if NATIVE else "float32"
    server = start_server("--model", str(tiny_model_dir()), "--dtype", "auto")
    try:
        with httpx.Client(base_url=server.url) as c:
            infos = [c.get(path).json() for path in ("/model_info", "/server_info")]
        assert [info["dtype"] for info in infos] == [expected, expected]
        assert f" in {expected} on http://" in server.stderr()
    finally:
        stop_cleanly(server)


# ---- bf16 exactness in the packed engine ---------------------------------------------------------


def run(engine: BatchEngine, prompts: list[list[int]], params: GenerationParams) -> list[tuple]:
    """Every prompt submitted at once; each request's tokens, exact log-probabilities and result."""
    out: list[tuple | None] = [None] * len(prompts)
    done = [threading.Event() for _ in prompts]

    def emitter(i: int):
        tokens: list[int] = []
        logprobs: list = []

        def emit(item):
            assert not isinstance(item, BaseException), item
            tokens.extend(item.token_ids)
            logprobs.extend((lp.token, lp.logprob, list(lp.top)) for lp in item.logprobs or [])
            if item.result is not None:
                out[i] = (tokens, logprobs, item.result)
                done[i].set()

        return emit

    for i, p in enumerate(prompts):
        engine.submit(p, emitter(i), params=params)
    for event in done:
        assert event.wait(300), "a request never finished"
    return out


def invariant_engine(model, tokenizer, spill=None) -> BatchEngine:
    """The server's default engine (batch-invariant, prompts cut every 64 positions), small budget."""
    cache = KVCacheTrie.for_model(model, capacity_tokens=4096, spill=spill)
    gen = CachedGenerator(model, tokenizer, cache)
    return BatchEngine(gen, max_batch_size=4, max_batch_tokens=CHUNK + 16, invariant=True).start()


def bits(results: list[tuple]) -> list[tuple]:
    return [(tokens, logprobs) for tokens, logprobs, _ in results]


def alone(model, tokenizer, prompts, params) -> list[tuple]:
    """Each prompt in an engine of its own with an empty cache: the uncached reference."""
    out = []
    for p in prompts:
        engine = invariant_engine(model, tokenizer)
        try:
            out += run(engine, [p], params)
        finally:
            engine.stop()
    return out


def long_prompts(n: int = 3) -> list[list[int]]:
    """Prompts of 290-330 tokens sharing their first 150 (a system prompt): each crosses four
    64-position cuts and holds a 256-position block, and the shared prefix ends inside a chunk."""
    rng = np.random.default_rng(43)
    shared = rng.integers(0, VOCAB, 150).tolist()
    return [shared + rng.integers(0, VOCAB, int(rng.integers(140, 180))).tolist() for _ in range(n)]


def assert_alone_bits_batched_and_cached(model) -> None:
    """Tokens and log-probabilities compared bit for bit: each request alone in an empty cache
    against all at once (the shared prefix hit) and all again (full hits)."""
    prompts, params = long_prompts(), GenerationParams(max_new_tokens=12, logprobs=2)
    reference = alone(model, IdTokenizer(), prompts, params)
    assert len({tuple(tokens) for tokens, _ in bits(reference)}) > 1  # the replies differ: a real check
    engine = invariant_engine(model, IdTokenizer())
    try:
        together = run(engine, prompts, params)
        again = run(engine, prompts, params)
    finally:
        engine.stop()
    assert bits(together) == bits(reference)
    assert sum(r.cached_tokens > 0 for *_, r in together) >= 1
    assert bits(again) == bits(reference)
    assert all(r.cached_tokens >= len(p) - 1 for p, (*_, r) in zip(prompts, again))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_requests_get_their_alone_uncached_bits_batched_and_cached(arch):
    assert_alone_bits_batched_and_cached(tiny_model(arch, torch.bfloat16))


def test_a_bf16_prefix_restored_from_redis_gives_the_recomputed_bits(tmp_path):
    """One engine computes the prompts and spills them; an engine with an empty pool restores the
    prefixes from Redis: its bf16 tokens and log-probabilities equal the requests' alone."""
    from kvblocks.spill.redis_tier import RedisTier

    model = tiny_model("qwen2", torch.bfloat16)
    prompts, params = long_prompts(2), GenerationParams(max_new_tokens=8, logprobs=2)
    reference = alone(model, IdTokenizer(), prompts, params)
    with RedisServer(tmp_path).start() as server:
        writer = RedisTier(server.url, chunk_tokens=CHUNK)
        engine = invariant_engine(model, IdTokenizer(), spill=writer)
        try:
            run(engine, prompts, params)
        finally:
            engine.stop()
        assert writer.flush()
        writer.close()
        reader = RedisTier(server.url, chunk_tokens=CHUNK)
        engine = invariant_engine(model, IdTokenizer(), spill=reader)
        try:
            restored = run(engine, prompts, params)
            stats = engine.cache.stats()
        finally:
            engine.stop()
            reader.close()
    assert stats["spill_hit_tokens"] >= 4 * CHUNK and stats["redis_verify_failures"] == 0
    assert bits(restored) == bits(reference)


def test_the_real_model_in_bf16_gets_its_alone_bits_batched_and_cached():
    """SmolLM2-135M-Instruct in bf16: chat turns sharing a ~320-token system prompt, alone vs all
    at once vs all again, greedy tokens and log-probabilities bit for bit."""
    from kvblocks.bench.server import system_prompt
    from kvblocks.generate.text import encode_prompt

    model, tokenizer = models.load(None, "bfloat16", "cpu")
    system = system_prompt(tokenizer, 300)
    questions = ("where is my parcel?", "can I change the address?", "why was I charged twice?")
    prompts = [
        encode_prompt(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in questions
    ]
    params = GenerationParams(max_new_tokens=16, logprobs=2, ignore_eos=True)
    reference = alone(model, tokenizer, prompts, params)
    engine = invariant_engine(model, tokenizer)
    try:
        together = run(engine, prompts, params)
        again = run(engine, prompts, params)
    finally:
        engine.stop()
    assert bits(together) == bits(reference) and bits(again) == bits(reference)
    assert all(r.cached_tokens > 0 for *_, r in together[1:])
    assert all(r.cached_tokens >= len(p) - 1 for p, (*_, r) in zip(prompts, again))


@pytest.mark.parametrize(
    "dtype, serial",
    [
        (torch.bfloat16, {"params": GenerationParams(max_new_tokens=1, prompt_logprobs=1)}),
        (torch.bfloat16, {"params": GenerationParams(max_new_tokens=1), "output_logits": True}),
        (
            torch.bfloat16,
            {"params": GenerationParams(max_new_tokens=1, kv_mode="blend", blend_recompute=1.0)},
        ),
        (torch.bfloat16, {"store_block": True}),
        (torch.float32, {"params": GenerationParams(max_new_tokens=1, prompt_logprobs=1)}),
    ],
    ids=["bf16-prompt-logprobs", "bf16-output-logits", "bf16-blend", "bf16-kv-block", "fp32-prompt-logprobs"],
)
def test_kv_of_the_one_request_path_never_changes_a_later_packed_request(dtype, serial):
    """A request the packed path does not serve (prompt log-probabilities, raw logits, KV blocks) is
    computed by other kernels (a KV block goes to the block store, which exact requests never read).
    The batch-invariant engine keeps its KV out of the trie in every dtype (shared, it changed a later
    request's log-probabilities in bf16, and in float32 on an AVX2 CPU), so a later request on the
    same prefix gets the bits it gets alone on an empty engine."""
    model = tiny_model("qwen2", dtype)
    prompt, follow = long_prompts(2)
    later = prompt + follow[150:]  # the serial request's whole prompt, then more
    params = GenerationParams(max_new_tokens=12, logprobs=2)
    reference = alone(model, IdTokenizer(), [later], params)
    engine = invariant_engine(model, IdTokenizer())
    try:
        done = threading.Event()
        engine.submit(prompt, lambda item: getattr(item, "result", item) is not None and done.set(), **serial)
        assert done.wait(300)
        assert engine.one_at_a_time == 1  # it took the one-request path
        after = run(engine, [later], params)
    finally:
        engine.stop()
    assert bits(after) == bits(reference)
    assert after[0][2].cached_tokens == 0
