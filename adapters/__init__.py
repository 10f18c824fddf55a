"""Bridges between kvblocks and other frameworks: `hf` adapts transformers caches (`HFBridge`, the
cache core's view of them), `hf_trie` is `kvblocks.KVCacheTrie` (the core with that bridge, and
`for_model`), `lmcache` reads and writes LMCache's Redis chunk format."""
