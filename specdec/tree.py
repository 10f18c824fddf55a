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

import heapq
from collections.abc import Callable
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
    # each node's estimated chance of being on the accepted path (a point-mass tree `grow` built),
    # at most its parent's; None: unscored
    scores: list[float] | None = None

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.parents)
        assert self.scores is None or len(self.scores) == len(self.tokens)
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
        scores = None if self.scores is None else [self.scores[i] for i in rows]
        return DraftTree(tokens, parents, q, self.sampled, scores)

    def ranked(self) -> list[int]:
        """The nodes best first (by score, then depth-first order): every prefix of it is a tree,
        as a node scores at most its parent and comes after it."""
        assert self.scores is not None
        return sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], i))

    def best(self, k: int) -> DraftTree:
        """The `k` best-scored nodes (`ranked`)."""
        keep = [False] * len(self.tokens)
        for i in self.ranked()[:k]:
            keep[i] = True
        return self.prune(keep)

    def ended(self, ends: frozenset[int]) -> DraftTree:
        """Without the nodes below a token of `ends` (the request's end of sequence: nothing after
        it is ever emitted, so verifying what follows it is rows of the forward spent for nothing)."""
        if not any(t in ends for t in self.tokens):
            return self
        return self.prune([p < 0 or self.tokens[p] not in ends for p in self.parents])

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
    tokens: list[int],
    parents: list[int],
    q: torch.Tensor | None = None,
    sampled=False,
    scores: list[float] | None = None,
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
        None if scores is None else [scores[i] for i in ranked],
    )


def grow(
    expand: Callable[[tuple[int, ...]], list[tuple[int, float]]],
    budget: int,
    depth: int,
    width: int,
    ends: frozenset[int] = frozenset(),
) -> DraftTree:
    """A point-mass tree grown best first (EAGLE-2's dynamic tree): `expand(path)` gives the
    children after the draft tokens `path` as (token, probability), most likely first; a node's
    score is the product of the probabilities down to it, and the next node added is always the
    best-scored one whose parent is in, so the tree runs deep where its branches are sure and
    forks where they are not. At most `budget` nodes, `depth` levels, `width` children a node; a
    token of `ends` (the end of sequence) gets no children."""
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    paths: list[tuple[int, ...]] = []
    heap: list[tuple[float, int, int, int]] = []  # (-score, tie, parent, token)
    tie = 0

    def push(parent: int, path: tuple[int, ...], score: float) -> None:
        nonlocal tie
        if len(path) >= depth:
            return
        for token, p in expand(path)[:width]:
            if p > 0:
                heapq.heappush(heap, (-score * p, tie, parent, token))
                tie += 1

    push(-1, (), 1.0)
    while heap and len(tokens) < budget:
        neg, _, parent, token = heapq.heappop(heap)
        path = (*paths[parent], token) if parent >= 0 else (token,)
        tokens.append(token)
        parents.append(parent)
        scores.append(-neg)
        paths.append(path)
        if token not in ends:
            push(len(tokens) - 1, path, -neg)
    return depth_first(tokens, parents, scores=scores)


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
    gamma) and `width` children per node (`--speculative-eagle-topk`). With `adaptive`, a drafter
    that scores its nodes (prompt lookup, the trie) grows each round's tree best first within these
    bounds and the generator cuts it to the most expected tokens per second for the batch
    (`specdec.cost.best_cut`); another's budget follows its measured acceptance (`Shape.after`) and
    the batch (`Shape.for_batch`)."""

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
    # scored trees (`grow`): the chance the target goes on as the drafter's source did, measured
    sure: float = 0.8
    tested: float = 0.0  # decayed sums over the forks the target was tested at: expected share,
    hits: float = 0.0  # and how often it took one of the tree's children there
    # the generator's sums over every request: a new request starts from what its drafter scored
    shared: Sure | None = None

    PATIENCE = 4
    PROBE = 16
    FULL = 8  # other requests in the forward from which a round drafts a chain

    def __post_init__(self) -> None:
        self.budget = self.budget or self.limit.budget
        self.width = self.width or self.limit.width
        if self.shared is not None:
            self.sure = self.shared.value()

    def for_batch(self, others: int) -> tuple[int, int]:
        """(budget, width) this round with `others` requests in the same forward: a full batch gets
        small trees (every extra node is a row of the forward all of them wait for)."""
        if not self.limit.adaptive or others == 0 or self.width == 1:
            return self.budget, self.width
        if others >= self.FULL:  # every row is another request's too: a chain
            return self.limit.depth, 1
        budget = max(self.limit.depth, self.budget // (1 + others // 2))
        return budget, self.width if budget > self.limit.depth else 1

    PRIOR = 2.0  # rounds' worth of weight the starting `sure` keeps
    DECAY = 0.95

    def after(self, tree: DraftTree, path: list[int]) -> None:
        """Adapt to one round's tree and the path the target accepted in it."""
        if not self.limit.adaptive or not len(tree):
            return
        if tree.scores is not None:
            self._measure(tree, path)
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

    def _measure(self, tree: DraftTree, path: list[int]) -> None:
        """`sure` from a scored round: at each node the walk reached (the root, then the path),
        the tree predicted the target would take one of its children with probability
        `sure * shares` (the scores' ratio to the node's); it did on the path, not at its end."""
        scores = tree.scores
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(tree.parents):
            kids.setdefault(p, []).append(i)
        tested = hits = 0.0
        for node, took in zip([-1, *path], [*(True for _ in path), False]):
            if node not in kids:
                break  # a leaf: the target was not tested there
            base = 1.0 if node < 0 else scores[node]
            tested += sum(scores[c] for c in kids[node]) / base / self.sure if base > 0 else 0.0
            hits += took
        self.tested = self.tested * self.DECAY + tested
        self.hits = self.hits * self.DECAY + hits
        prior = self.PRIOR * (self.shared.value() if self.shared is not None else Sure.START)
        self.sure = min(max((self.hits + prior) / (self.tested + self.PRIOR), 0.05), 0.98)
        if self.shared is not None:
            self.shared.add(tested, hits)


@dataclass(slots=True)
class Sure:
    """How often a drafter's continuations were taken where it had some, over every request of a
    generator (decayed sums; benign races between threads): each request's `Shape.sure` starts here."""

    tested: float = 0.0
    hits: float = 0.0

    START = 0.8  # before any round
    WEIGHT = 4.0  # rounds' worth of weight START keeps
    DECAY = 0.98

    def value(self) -> float:
        v = (self.hits + self.WEIGHT * self.START) / (self.tested + self.WEIGHT)
        return min(max(v, 0.05), 0.98)

    def add(self, tested: float, hits: float) -> None:
        self.tested = self.tested * self.DECAY + tested
        self.hits = self.hits * self.DECAY + hits
