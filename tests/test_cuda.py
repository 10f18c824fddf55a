"""On a CUDA device: cached greedy output equals uncached, packed equals one request at a time, and
Redis restores land in device memory bit for bit.

Every test is marked `cuda` and skips where no CUDA device is present. `KVBLOCKS_TEST_DEVICE=cpu`
runs the same bodies on the CPU, which is how they are checked on a machine without a GPU.
`scripts/device-check` runs them on a lent H100/H200.

float32 asserts identical greedy tokens against plain transformers (TF32 off: cuBLAS and cuDNN
would otherwise round float32 products to 10-bit mantissas). bfloat16 logits of a prompt split
in two differ from one call by ~1e-1 (matmul shapes), so a greedy token may flip where the top-2
margin is that small: the bf16 test asserts that the cache was hit and reports flips with their
margins (as JSON lines to `$KVBLOCKS_CUDA_REPORT` when set) instead of asserting equality.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import numpy as np
import pytest
import torch
from conftest import IdTokenizer
from test_batch_engine import run_all, workload
from tiny_models import VOCAB, random_ids, tiny_model
from transformers import DynamicCache

from kvblocks import CachedGenerator, GenerationParams, KVCacheTrie, RedisTier
from kvblocks.engine.batch import BatchEngine
from kvblocks.engine.loop import Engine

DEVICE = os.environ.get("KVBLOCKS_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(),
        reason="no CUDA device (KVBLOCKS_TEST_DEVICE=cpu runs these tests on the CPU)",
    ),
]

# three attention families (mistral with a sliding window shorter than the prompts) and a hybrid
# whose conv state is restored from snapshots
ARCHITECTURES = ("llama", "qwen3", "mistral", "lfm2")
NEW_TOKENS = 8
SNAPSHOT_EVERY = 16


@pytest.fixture(autouse=True, scope="module")
def exact_float32():
    """float32 products in full float32 on CUDA (matmul and cuDNN convolutions, lfm2's conv)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def model_on_device(arch: str, dtype: torch.dtype):
    return tiny_model(arch, dtype).to(DEVICE)


@dataclass(slots=True)
class Flip:
    """The first step where cached greedy decoding left the uncached one, with the uncached run's
    top-2 logit margin there (how close the token it chose was to a tie)."""

    arch: str
    dtype: str
    request: int
    step: int
    margin: float


@torch.inference_mode()
def uncached(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Plain transformers, no kvblocks: the whole prompt in one call, then one token per call.
    Returns the greedy tokens and each step's top-2 logit margin."""
    cache = DynamicCache(config=model.config)
    step = torch.tensor([ids], device=DEVICE)
    tokens, margins = [], []
    while len(tokens) < n:
        row = model(input_ids=step, past_key_values=cache, use_cache=True).logits[0, -1].float()
        top = row.topk(2).values
        tokens.append(int(row.argmax()))
        margins.append(float(top[0] - top[1]))
        step = torch.tensor([[tokens[-1]]], device=DEVICE)
    return tokens, margins


def conversation(seed: int) -> list[list[int]]:
    """Two prompts sharing a 40-token prefix (longer than any sliding window and than two snapshot
    intervals), a third that continues the first with its reply (filled in by `run_conversation`)."""
    prefix = random_ids(40, seed)
    return [prefix + random_ids(7, seed + 1), prefix + random_ids(9, seed + 2)]


def run_conversation(arch: str, dtype: torch.dtype) -> tuple[list[Flip], list[int]]:
    """Three greedy requests through one trie; each is compared with `uncached`. Returns the flips
    and each request's cached-token count."""
    model = model_on_device(arch, dtype)
    trie = KVCacheTrie.for_model(model, capacity_tokens=4096, snapshot_every=SNAPSHOT_EVERY)
    assert trie.pool.device.type == torch.device(DEVICE).type
    generator = CachedGenerator(model, IdTokenizer(), trie)
    prompts = conversation(seed=7)
    flips, cached, replies = [], [], []
    for i in range(3):
        if i == 2:  # the next turn of the first conversation: its reply is cached by id
            prompts.append(prompts[0] + replies[0] + random_ids(5, seed=9))
        result = generator.generate(prompts[i], max_new_tokens=NEW_TOKENS, ignore_eos=True)
        replies.append(result.token_ids)
        cached.append(result.cached_tokens)
        want, margins = uncached(model, prompts[i], NEW_TOKENS)
        diff = next((k for k, (a, b) in enumerate(zip(result.token_ids, want)) if a != b), None)
        if diff is not None:
            flips.append(Flip(arch, str(dtype).removeprefix("torch."), i, diff, margins[diff]))
    assert trie.stats()["locked_tokens"] == 0
    return flips, cached


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_float32_greedy_tokens_cached_equal_uncached(arch):
    flips, cached = run_conversation(arch, torch.float32)
    assert cached[1] > 0 and cached[2] > len(conversation(7)[0]), f"{arch}: the cache was not hit: {cached}"
    assert not flips, f"{arch}: cached greedy tokens left the uncached ones: {flips}"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_bfloat16_flips_are_reported_with_their_margins(arch):
    flips, cached = run_conversation(arch, torch.bfloat16)
    assert cached[1] > 0 and cached[2] > 0, f"{arch}: the cache was not hit: {cached}"
    report = os.environ.get("KVBLOCKS_CUDA_REPORT")
    if report:
        with open(report, "a") as f:
            line = {"test": "bf16-cached-vs-uncached", "arch": arch, "requests": 3, "tokens": NEW_TOKENS}
            f.write(json.dumps(line | {"flips": [asdict(x) for x in flips]}) + "\n")


@pytest.mark.parametrize(
    "attention, graphs",
    [(None, None), (None, False), ("cascade", None), ("per-segment", None)],
    ids=["default", "grouped-no-graphs", "cascade", "per-segment"],
)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_packed_engine_gives_one_request_per_forward_tokens_on_the_device(arch, attention, graphs):
    """The device's default (CUDA graphs replaying padded layouts, decodes grouped into one call per
    layer where a layout does not fit), the same without graphs, cascade attention (a stored prefix of
    48 tokens read in place and merged by log-sum-exp) and one call per request: each gives every
    request the tokens of one request per forward, in float32. By default on CUDA the forwards
    replay graphs (captured once per layout), and no capture fails."""
    model = model_on_device(arch, torch.float32)
    shared = random_ids(48, seed=11)
    prompts = workload(seed=3, n=4) + [shared + random_ids(3 + i, seed=20 + i) for i in range(5)]
    params = [GenerationParams(max_new_tokens=NEW_TOKENS, ignore_eos=True) for _ in prompts]
    results, packed = {}, _packed(model, attention, graphs)
    for name, engine in (("packed", packed), ("one-at-a-time", _one_at_a_time(model))):
        engine.start()
        try:
            results[name] = [r["tokens"] for r in run_all(engine, prompts, params)]
        finally:
            engine.stop()
    assert results["packed"] == results["one-at-a-time"]
    assert all(len(t) == NEW_TOKENS for t in results["packed"])
    stats = packed.graph_stats()
    if DEVICE == "cuda" and attention is None and graphs is None:
        assert stats["disabled"] is None and stats["captures"] > 0 and stats["replays"] > stats["captures"]
        report = os.environ.get("KVBLOCKS_CUDA_REPORT")
        if report:
            with open(report, "a") as f:
                f.write(json.dumps({"test": "cuda-graphs", "arch": arch} | stats) + "\n")
    else:
        assert stats is None


def _packed(model, attention: str | None = None, graphs: bool | None = None) -> BatchEngine:
    trie = KVCacheTrie.for_model(model, capacity_tokens=2048)
    generator = CachedGenerator(model, IdTokenizer(), trie)
    return BatchEngine(
        generator, max_batch_size=4, max_batch_tokens=24, attention=attention, cuda_graphs=graphs
    )


def _one_at_a_time(model) -> Engine:
    return Engine(CachedGenerator(model, IdTokenizer(), KVCacheTrie.for_model(model, capacity_tokens=2048)))


@torch.inference_mode()
def test_redis_restore_lands_in_device_memory_bit_for_bit(redis_url):
    """A second trie with an empty pool (another process's view) restores the prefix from Redis into
    its device pool: the re-attached KV equals what the first trie computed, and greedy tokens
    equal a run without any cache."""
    model = model_on_device("llama", torch.float32)
    ids = np.random.default_rng(5).integers(0, VOCAB, 70).tolist()
    tiers = [RedisTier(redis_url, chunk_tokens=16, timeout_s=2.0) for _ in range(2)]
    try:
        writer, reader = (KVCacheTrie.for_model(model, capacity_tokens=1024, spill=t) for t in tiers)
        CachedGenerator(model, IdTokenizer(), writer).generate(ids, max_new_tokens=1)
        assert tiers[0].flush(timeout_s=10)
        head = ids[:65]  # four whole chunks (a match leaves the last token uncached)
        with writer.match(head) as original, reader.match(head) as restored:
            assert restored.length == original.length == 64
            a, b = original.to_hf_cache(), restored.to_hf_cache()
            for x, y in zip(a.layers, b.layers):
                assert y.keys.device.type == torch.device(DEVICE).type
                assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
        assert reader.stats()["spill_hit_tokens"] == 64
        result = CachedGenerator(model, IdTokenizer(), reader).generate(
            ids, max_new_tokens=NEW_TOKENS, ignore_eos=True
        )
        assert result.cached_tokens == 64
        assert result.token_ids == uncached(model, ids, NEW_TOKENS)[0]
    finally:
        for t in tiers:
            t.close()


@torch.inference_mode()
def test_host_tier_write_back_restores_evicted_kv_into_device_memory_bit_for_bit():
    """Write-back into a HostTier: chunks leaving the device pool are copied to (pinned) host memory
    asynchronously, and a later lookup restores them from the host tier into the device pool, equal
    to what was computed; greedy tokens equal a run without any cache."""
    from kvblocks.spill.host import HostTier
    from kvblocks.spill.stack import TierStack

    model = model_on_device("llama", torch.float32)
    ids = np.random.default_rng(6).integers(0, VOCAB, 70).tolist()
    stack = TierStack([HostTier(64 << 20)], chunk_tokens=16, write_policy="write-back")
    try:
        cache = KVCacheTrie.for_model(model, capacity_tokens=1024, spill=stack)
        plain = KVCacheTrie.for_model(model, capacity_tokens=1024)
        CachedGenerator(model, IdTokenizer(), cache).generate(ids, max_new_tokens=1)
        CachedGenerator(model, IdTokenizer(), plain).generate(ids, max_new_tokens=1)
        assert cache.clear() > 0  # the device evicts it all: write-back copies it to the host tier
        assert stack.flush(timeout_s=10)
        assert cache.stats()["host_written_chunks"] == 4
        head = ids[:65]
        with plain.match(head) as original, cache.match(head) as restored:
            assert restored.length == original.length == 64
            for x, y in zip(original.to_hf_cache().layers, restored.to_hf_cache().layers):
                assert y.keys.device.type == torch.device(DEVICE).type
                assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
        assert cache.stats()["host_hit_chunks"] == 4
        result = CachedGenerator(model, IdTokenizer(), cache).generate(
            ids, max_new_tokens=NEW_TOKENS, ignore_eos=True
        )
        assert result.token_ids == uncached(model, ids, NEW_TOKENS)[0]
    finally:
        stack.close()
