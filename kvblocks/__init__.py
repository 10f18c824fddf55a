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
    "Namespace": "kvblocks.namespace",
    "RedisTier": "kvblocks.redis_tier",
    "SamplingParams": "kvblocks.sampling",
    "PromptError": "kvblocks.text",
    "UnsupportedModelError": "kvblocks.adapters.hf",
}

__all__ = [
    "CachedGenerator",
    "GenerationResult",
    "Hit",
    "KVCacheTrie",
    "Namespace",
    "Piece",
    "PinLimitError",
    "PromptError",
    "PromptTooLongError",
    "RedisTier",
    "SamplingParams",
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
    from kvblocks.namespace import Namespace
    from kvblocks.redis_tier import RedisTier
    from kvblocks.sampling import SamplingParams
    from kvblocks.text import PromptError
    from kvblocks.trie import Hit, KVCacheTrie, PinLimitError
