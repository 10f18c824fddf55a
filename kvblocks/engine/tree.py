"""Draft-tree segments of a packed forward: positions by depth and the ancestor mask.

A segment with a `tree` (`attention.batch.Segment.tree`) holds a speculative round's new tokens as a tree:
`tree[j]` is the new token that token j follows (-1: the segment's last prefix position), so a chain
is `[-1, 0, 1, ...]`. Token j sits at position `start - 1 + depth(j)` and attends the prefix and
its own ancestors among the new tokens, never a sibling branch. Such segments take a call of their
own per layer (`attention.per_segment.plain_attention`), beside the kernel and cascade plans of the others.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def depths(tree: Sequence[int]) -> np.ndarray:
    """Depth of each new token (a child of the prefix: 1)."""
    out = np.zeros(len(tree), dtype=np.int64)
    for j, p in enumerate(tree):
        assert -1 <= p < j, "a tree token follows an earlier one"
        out[j] = 1 if p < 0 else out[p] + 1
    return out


def positions(start: int, tree: Sequence[int]) -> np.ndarray:
    return start - 1 + depths(tree)


def ancestors(tree: Sequence[int]) -> np.ndarray:
    """`[n, n]`: new token j is token i or one of its ancestors."""
    n = len(tree)
    seen = np.eye(n, dtype=bool)
    for j, p in enumerate(tree):
        if p >= 0:
            seen[j] |= seen[p]
    return seen


def visible(start: int, length: int, first: int, tree: Sequence[int], window: int | None) -> np.ndarray:
    """`[n, length - first]`: which keys (positions `first..length - 1`, the new tokens last) each
    new token attends: the prefix and its ancestors, within `window` of its position by position."""
    n = len(tree)
    q = positions(start, tree)[:, None]
    k = np.concatenate([np.arange(first, start), positions(start, tree)])[None, :]
    allowed = np.ones((n, length - first), dtype=bool)
    allowed[:, start - first :] = ancestors(tree)
    if window is not None:
        allowed &= k > q - window
    return allowed


def segment_tree(head: int, parents: Sequence[int]) -> tuple[int, ...]:
    """A round's `tree` for `head` committed tokens fed causally, then draft nodes with `parents`
    (-1: a child of the last committed token)."""
    return tuple(range(-1, head - 1)) + tuple(head + p if p >= 0 else head - 1 for p in parents)
