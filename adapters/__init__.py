"""Bridges between kvblocks and other frameworks; `hf` is the transformers cache adapter."""
