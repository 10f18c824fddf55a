"""Tiny random-weight encoder-decoder models, one per seq2seq family transformers ships (no download)."""

from __future__ import annotations

import torch

VOCAB = 160
START = 1  # decoder start token; no EOS, so a random model never stops early

_T5 = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4)
BART = dict(
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
    "bart": BART,
    "mbart": BART,
    "marian": dict(BART, decoder_vocab_size=VOCAB),
    "pegasus": BART,
    "pegasus_x": dict(BART, block_size=8, num_global_tokens=4),
    "blenderbot": BART,
    "blenderbot-small": BART,
    "led": dict(
        BART,
        max_encoder_position_embeddings=256,
        max_decoder_position_embeddings=256,
        attention_window=[8, 8],
    ),
    "bigbird_pegasus": dict(BART, attention_type="original_full"),
    "plbart": BART,
    "m2m_100": BART,
    "nllb-moe": dict(BART, num_experts=2),
    "mvp": BART,
    "fsmt": dict(BART, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, langs=["en", "de"]),
}
_GEMMA = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    sliding_window=16,  # shorter than the sources and decoder sequences the tests run
    pad_token_id=0,
)
_BERT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=256,
    pad_token_id=0,
)
_GPT2 = dict(
    vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, bos_token_id=None, eos_token_id=None
)
# families whose config nests an encoder's and a decoder's: family -> (model type, its sub-configs)
NESTED_CONFIGS = {
    "t5gemma": ("t5gemma", dict(encoder=_GEMMA, decoder=_GEMMA)),
    # text only: kvblocks passes no pixel_values (the vision tower never runs)
    "t5gemma2": (
        "t5gemma2",
        dict(
            encoder=dict(
                text_config=_GEMMA,
                vision_config=dict(
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=1,
                    num_attention_heads=4,
                    image_size=32,
                    patch_size=8,
                ),
                mm_tokens_per_image=4,
            ),
            decoder=_GEMMA,
            image_token_index=VOCAB - 1,
        ),
    ),
    # EncoderDecoderModel from two configs: a bert encoder with a gpt2 or a bert decoder
    "encoder-decoder:bert+gpt2": ("encoder-decoder", dict(encoder=("bert", _BERT), decoder=("gpt2", _GPT2))),
    "encoder-decoder:bert+bert": ("encoder-decoder", dict(encoder=("bert", _BERT), decoder=("bert", _BERT))),
}
SEQ2SEQ_FAMILIES = [*SEQ2SEQ_CONFIGS, *NESTED_CONFIGS]
# families kvblocks refuses by name (adapters/hf_seq2seq.REFUSED), built to prove the reason still holds
REFUSED_CONFIGS = {
    "prophetnet": dict(
        hidden_size=32,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_encoder_layers=2,
        num_decoder_layers=2,
        num_encoder_attention_heads=4,
        num_decoder_attention_heads=4,
        max_position_embeddings=256,
        ngram=2,
    ),
}


def _config(family: str, fields: dict):
    from transformers import AutoConfig, EncoderDecoderConfig

    flat = SEQ2SEQ_CONFIGS | REFUSED_CONFIGS
    if family in flat:
        return AutoConfig.for_model(family, **(flat[family] | fields))
    model_type, nested = NESTED_CONFIGS[family]
    if model_type != "encoder-decoder":
        return AutoConfig.for_model(model_type, **nested, **fields)
    encoder, decoder = (
        AutoConfig.for_model(kind, **sub) for kind, sub in (nested["encoder"], nested["decoder"])
    )
    return EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder, **fields)


def tiny_seq2seq(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A random-weight seq2seq model of `family` in eval mode (sdpa keeps float64 end to end)."""
    from transformers import AutoModelForSeq2SeqLM

    torch.manual_seed(seed)
    fields = dict(
        vocab_size=VOCAB, pad_token_id=0, eos_token_id=None, bos_token_id=None, decoder_start_token_id=START
    )
    return AutoModelForSeq2SeqLM.from_config(_config(family, fields | overrides), dtype=dtype).eval()
