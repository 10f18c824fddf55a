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


def tiny_model(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A random-weight model of family `arch` in eval mode, attention that keeps float64 where possible."""
    from transformers import AutoModelForCausalLM

    config_cls, fields = _configs()[arch]
    torch.manual_seed(seed)
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
