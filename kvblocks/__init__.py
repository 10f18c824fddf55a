"""kvblocks: exact prefix-sharing KV cache for Hugging Face transformers models.

Names load lazily, so `kvblocks stats` and other HTTP-only commands start without importing
torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "CachedGenerator": "kvblocks.generator",
    "GenerationResult": "kvblocks.generator",
    "Piece": "kvblocks.generator",
    "PromptTooLongError": "kvblocks.generator",
    "Hit": "kvblocks.trie",
    "KVCacheTrie": "kvblocks.trie",
    "PinLimitError": "kvblocks.trie",
    "PoolFullError": "kvblocks.trie",
    "Namespace": "kvblocks.namespace",
    "Scope": "kvblocks.namespace",
    "GenerationParams": "kvblocks.params",
    "ParamError": "kvblocks.params",
    "TokenLogprob": "kvblocks.sampling",
    "RedisTier": "kvblocks.redis_tier",
    "SamplingParams": "kvblocks.sampling",
    "PromptError": "kvblocks.text",
    "UnsupportedModelError": "kvblocks.adapters.hf",
}

__all__ = [
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
    "TokenLogprob",
    "UnsupportedModelError",
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
    from kvblocks.generator import CachedGenerator, GenerationResult, Piece, PromptTooLongError
    from kvblocks.namespace import Namespace, Scope
    from kvblocks.params import GenerationParams, ParamError
    from kvblocks.redis_tier import RedisTier
    from kvblocks.sampling import SamplingParams, TokenLogprob
    from kvblocks.text import PromptError
    from kvblocks.trie import Hit, KVCacheTrie, PinLimitError, PoolFullError
