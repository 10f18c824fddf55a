"""What a request with KV blocks got: which blocks were reused where, and how many prompt tokens
were exact, reused at a new position, or recomputed (the accounting a client and `explain` see)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TIERS", "BlockReport", "BlockUse", "StoredBlock"]

# Where a reused block token's KV came from (the `tier` label of `kvblocks_block_reused_tokens_total`):
# the device pool, a spill tier (`kvblocks.spill`'s names), or computed by the request ("fill").
TIERS = ("device", "host", "disk", "redis", "fill")


@dataclass(slots=True)
class BlockUse:
    """One block of the prompt: where it starts, its length, how many of its tokens the block store
    already held and where (`origin`: the device pool's first, then each spill tier's, in order),
    and how many had their stored KV reused at this position."""

    start: int
    length: int
    stored: int
    reused: int
    origin: dict[str, int] = field(default_factory=dict)

    @property
    def device(self) -> int:
        """Tokens of the block the device pool held before the lookup."""
        return self.origin.get("device", 0)


@dataclass(slots=True)
class BlockReport:
    """A blended or concatenated prompt's accounting: `exact_tokens + reused_tokens +
    recomputed_tokens` is the prompt length; the probe and the fills are computed beside those
    positions. Only the exact tokens enter the prefix cache."""

    mode: str
    blend_recompute: float
    exact_tokens: int = 0  # the exact prefix hit (the result's `cached_tokens`)
    reused_tokens: int = 0  # block KV reused at a new position without recomputation ("blended")
    recomputed_tokens: int = 0  # prompt tokens after the exact prefix computed through all layers
    probe_tokens: int = 0  # tokens run through the first two layers to choose what to recompute
    block_fill_tokens: int = 0  # tokens computed to store blocks the store did not hold yet
    blocks: list[BlockUse] = field(default_factory=list)
    # reused tokens by where their KV came from: the "device" pool, a spill tier, "fill" (computed now)
    reused_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))

    def add_tiers(self, counts: dict[str, int]) -> None:
        for tier, n in counts.items():
            self.reused_by_tier[tier] = self.reused_by_tier.get(tier, 0) + n

    def explain(self) -> list[str]:
        """One line per block: where it was placed and what of it was reused."""
        lines = [
            f"kv_mode {self.mode} (blend_recompute {self.blend_recompute:g}): {self.exact_tokens} exact, "
            f"{self.reused_tokens} reused from blocks, {self.recomputed_tokens} recomputed; also computed: "
            f"{self.probe_tokens} probed (first two layers), {self.block_fill_tokens} to fill blocks"
        ]
        for i, b in enumerate(self.blocks):
            where = ", ".join(
                f"{n} {'on the' if t == 'device' else 'in'} {t}" for t, n in b.origin.items() if n
            )
            lines.append(
                f"block {i}: {b.length} tokens at offset {b.start}, {b.stored} found stored"
                f"{f' ({where})' if where else ''}, {b.reused} reused, {b.length - b.reused} recomputed"
            )
        return lines


@dataclass(slots=True, frozen=True)
class StoredBlock:
    """A block stored ahead of the requests that use it (`CachedGenerator.store_block`): its length,
    and how many of its tokens the store held already (in the device pool or a spill tier, a start
    it shares with another block included); the rest were computed now (`tokens - held`)."""

    tokens: int
    held: int

    @property
    def already_stored(self) -> bool:
        return self.held == self.tokens
