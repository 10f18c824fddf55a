"""Draft trees: several continuations verified in one target forward (SpecInfer, Miao et al. 2024).

A `DraftTree` holds `n` draft tokens in depth-first order with each node's parent (-1: a child of
the root, the last committed token), so a chain is the tree of width 1 (`parents = [-1, 0, 1, ...]`).
The target reads it in one forward: the root and the nodes as new tokens, each seeing the prefix and
its own ancestors (`ancestors`), at position `root + depth` (`depths`). Row 0 of the logits is the
root's, row `i + 1` node `i`'s.

`accept` walks the tree from the root with the target's distributions (SpecInfer's multi-step
speculative sampling): greedy takes the child equal to the target's argmax; a point-mass tree
(trie, prompt lookup, top-k) takes the child equal to the target's own sample, so the emitted token
is distributed exactly as p; a tree whose siblings were drawn i.i.d. from the drafter's q at their
parent (`sampled`) accepts sibling x with probability min(1, r(x) / q(x)), r starting at p and
becoming norm(max(0, r - q)) after each rejection, and samples r when every sibling is rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .rejection import acceptance_probability, residual


@dataclass(slots=True)
class DraftTree:
    """`tokens[i]` with parent `parents[i]` (< i, or -1 for the root's children), depth-first.
    `q[i]`: the drafter's distribution node i was drawn from (the one at its parent), for a `sampled`
    tree; None for point masses."""

    tokens: list[int]
    parents: list[int]
    q: torch.Tensor | None = None
    sampled: bool = False

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.parents)
        assert all(-1 <= p < i for i, p in enumerate(self.parents)), "parents come first (depth-first order)"
        assert not self.sampled or (self.q is not None and len(self.q) == len(self.tokens))

    @classmethod
    def chain(cls, tokens: list[int], q: torch.Tensor | None = None) -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), q, q is not None)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Each node's depth (the root's children: 1)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    @property
    def depth(self) -> int:
        return max(self.depths(), default=0)

    def children(self, node: int) -> list[int]:
        """`node`'s children in order (node -1: the root's)."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def ancestors(self) -> np.ndarray:
        """`[n, n]` booleans: node j is node i or one of its ancestors."""
        n = len(self.parents)
        seen = np.eye(n, dtype=bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                seen[i] |= seen[p]
        return seen

    def path_tokens(self, path: list[int]) -> list[int]:
        return [self.tokens[i] for i in path]

    def prune(self, keep: list[bool]) -> DraftTree:
        """The nodes with `keep` whose ancestors are all kept, renumbered."""
        index: dict[int, int] = {}
        tokens, parents, rows = [], [], []
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            if keep[i] and (p < 0 or p in index):
                index[i] = len(tokens)
                tokens.append(t)
                parents.append(-1 if p < 0 else index[p])
                rows.append(i)
        q = None if self.q is None else self.q[rows]
        return DraftTree(tokens, parents, q, self.sampled)

    def truncated(self, budget: int, depth: int) -> DraftTree:
        """At most `budget` nodes (the first in depth-first order) of depth at most `depth`."""
        depths = self.depths()
        keep, count = [], 0
        for d in depths:
            ok = d <= depth and count < budget
            keep.append(ok)
            count += ok
        return self.prune(keep)


def depth_first(
    tokens: list[int], parents: list[int], q: torch.Tensor | None = None, sampled=False
) -> DraftTree:
    """Nodes made in any order (each parent before its children) as a `DraftTree`: depth-first,
    siblings in the order they were made."""
    path: list[tuple[int, ...]] = []
    for i, p in enumerate(parents):
        assert p < i
        path.append((*path[p], i) if p >= 0 else (i,))
    ranked = sorted(range(len(tokens)), key=lambda i: path[i])
    new = {old: k for k, old in enumerate(ranked)}
    return DraftTree(
        [tokens[i] for i in ranked],
        [new[parents[i]] if parents[i] >= 0 else -1 for i in ranked],
        None if q is None else q[ranked],
        sampled,
    )


def merge(chains: list[list[int]], budget: int) -> DraftTree:
    """Chains (best first) merged into one point-mass tree of at most `budget` nodes: shared
    prefixes once, each chain's new nodes after the nodes of the chains before it."""
    tokens: list[int] = []
    parents: list[int] = []
    child: dict[tuple[int, int], int] = {}
    for chain in chains:
        node = -1
        for t in chain:
            if (node, t) in child:
                node = child[node, t]
                continue
            if len(tokens) >= budget:
                break
            child[node, t] = len(tokens)
            tokens.append(t)
            parents.append(node)
            node = len(tokens) - 1
    return depth_first(tokens, parents)


def accept(
    p: torch.Tensor, tree: DraftTree, greedy: bool, rng: torch.Generator | None
) -> tuple[list[int], int]:
    """(the accepted path's nodes, the token the target emits after them). `p` is `[n + 1, V]`:
    row 0 the root's distribution, row i + 1 node i's."""
    assert p.shape[0] == len(tree) + 1
    path: list[int] = []
    node = -1
    while True:
        kids = tree.children(node)
        r = p[node + 1]
        if greedy:
            token = int(r.argmax())
        elif not tree.sampled:
            token = _sample(r, rng)
        else:
            chosen = None
            for c in kids:
                qc = tree.q[c]
                if tree.tokens[c] >= r.shape[-1]:  # outside the target's vocabulary: p = 0
                    r = residual(r, qc)
                    continue
                if _uniform(rng, r) < acceptance_probability(r, qc, tree.tokens[c]):
                    chosen = c
                    break
                r = residual(r, qc)
            if chosen is None:
                return path, _sample(r, rng)
            path.append(chosen)
            node = chosen
            continue
        match = next((c for c in kids if tree.tokens[c] == token), None)
        if match is None:
            return path, token
        path.append(match)
        node = match


def _sample(probs: torch.Tensor, rng: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=rng))


def _uniform(rng: torch.Generator | None, like: torch.Tensor) -> float:
    return float(torch.rand((), generator=rng, device=like.device, dtype=torch.float64))


@dataclass(slots=True)
class TreeShape:
    """How big a request's draft trees may grow: `budget` nodes (SGLang's
    `--speculative-num-draft-tokens`), `depth` levels (`--speculative-num-steps`, the chain's
    gamma) and `width` children per node (`--speculative-eagle-topk`). With `adaptive`, each request's
    budget follows its measured acceptance (`Shape.after`) and the batch (`Shape.for_batch`)."""

    budget: int = 8
    depth: int = 4
    width: int = 4
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.budget < 1 or self.depth < 1 or self.width < 1:
            raise ValueError(f"a tree needs budget, depth and width >= 1, got {self}")
        self.depth = min(self.depth, self.budget)


@dataclass(slots=True)
class Shape:
    """One request's current tree size, adapted after every round within its `TreeShape`. A round
    whose accepted path left the first branch (what only a tree could find) doubles the budget and
    widens the tree; `PATIENCE` rounds in a row without one halve it and narrow it, down to a
    chain (width 1) where extra branches do not pay; a chain tries width 2 again every `PROBE`
    rounds, so a request whose continuations start to fork gets its tree back."""

    limit: TreeShape
    budget: int = 0
    width: int = 0
    idle: int = 0  # rounds since a side branch was last accepted

    PATIENCE = 4
    PROBE = 16
    FULL = 8  # other requests in the forward from which a round drafts a chain

    def __post_init__(self) -> None:
        self.budget = self.budget or self.limit.budget
        self.width = self.width or self.limit.width

    def for_batch(self, others: int) -> tuple[int, int]:
        """(budget, width) this round with `others` requests in the same forward: a full batch gets
        small trees (every extra node is a row of the forward all of them wait for)."""
        if not self.limit.adaptive or others == 0 or self.width == 1:
            return self.budget, self.width
        if others >= self.FULL:  # every row is another request's too: a chain
            return self.limit.depth, 1
        budget = max(self.limit.depth, self.budget // (1 + others // 2))
        return budget, self.width if budget > self.limit.depth else 1

    def after(self, tree: DraftTree, path: list[int]) -> None:
        """Adapt to one round's tree and the path the target accepted in it."""
        if not self.limit.adaptive or not len(tree):
            return
        if path != list(range(len(path))):  # left the first branch
            self.idle = 0
            self.width = min(self.width + 1, self.limit.width)
            self.budget = min(self.budget * 2, self.limit.budget)
            return
        self.idle += 1
        if self.width > 1 and self.idle >= self.PATIENCE:
            self.idle = 0
            self.width -= 1
            self.budget = self.limit.depth if self.width == 1 else max(self.limit.depth, self.budget // 2)
        elif self.width == 1 and self.idle >= self.PROBE and self.limit.width > 1:
            self.idle = 0
            self.width, self.budget = 2, min(2 * self.limit.depth, self.limit.budget)
