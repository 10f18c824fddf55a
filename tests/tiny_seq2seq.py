"""Tiny random-weight encoder-decoder models, one per seq2seq family transformers ships (no download)."""

from __future__ import annotations

import torch

VOCAB = 160
START = 1  # decoder start token; no EOS, so a random model never stops early

_T5 = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4)
_BART = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=256,
)
SEQ2SEQ_CONFIGS = {
    "t5": _T5,
    "mt5": _T5,
    "umt5": _T5,
    "longt5": _T5,
    "switch_transformers": dict(_T5, num_experts=2, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1),
    "bart": _BART,
    "mbart": _BART,
    "marian": dict(_BART, decoder_vocab_size=VOCAB),
    "pegasus": _BART,
    "pegasus_x": dict(_BART, block_size=8, num_global_tokens=4),
    "blenderbot": _BART,
    "blenderbot-small": _BART,
    "led": dict(
        _BART,
        max_encoder_position_embeddings=256,
        max_decoder_position_embeddings=256,
        attention_window=[8, 8],
    ),
    "bigbird_pegasus": dict(_BART, attention_type="original_full"),
    "plbart": _BART,
    "m2m_100": _BART,
    "nllb-moe": dict(_BART, num_experts=2),
    "mvp": _BART,
    "fsmt": dict(_BART, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, langs=["en", "de"]),
}
SEQ2SEQ_FAMILIES = list(SEQ2SEQ_CONFIGS)


def tiny_seq2seq(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A random-weight seq2seq model of `family` in eval mode (sdpa keeps float64 end to end)."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    torch.manual_seed(seed)
    fields = SEQ2SEQ_CONFIGS[family] | dict(
        vocab_size=VOCAB, pad_token_id=0, eos_token_id=None, bos_token_id=None, decoder_start_token_id=START
    )
    fields |= overrides
    config = AutoConfig.for_model(family, **fields)
    return AutoModelForSeq2SeqLM.from_config(config, dtype=dtype).eval()
