"""Bridges between kvblocks and other frameworks: `hf` adapts transformers caches, `lmcache` reads
and writes LMCache's Redis chunk format."""
