"""The cache core takes layer specs and tensors: any `PastBridge` serves it, and importing it loads
neither transformers nor `kvblocks.adapters` (the transformers face is `kvblocks.KVCacheTrie`)."""

from __future__ import annotations

import subprocess
import sys

import torch

from kvblocks.cache.layout import LayerSpec
from kvblocks.cache.namespace import Namespace
from kvblocks.cache.trie import PrefixCache

SPECS = [LayerSpec("full", 2, 3), LayerSpec("none"), LayerSpec("sliding", 2, 3, window=4)]


class TensorBridge:
    """A framework whose cache is a list of per-layer `[T, 2, H, D]` tensors (None: nothing cached)."""

    min_prefill = 1

    def build(self, kv, length, state):
        return [None if t is None else t.clone() for t in kv]

    def extract(self, past, start, end):
        return [None if t is None else t[start:end] for t in past]

    def length(self, past):
        return past[0].shape[0]

    def capture(self, past):
        raise AssertionError("an attention-only model has no state to capture")


def past_of(n: int) -> list[torch.Tensor | None]:
    full = torch.arange(n * 12, dtype=torch.float64).reshape(n, 2, 2, 3)
    return [full, None, -full]


def test_the_core_stores_and_serves_kv_through_any_bridge():
    cache = PrefixCache(
        SPECS,
        Namespace("tensors", "float64"),
        bridge=TensorBridge(),
        capacity_tokens=32,
        dtype=torch.float64,
        device="cpu",
    )
    ids, past = list(range(10, 16)), past_of(6)
    assert cache.insert(ids, past) == 6
    with cache.match([*ids, 99]) as hit:
        assert hit.length == 6
        full, none, sliding = hit.to_hf_cache()
    assert torch.equal(full, past[0]) and none is None
    assert torch.equal(sliding, past[2][-3:])  # a window of 4 holds the last 3 tokens


def test_importing_the_core_loads_neither_transformers_nor_the_adapters():
    code = (
        "import sys, kvblocks.cache.trie, kvblocks.cache.explain, kvblocks.cache.inspection\n"
        "print(sorted(m for m in sys.modules if m == 'transformers' or m.startswith('kvblocks.adapters')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
