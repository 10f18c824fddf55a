"""Encoder-decoder (seq2seq) models: the source's encoder work and the decoder's prefixes, reused exactly."""

from __future__ import annotations

from kvblocks.seq2seq.cache import Seq2SeqCache, SourceScope
from kvblocks.seq2seq.generator import Seq2SeqCachedGenerator, Seq2SeqPrompt

__all__ = ["Seq2SeqCache", "Seq2SeqCachedGenerator", "Seq2SeqPrompt", "SourceScope"]
