"""adapters/hf.py: cache layout probing, building caches from pool data, extraction and cropping."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, WINDOW, tiny_model
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvblocks import UnsupportedModelError
from kvblocks.adapters import hf
from kvblocks.cache.layout import LayerSpec

LENGTH = 2 * WINDOW + 4  # long enough that every sliding layer has dropped tokens


@pytest.fixture(scope="module")
def gemma3():
    """Hybrid layout: sliding, full, sliding, full."""
    return tiny_model("gemma3", torch.float64)


def prompt(n: int = LENGTH) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(0))


@torch.inference_mode()
def prefill(model, ids: torch.Tensor, record: bool = True) -> DynamicCache:
    cache = hf.empty_cache(model.config) if record else DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache


def pool_rows(cache: DynamicCache, specs: list[LayerSpec], length: int) -> list[torch.Tensor | None]:
    """What the pool would gather for `length` tokens: `[tokens_held, 2, H, D]` per layer."""
    rows = []
    for spec, (keys, values) in zip(specs, hf.extract(cache, specs, 0, length)):
        held = spec.tokens_held(length)
        rows.append(torch.stack((keys, values), dim=1)[length - held :])
    return rows


def test_describe_layers_reads_hybrid_sliding_and_full_layers(gemma3):
    specs = hf.describe_layers(gemma3)
    assert [s.kind for s in specs] == ["sliding", "full", "sliding", "full"]
    assert {s.window for s in specs if s.kind == "sliding"} == {WINDOW}
    assert all(s.heads == 2 and s.head_dim == 16 for s in specs)


def test_describe_layers_reads_a_uniform_sliding_window():
    specs = hf.describe_layers(tiny_model("mistral"))
    assert [(s.kind, s.window) for s in specs] == [("sliding", WINDOW)] * 2


def test_build_cache_uses_the_models_layer_classes_and_holds_only_the_window(gemma3):
    specs = hf.describe_layers(gemma3)
    live = prefill(gemma3, prompt())
    cache = hf.build_cache(gemma3.config, specs, pool_rows(live, specs, LENGTH), LENGTH)
    assert cache.get_seq_length() == LENGTH
    for layer, spec, original in zip(cache.layers, specs, live.layers):
        assert type(layer) is (DynamicSlidingWindowLayer if spec.kind == "sliding" else DynamicLayer)
        assert layer.get_seq_length() == LENGTH
        held = WINDOW - 1 if spec.kind == "sliding" else LENGTH
        assert layer.keys.shape == (1, spec.heads, held, spec.head_dim)
        assert torch.equal(layer.keys, original.keys[..., -held:, :])
        assert torch.equal(layer.values, original.values[..., -held:, :])


def test_build_cache_of_zero_tokens_is_an_empty_cache(gemma3):
    specs = hf.describe_layers(gemma3)
    cache = hf.build_cache(gemma3.config, specs, [None] * len(specs), 0)
    assert cache.get_seq_length() == 0


@torch.inference_mode()
def test_built_cache_continues_like_the_live_cache(gemma3):
    specs = hf.describe_layers(gemma3)
    ids = prompt(LENGTH + 3)
    live = prefill(gemma3, ids[:, :LENGTH])
    cache = hf.build_cache(gemma3.config, specs, pool_rows(live, specs, LENGTH), LENGTH)
    want = gemma3(input_ids=ids[:, LENGTH:], past_key_values=live, use_cache=True).logits
    got = gemma3(input_ids=ids[:, LENGTH:], past_key_values=cache, use_cache=True).logits
    assert torch.equal(got, want)


def test_extract_returns_the_requested_positions(gemma3):
    specs = hf.describe_layers(gemma3)
    live = prefill(gemma3, prompt())
    for (keys, values), layer in zip(hf.extract(live, specs, 3, 11), live.layers):
        assert keys.shape == (8, 2, 16)
        assert torch.equal(keys, layer.keys[0, :, 3:11].transpose(0, 1))
        assert torch.equal(values, layer.values[0, :, 3:11].transpose(0, 1))


def test_extract_refuses_positions_a_sliding_layer_no_longer_holds(gemma3):
    specs = hf.describe_layers(gemma3)
    live = prefill(gemma3, prompt(), record=False)
    tail = hf.extract(live, specs, LENGTH - (WINDOW - 1), LENGTH)
    assert all(keys.shape[0] == WINDOW - 1 for keys, _ in tail)
    with pytest.raises(ValueError, match="sliding-window cache must record its past"):
        hf.extract(live, specs, 0, LENGTH)


def test_crop_by_target_length_keeps_a_sliding_layers_recorded_past(gemma3):
    specs = hf.describe_layers(gemma3)
    ids = prompt()
    cache = prefill(gemma3, ids)
    before = hf.extract(cache, specs, 0, LENGTH - 5)
    hf.crop(cache, LENGTH - 5)
    assert cache.get_seq_length() == LENGTH - 5
    assert all(layer.get_seq_length() == LENGTH - 5 for layer in cache.layers)
    for (k0, v0), (k1, v1) in zip(before, hf.extract(cache, specs, 0, LENGTH - 5)):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


@torch.inference_mode()
def test_cropped_cache_continues_like_a_cache_that_never_saw_the_removed_tokens(gemma3):
    ids = prompt()
    other = (ids + 1) % VOCAB
    keep = LENGTH - 6
    cropped = prefill(gemma3, torch.cat((ids[:, :keep], other[:, keep:]), dim=1))
    hf.crop(cropped, keep)
    clean = prefill(gemma3, ids[:, :keep])
    want = gemma3(input_ids=ids[:, keep:], past_key_values=clean, use_cache=True).logits
    got = gemma3(input_ids=ids[:, keep:], past_key_values=cropped, use_cache=True).logits
    assert (got - want).abs().max().item() <= 1e-12


def test_crop_to_the_current_length_is_a_no_op_and_growing_is_refused(gemma3):
    cache = prefill(gemma3, prompt())
    hf.crop(cache, LENGTH)
    assert cache.get_seq_length() == LENGTH
    with pytest.raises(ValueError, match="cannot crop"):
        hf.crop(cache, LENGTH + 1)


def test_crop_refuses_to_roll_back_a_sliding_layer_without_recorded_past(gemma3):
    cache = prefill(gemma3, prompt(), record=False)
    with pytest.raises(ValueError, match="recorded past"):
        hf.crop(cache, LENGTH - 1)


@pytest.mark.parametrize(
    "config_name",
    ["RecurrentGemmaConfig", "RwkvConfig", "KimiLinearConfig", "MiniMaxConfig", "xLSTMConfig"],
)
def test_unproven_recurrent_configs_are_refused_before_any_forward(config_name):
    import transformers

    config = getattr(transformers, config_name)()
    with pytest.raises(UnsupportedModelError, match=f"'{config.model_type}'"):
        hf.check_supported(config)


@pytest.mark.parametrize(
    "config_name",
    [
        *("JambaConfig", "Qwen3NextConfig", "FalconH1Config", "Lfm2Config", "Zamba2Config", "MambaConfig"),
        *("BambaConfig", "Qwen3_5MoeTextConfig", "OlmoHybridConfig"),
    ],
)
def test_stateful_families_pass_the_check(config_name):
    import transformers

    hf.check_supported(getattr(transformers, config_name)())


def test_unknown_model_type_with_recurrent_layer_types_is_refused():
    class FutureHybridConfig(PretrainedConfig):
        model_type = "future_hybrid"

    config = FutureHybridConfig(layer_types=["linear_attention", "full_attention"])
    with pytest.raises(UnsupportedModelError, match="'future_hybrid'"):
        hf.check_supported(config)
