"""Every cached forward numbers its tokens from the cache's length (`hf.positions`).

transformers' bamba numbers a forward's tokens from 0 unless it is given `position_ids`, so a
continuation of a cache is right only when kvblocks passes the true positions itself.
"""

from __future__ import annotations

import copy

import torch
from tiny_models import random_ids, tiny_model
from transformers import DynamicCache

from kvblocks.adapters import hf
from kvblocks.generate.generator import ModelRunner


def test_a_continuation_gets_the_positions_after_the_cache():
    model = tiny_model("bamba", torch.float64)
    ids = random_ids(24, seed=1)
    runner = ModelRunner(model)
    past = hf.empty_cache(model.config)
    runner.forward(ids[:16], past)
    got = runner.forward(ids[16:], past, keep=8)
    plain = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[:16]]), cache=plain, use_cache=True)
        unnumbered = copy.deepcopy(plain)
        want = model(
            input_ids=torch.tensor([ids[16:]]),
            cache=plain,
            use_cache=True,
            position_ids=torch.arange(16, 24)[None],
        ).logits[0]
        from_zero = model(input_ids=torch.tensor([ids[16:]]), cache=unnumbered, use_cache=True).logits[0]
    assert torch.equal(got, want)
    assert (got - from_zero).abs().max() > 1e-2  # left to itself, bamba would number them 0..7


def test_positions_name_each_argument_the_forward_takes():
    past = hf.empty_cache(tiny_model("llama").config)
    past.update(torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16), 0)
    both = hf.positions(("position_ids", "cache_position"), past, 3, "cpu")
    assert both["position_ids"].tolist() == [[5, 6, 7]] and both["cache_position"].tolist() == [5, 6, 7]
    assert hf.position_arguments(tiny_model("bamba")) == ("position_ids",)
    assert hf.position_arguments(tiny_model("mamba")) == ()


def test_a_cache_without_attention_layers_gets_no_positions():
    model = tiny_model("mamba2")
    past = hf.empty_cache(model.config)
    assert hf.positions(("position_ids",), past, 3, "cpu") == {}
