"""Tiny random-weight causal LMs built from configs (no download), one per architecture family.

Sizes are chosen so a forward pass takes milliseconds on one CPU thread. Sliding-window models
get a window smaller than the prompts the tests use, so the windowed layers really drop tokens.
"""

from __future__ import annotations

import torch

VOCAB = 160
WINDOW = 8
FULL_PRECISION_EAGER = "kvblocks_test_eager_fp64"


def _common(**fields) -> dict:
    """No special tokens: a random model must never stop early or pad."""
    return dict(fields, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _configs() -> dict:
    from transformers import (
        BloomConfig,
        FalconConfig,
        Gemma2Config,
        Gemma3TextConfig,
        GPT2Config,
        GPTNeoXConfig,
        LlamaConfig,
        MistralConfig,
        OPTConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    decoder = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=512,
    )
    hybrid = dict(
        decoder,
        num_hidden_layers=4,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )
    return {
        "llama": (LlamaConfig, _common(**decoder)),
        "qwen2": (Qwen2Config, _common(**decoder)),
        "qwen3": (Qwen3Config, _common(**decoder, head_dim=16)),
        "mistral": (MistralConfig, _common(**decoder, sliding_window=WINDOW)),
        "gemma2": (Gemma2Config, _common(**hybrid, query_pre_attn_scalar=16)),
        "gemma3": (Gemma3TextConfig, _common(**hybrid, query_pre_attn_scalar=16)),
        "gpt2": (
            GPT2Config,
            _common(n_embd=64, n_layer=2, n_head=4, n_inner=128, vocab_size=VOCAB, n_positions=512),
        ),
        "gpt_neox": (
            GPTNeoXConfig,
            _common(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                vocab_size=VOCAB,
                max_position_embeddings=512,
            ),
        ),
        "opt": (
            OPTConfig,
            _common(
                hidden_size=64,
                ffn_dim=128,
                word_embed_proj_dim=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                vocab_size=VOCAB,
                max_position_embeddings=512,
            ),
        ),
        "falcon": (
            FalconConfig,
            _common(
                hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB, alibi=False
            ),
        ),
        "bloom": (BloomConfig, _common(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB)),
        "phi3": (Phi3Config, _common(**decoder)),
    }


ARCHITECTURES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma2",
    "gemma3",
    "gpt2",
    "gpt_neox",
    "opt",
    "falcon",
    "bloom",
    "phi3",
)


# Recurrent and hybrid families (kvblocks.adapters.hf.STATEFUL_MODEL_TYPES), 4 layers each with
# recurrent layers and, for hybrids, attention layers. initializer_range=0.2 makes the recurrent
# state matter: at the default init an SSM layer barely moves the logits, and a test that reset
# the state by mistake could still pass.
_SSM = dict(mamba_d_state=16, mamba_d_conv=4, mamba_expand=2)
_ATTN = dict(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
_MAMBA1 = dict(hidden_size=64, state_size=8, num_hidden_layers=4, expand=2, conv_kernel=4)
_LFM2 = dict(
    _ATTN, hidden_size=64, num_hidden_layers=4, conv_L_cache=3, layer_types=["conv", "full_attention"] * 2
)
_GATED_DELTA = dict(
    _ATTN,
    hidden_size=64,
    num_hidden_layers=4,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention"] * 2,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2)
_ZAMBA = dict(
    hidden_size=64,
    num_hidden_layers=4,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    layers_block_type=["mamba", "hybrid"] * 2,
    max_position_embeddings=512,
)
HYBRID_CONFIGS = {
    "mamba": _MAMBA1,
    "falcon_mamba": _MAMBA1,
    "mamba2": dict(
        hidden_size=64, num_hidden_layers=4, num_heads=8, head_dim=16, expand=2, state_size=16, n_groups=1,
        conv_kernel=4, chunk_size=8,
    ),
    "jamba": dict(
        _ATTN, **_MOE, hidden_size=64, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
    ),
    "falcon_h1": dict(
        _ATTN | _SSM, hidden_size=64, num_hidden_layers=4, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16,
        mamba_n_groups=1, mamba_chunk_size=8,
    ),
    "lfm2": dict(_LFM2, block_auto_adjust_ff_dim=False),
    "lfm2_moe": dict(_LFM2, **_MOE, moe_intermediate_size=32, num_dense_layers=1),
    "qwen3_next": dict(
        _GATED_DELTA, **_MOE, moe_intermediate_size=32, shared_expert_intermediate_size=32
    ),
    "qwen3_5_text": _GATED_DELTA,
    "granitemoehybrid": dict(
        _ATTN | _SSM, intermediate_size=32, hidden_size=64, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=32, position_embedding_type="rope", num_hidden_layers=4,
        layer_types=["mamba", "attention"] * 2, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
        mamba_chunk_size=8,
    ),
    "zamba": dict(_ZAMBA, n_mamba_heads=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2),
    "zamba2": dict(_ZAMBA, **_SSM, mamba_ngroups=1, n_mamba_heads=8, chunk_size=8, num_mem_blocks=1),
    "bamba": dict(
        _ATTN | _SSM, hidden_size=64, num_hidden_layers=4, attn_layer_indices=[1, 3], mamba_n_heads=8,
        mamba_d_head=16, mamba_n_groups=1, mamba_chunk_size=8,
    ),
    "nemotron_h": dict(
        hidden_size=64, layer_types=["linear_attention", "full_attention", "linear_attention", "moe"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, ssm_state_size=16,
        mamba_num_heads=8, mamba_head_dim=16, n_groups=1, conv_kernel=4, expand=2, chunk_size=8,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, max_position_embeddings=512,
    ),
    "qwen3_5_moe_text": dict(
        _GATED_DELTA, **_MOE, moe_intermediate_size=32, shared_expert_intermediate_size=32
    ),
    "olmo_hybrid": dict(
        _ATTN, hidden_size=64, num_hidden_layers=4, head_dim=16, layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    ),
    "zaya": dict(
        _ATTN, hidden_size=64, num_hidden_layers=4, head_dim=16, num_experts=4, num_experts_per_tok=1,
        moe_intermediate_size=32, router_hidden_size=16, layer_types=["hybrid"] * 4,
    ),
    # the two below mix recurrent layers with sliding-window attention layers
    "lfm3": dict(
        _ATTN, hidden_size=64, num_hidden_layers=4, head_dim=16, conv_L_cache=3, sliding_window=WINDOW,
        layer_types=["conv", "full_attention", "conv", "sliding_attention"],
    ),
    "lara_mini": dict(
        _GATED_DELTA, **_MOE, moe_intermediate_size=32, shared_expert_intermediate_size=32, sliding_window=WINDOW,
        layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
    ),
}  # fmt: skip
HYBRID_ARCHITECTURES = tuple(HYBRID_CONFIGS)

# Recurrent families kvblocks refuses (kvblocks.adapters.hf.REFUSED_REASONS), tiny, for the refusal test.
_MLA = dict(
    _ATTN,
    hidden_size=64,
    num_hidden_layers=4,
    head_dim=16,
    moe_intermediate_size=32,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    qk_nope_head_dim=8,
    qk_head_dim=16,
    num_experts=4,
    num_experts_per_token=2,
    layer_types=["linear_attention", "full_attention"] * 2,
    mlp_layer_types=["dense", "sparse"] * 2,
    linear_head_dim=16,
    linear_num_heads=4,
)
REFUSED_CONFIGS = {
    "recurrent_gemma": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, lru_width=64, attention_window_size=16, block_types=["recurrent", "recurrent", "attention"],
    ),
    "rwkv": dict(hidden_size=64, num_hidden_layers=2, attention_hidden_size=64, intermediate_size=128),
    "xlstm": dict(
        hidden_size=64, embedding_dim=64, num_hidden_layers=2, num_blocks=2, num_heads=4, chunk_size=8,
        ffn_round_up_to_multiple_of=16,
    ),
    "minimax": dict(
        _ATTN, hidden_size=64, num_hidden_layers=4, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"] * 2, block_size=8,
    ),
    "kimi_linear": _MLA,
    "bailing_hybrid": dict(
        _MLA, first_k_dense_replace=1, num_expert_group=1, topk_group=1, layer_group_size=2,
        num_nextn_predict_layers=0,
    ),
}  # fmt: skip


def random_ids(n: int, seed: int, low: int = 0, high: int = VOCAB) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n,), generator=g).tolist()


def tiny_model(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A random-weight model of family `arch` in eval mode, attention that keeps float64 where possible."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    if arch in HYBRID_CONFIGS or arch in REFUSED_CONFIGS:
        fields = _common(**(HYBRID_CONFIGS | REFUSED_CONFIGS)[arch], vocab_size=VOCAB, initializer_range=0.2)
        config = AutoConfig.for_model(arch, **fields)
        return AutoModelForCausalLM.from_config(
            config, attn_implementation="eager", experts_implementation="eager", dtype=dtype
        ).eval()
    config_cls, fields = _configs()[arch]
    config = config_cls(**fields)
    return AutoModelForCausalLM.from_config(config, attn_implementation=_attention(arch), dtype=dtype).eval()


def _attention(arch: str) -> str:
    """sdpa keeps float64 end to end, while transformers' eager attention runs softmax in float32.

    gemma2 has no sdpa (it soft-caps attention scores), so it gets eager attention that keeps the
    input dtype. bloom's attention is hard-coded eager with a float32 softmax.
    """
    if arch == "gemma2":
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask

        AttentionInterface.register(FULL_PRECISION_EAGER, _full_precision_eager)
        AttentionMaskInterface.register(FULL_PRECISION_EAGER, eager_mask)
        return FULL_PRECISION_EAGER
    return "eager" if arch == "bloom" else "sdpa"


def _full_precision_eager(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
    """transformers' eager attention, gemma2's soft-capping included, with the softmax in the input dtype."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = scores.softmax(dim=-1)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs
