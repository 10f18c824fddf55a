"""What the cache asks of a model framework's live cache ("past"), which it never looks into itself.

The core deals in layer specs and tensors: KV as `[tokens, 2, heads, head_dim]` per layer and a
recurrent state as one byte tensor (a `StateLayout`). A bridge turns those into the framework's
cache object and back; `kvblocks.adapters.hf.HFBridge` is the transformers one, injected by
`kvblocks.KVCacheTrie`. The arrow points outwards: `adapters/` imports the core, never the reverse.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class PastBridge(Protocol):
    """Conversions between the pool's tensors and one model's framework cache."""

    @property
    def min_prefill(self) -> int:
        """The fewest tokens a prefill forward of the model takes (and a hit leaves uncached)."""
        ...

    def build(self, kv: list[torch.Tensor | None], length: int, state: torch.Tensor | None) -> Any:
        """A fresh framework cache holding `length` tokens: `kv[l]` is `[tokens_held, 2, H, D]` (the
        last tokens layer `l` holds, None where it caches nothing), `state` the snapshot at `length`."""
        ...

    def extract(self, past: Any, start: int, end: int) -> list[torch.Tensor | None]:
        """KV `[end - start, 2, H, D]` of positions [start, end) of `past`, per layer."""
        ...

    def length(self, past: Any) -> int | None:
        """Positions `past` holds; None when no layer counts tokens (recurrent layers only)."""
        ...

    def capture(self, past: Any) -> torch.Tensor:
        """A copy of `past`'s recurrent state where it stands, as one byte tensor (a snapshot)."""
        ...
