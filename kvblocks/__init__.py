"""kvblocks: exact prefix-sharing KV cache for Hugging Face transformers models.

Names load lazily, so `kvblocks stats` and other HTTP-only commands start without importing
torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "Block": "kvblocks.blocks",
    "CachedGenerator": "kvblocks.generate.generator",
    "StoredBlock": "kvblocks.blocks",
    "chat_blocks": "kvblocks.blocks",
    "GenerationResult": "kvblocks.generate.generator",
    "Piece": "kvblocks.generate.generator",
    "PromptTooLongError": "kvblocks.generate.generator",
    "Hit": "kvblocks.cache.trie",
    "KVCacheTrie": "kvblocks.adapters.hf_trie",
    "PinLimitError": "kvblocks.cache.trie",
    "PoolFullError": "kvblocks.cache.trie",
    "Namespace": "kvblocks.cache.namespace",
    "Scope": "kvblocks.cache.namespace",
    "GenerationParams": "kvblocks.generate.params",
    "ParamError": "kvblocks.generate.params",
    "TokenLogprob": "kvblocks.generate.sampling",
    "RedisTier": "kvblocks.spill.redis_tier",
    "SamplingParams": "kvblocks.generate.sampling",
    "PromptError": "kvblocks.generate.text",
    "UnsupportedModelError": "kvblocks.adapters.hf",
}

__all__ = [
    "Block",
    "CachedGenerator",
    "GenerationParams",
    "GenerationResult",
    "Hit",
    "KVCacheTrie",
    "Namespace",
    "ParamError",
    "Piece",
    "PinLimitError",
    "PoolFullError",
    "PromptError",
    "PromptTooLongError",
    "RedisTier",
    "SamplingParams",
    "Scope",
    "StoredBlock",
    "TokenLogprob",
    "UnsupportedModelError",
    "chat_blocks",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvblocks' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from kvblocks.adapters.hf import UnsupportedModelError
    from kvblocks.adapters.hf_trie import KVCacheTrie
    from kvblocks.blocks import Block, StoredBlock, chat_blocks
    from kvblocks.cache.namespace import Namespace, Scope
    from kvblocks.cache.trie import Hit, PinLimitError, PoolFullError
    from kvblocks.generate.generator import CachedGenerator, GenerationResult, Piece, PromptTooLongError
    from kvblocks.generate.params import GenerationParams, ParamError
    from kvblocks.generate.sampling import SamplingParams, TokenLogprob
    from kvblocks.generate.text import PromptError
    from kvblocks.spill.redis_tier import RedisTier
