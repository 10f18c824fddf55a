"""Namespaces: the fingerprint covers every weight and buffer, the config and the attention
implementation; tenants and salts never collide."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_llama

from kvblocks.cache.namespace import Namespace, Scope, model_fingerprint, namespace_for


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def edited(model, edit) -> torch.nn.Module:
    other = copy.deepcopy(model)
    with torch.no_grad():
        edit(other)
    return other


def last_element(name: str):
    def edit(m):
        param = dict(m.named_parameters())[name]
        param.view(-1)[-1] += 1e-6

    return edit


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.embed_tokens.weight",
    ],
)
def test_one_changed_weight_anywhere_changes_the_fingerprint(model, name):
    # The old fingerprint sampled 4,096 elements of three tensors: these edits all escaped it.
    assert model_fingerprint(edited(model, last_element(name))) != model_fingerprint(model)


def test_an_attached_adapter_changes_the_fingerprint(model):
    class LoRA(torch.nn.Module):
        def __init__(self, base: torch.nn.Linear, rank: int = 2) -> None:
            super().__init__()
            self.base = base
            self.lora_A = torch.nn.Parameter(torch.zeros(rank, base.in_features))
            self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, rank))

        def forward(self, x):
            return self.base(x) + x @ self.lora_A.T @ self.lora_B.T

    def attach(m):
        attn = m.model.layers[0].self_attn
        attn.v_proj = LoRA(attn.v_proj)

    assert model_fingerprint(edited(model, attach)) != model_fingerprint(model)


def test_a_changed_buffer_changes_the_fingerprint(model):
    def edit(m):
        m.model.rotary_emb.inv_freq.mul_(1.0001)

    assert model_fingerprint(edited(model, edit)) != model_fingerprint(model)


def test_the_same_weights_loaded_twice_share_a_fingerprint(model):
    assert model_fingerprint(copy.deepcopy(model)) == model_fingerprint(model)
    assert model_fingerprint(tiny_llama(seed=0)) == model_fingerprint(model)


def test_dtype_and_attention_implementation_are_part_of_the_namespace(model):
    as64 = copy.deepcopy(model).to(torch.float64)
    assert namespace_for(as64).key != namespace_for(model).key
    sdpa = copy.deepcopy(model)
    sdpa.config._attn_implementation = "sdpa" if model.config._attn_implementation != "sdpa" else "eager"
    assert model_fingerprint(sdpa) != model_fingerprint(model)


def test_tenant_and_salt_never_collide():
    base = Namespace("m", "float32")
    keys = {
        base.with_salt(s).key
        for s in [None, "a", Scope("a"), Scope("", "a"), Scope("a", "b"), Scope("a\0b"), Scope("a", "\0b")]
    }
    assert len(keys) == 6  # None and Scope("", "") are the same namespace, "a" == Scope("", "a")
    assert base.with_salt("a") == base.with_salt(Scope("", "a"))
    assert base.with_salt(Scope("acme", "x")).scope == Scope("acme", "x")
