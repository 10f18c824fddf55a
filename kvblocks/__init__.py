"""kvblocks: exact prefix-sharing KV cache for Hugging Face transformers models."""

from kvblocks.adapters.hf import UnsupportedModelError
from kvblocks.generator import CachedGenerator, GenerationResult, Piece, PromptTooLongError
from kvblocks.namespace import Namespace
from kvblocks.redis_tier import RedisTier
from kvblocks.sampling import SamplingParams
from kvblocks.text import PromptError
from kvblocks.trie import Hit, KVCacheTrie, PinLimitError

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

__version__ = "0.1.0"
