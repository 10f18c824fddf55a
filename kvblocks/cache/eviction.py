"""Which resident tokens go first when the device pool is full: pluggable eviction policies.

The radix tree evicts leaves from their tails, lowest key first; a policy only orders leaves. It
sees a node's last access (a tick of the tree's clock), how many lookups passed through it
(`hits`), the stamp it gave the node at its last access, and the depth of the node's last token.

- `lru`: least recently used first. Simple and right for conversations, where the newest tail is
  the next turn's prefix; under pressure it keeps one-shot question and reply tails and trims a
  system prompt that many requests share.
- `gdsf`: Greedy-Dual-Size-Frequency adapted to KV (Cao & Irani 1997; Cherkasova 1998). A node's
  key is `stamp + (hits + 1) * cost`, where `cost` is the relative price of recomputing one of its
  tokens (1 plus its depth over `attention_tokens`: attention makes deep tokens dearer) and `stamp`
  is the policy's inflation value L when the node was last touched. Each eviction raises L to the
  evicted key, so an entry's frequency credit ages: a prefix hit often long ago ends up below one hit
  once just now. Size drops out because eviction is token-granular (keys are per token). Ties go to
  the least recently used.

A recurrent-state snapshot (hybrid models) is an entry too: `lru` orders it by its node's last
access; `gdsf` prices it per slot as the tokens it saves (those since the snapshot above it, which a
hit would recompute without it) over the slots it takes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvblocks.cache.radix import Node

DEFAULT_POLICY = "gdsf"


class EvictionPolicy(Protocol):
    name: str

    def stamp(self) -> float:
        """The value a node records when it is touched (inserted, extended or matched)."""
        ...

    def key(self, node: Node, depth: int) -> tuple[float, int]:
        """The node's eviction order, lowest first; `depth` counts the tokens from the root to the
        end of the node."""
        ...

    def evicted(self, key: tuple[float, int]) -> None:
        """Called with the key of every leaf that is trimmed."""
        ...

    def snapshot_key(self, node: Node, depth: int, saves: int, slots: int) -> tuple[float, int]:
        """The eviction order of the recurrent-state snapshot at the end of `node` (at `depth`): it
        saves recomputing `saves` tokens on a hit and takes `slots` pool slots."""
        ...


class LRU:
    """Least recently used first."""

    name = "lru"

    def stamp(self) -> float:
        return 0.0

    def key(self, node: Node, depth: int) -> tuple[float, int]:
        return (float(node.last_access), node.last_access)

    def evicted(self, key: tuple[float, int]) -> None:
        pass

    def snapshot_key(self, node: Node, depth: int, saves: int, slots: int) -> tuple[float, int]:
        return self.key(node, depth)


class GreedyDualFrequency:
    """GDSF for token prefixes: frequency times recompute cost, aged by an inflation value."""

    name = "gdsf"

    def __init__(self, attention_tokens: int = 4096) -> None:
        if attention_tokens < 1:
            raise ValueError(f"attention_tokens must be at least 1, got {attention_tokens}")
        self.attention_tokens = attention_tokens
        self.inflation = 0.0

    def stamp(self) -> float:
        return self.inflation

    def key(self, node: Node, depth: int) -> tuple[float, int]:
        cost = 1.0 + depth / self.attention_tokens
        return (node.stamp + (node.hits + 1) * cost, node.last_access)

    def evicted(self, key: tuple[float, int]) -> None:
        self.inflation = max(self.inflation, key[0])

    def snapshot_key(self, node: Node, depth: int, saves: int, slots: int) -> tuple[float, int]:
        """Value per slot: the tokens it saves (each priced like a token at this depth) over its slots."""
        cost = (1.0 + depth / self.attention_tokens) * saves / max(slots, 1)
        return (node.stamp + (node.hits + 1) * cost, node.last_access)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRU, "gdsf": GreedyDualFrequency}


def make_policy(policy: str | EvictionPolicy | None) -> EvictionPolicy:
    """A policy by name (`lru`, `gdsf`), a policy object as it is, or the default for None."""
    if policy is None:
        policy = DEFAULT_POLICY
    if isinstance(policy, str):
        try:
            return POLICIES[policy]()
        except KeyError:
            raise ValueError(
                f"unknown eviction policy '{policy}'; choose from {', '.join(POLICIES)}"
            ) from None
    return policy
