"""Re-positioning cached keys: RoPE rotates a key at position i by angle i * inv_freq, and rotations
compose, so a key computed at i moves to i + p by one more rotation of angle p * inv_freq.

The frequencies are the model's own (`rotary_emb.inv_freq`, which already holds linear, llama3 or
yarn scaling); the angles are taken in float64 so the shift is exact to the KV dtype. Values carry
no position and are never touched.
"""

from __future__ import annotations

import torch

from kvblocks.adapters.hf import UnsupportedModelError

__all__ = ["RopeShift"]

# RoPE variants whose frequencies depend on the sequence length: a key cannot be moved without
# recomputing it, because its rotation at the new length differs.
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


class RopeShift:
    """Rotates keys computed at positions 0..n-1 to positions p..p+n-1 (rotate-half convention)."""

    def __init__(self, model: torch.nn.Module) -> None:
        model_type = getattr(model.config, "model_type", "?")
        rotary = [m for name, m in model.named_modules() if name.endswith("rotary_emb")]
        if not rotary or not isinstance(getattr(rotary[0], "inv_freq", None), torch.Tensor):
            raise UnsupportedModelError(
                f"model type '{model_type}' has no rotary position embedding: its cached keys cannot be "
                "moved to another position (kv_mode 'blend' and 'concat' need RoPE; use 'exact')"
            )
        if len(rotary) > 1:
            raise UnsupportedModelError(
                f"model type '{model_type}' has {len(rotary)} rotary embeddings (per layer type): "
                "KV blocks support models with one RoPE only; use kv_mode 'exact'"
            )
        rope_type = getattr(rotary[0], "rope_type", "default")
        if rope_type in LENGTH_DEPENDENT_ROPE:
            raise UnsupportedModelError(
                f"model type '{model_type}' uses rope type '{rope_type}', whose frequencies change with the "
                "sequence length: cached keys cannot be moved exactly; use kv_mode 'exact'"
            )
        self.inv_freq = rotary[0].inv_freq.detach().to(torch.float64)

    def shift(self, keys: torch.Tensor, offset: int) -> torch.Tensor:
        """`keys` `[n, H, D]` moved `offset` positions later (a new tensor, `keys`' dtype)."""
        if offset == 0:
            return keys
        rot = 2 * self.inv_freq.numel()  # rotated dims (partial rotary models rotate the first ones)
        angle = float(offset) * self.inv_freq.to(keys.device)
        cos = torch.cat((angle.cos(), angle.cos())).to(keys.dtype)
        sin = torch.cat((angle.sin(), angle.sin())).to(keys.dtype)
        head, tail = keys[..., :rot], keys[..., rot:]
        half = rot // 2
        rotated_half = torch.cat((-head[..., half:], head[..., :half]), dim=-1)
        return torch.cat((head * cos + rotated_half * sin, tail), dim=-1)
