"""Speculative rounds inside the packed forward: draft, feed the drafts as one multi-token segment,
settle, roll back by slot-list length.

A sequence's prompt is prefilled up to its last token; each later step is a round: the drafter
proposes (its own session, as on the one-request path), the last token and the drafts are one
segment with every row's logits kept, the generator's `settle` accepts a prefix of them, and the
rejected drafts' slots go back. Same drafts, same rng order, same tokens as the one-request path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from kvblocks.engine import tree as trees
from kvblocks.specdec.generator import SpecStats
from kvblocks.specdec.tree import DraftTree, Shape

if TYPE_CHECKING:
    from kvblocks.engine.sequence import Sequence
    from kvblocks.engine.slots import SlotManager
    from kvblocks.generate.decoding import Decoding
    from kvblocks.generate.sampling import SamplingParams
    from kvblocks.specdec.drafters import Drafter, DraftSession
    from kvblocks.specdec.tree import Sure, TreeShape

Proposal = tuple[list[int], "torch.Tensor | None", "torch.Tensor | None"]


@runtime_checkable
class Rounds(Protocol):
    """What a generator offers for its decoding to run as rounds of the packed forward
    (`SpeculativeGenerator` does)."""

    drafter: Drafter
    gamma: int
    max_gamma: int
    tree: TreeShape | None  # draft trees' shape, None for chains
    sure: Sure  # how sure scored trees were, shared by every request

    def propose(
        self,
        session: DraftSession,
        committed: list[int],
        gamma: int,
        params: SamplingParams,
        rng: torch.Generator | None,
        out: Decoding | None = None,
    ) -> Proposal: ...

    def settle(
        self,
        logits: torch.Tensor,
        proposal: Proposal,
        params: SamplingParams,
        rng: torch.Generator | None,
        stats: SpecStats,
        gamma: int,
    ) -> tuple[int, int, int]: ...

    def propose_tree(
        self,
        session: DraftSession,
        committed: list[int],
        shape: Shape,
        params: SamplingParams,
        rng: torch.Generator | None,
        others: int = 0,
        room: int | None = None,
        out: Decoding | None = None,
    ) -> DraftTree: ...

    def fed_tokens(self, tree: DraftTree) -> list[int]: ...

    def settle_tree(
        self,
        logits: torch.Tensor,
        tree: DraftTree,
        params: SamplingParams,
        rng: torch.Generator | None,
        stats: SpecStats,
        shape: Shape,
    ) -> tuple[list[int], int]: ...


def start(generator: Rounds, s: Sequence) -> None:
    """`s` drafts in its own session from its first admission to its end."""
    s.draft = generator.drafter.start(s.ids, s.salt)
    s.gamma = generator.gamma
    s.spec = SpecStats(s.gamma)
    if generator.tree is not None:
        s.shape = Shape(generator.tree, shared=generator.sure)


def room(s: Sequence) -> int:
    """The most drafts `s` may feed this round: its gamma, or its tree's node budget."""
    return s.shape.budget if s.shape is not None else s.gamma


def propose(generator: Rounds, s: Sequence, room: int, others: int = 0) -> int:
    """Draft this round's tokens for `s` (at most `room`; a tree smaller beside `others` running
    requests); returns how many."""
    params, rng = s.params.sampling, s.out.rng
    assert s.draft is not None, "`start` opened the request's draft session"
    if s.shape is not None:
        tree = generator.propose_tree(s.draft, s.sequence, s.shape, params, rng, others, room, s.out)
        s.proposal = (generator.fed_tokens(tree), tree, None)
        return len(tree)
    s.proposal = generator.propose(s.draft, s.sequence, room, params, rng, s.out)
    return len(s.proposal[0])


def segment_tree(s: Sequence, n: int) -> tuple[int, ...] | None:
    """The packed segment's `tree` for a round of `n` fed tokens of `s` (None: a chain, causal)."""
    tree = s.proposal[1] if s.proposal else None
    if not isinstance(tree, DraftTree) or tree.is_chain:
        return None
    return trees.segment_tree(n - len(tree), tree.parents)


def settle(
    generator: Rounds, s: Sequence, logits: torch.Tensor, slots: SlotManager
) -> list[tuple[int, torch.Tensor]]:
    """Accept a prefix of the drafts and one token of the target's; the rejected drafts' slots go
    back (rollback = a shorter slot list). The committed tokens with their logits rows, in order."""
    proposal, s.proposal = s.proposal, ()
    if isinstance(proposal[1], DraftTree):
        return _settle_tree(generator, s, proposal[1], logits, slots)
    drafts = proposal[0]
    assert s.spec is not None, "`start` set the request's stats"
    n, token, s.gamma = generator.settle(logits, proposal, s.params.sampling, s.out.rng, s.spec, s.gamma)
    s.computed += 1 + n  # the fed token and the accepted drafts hold KV now
    slots.trim(s, s.computed)
    assert s.draft is not None, "`start` opened the request's draft session"
    s.draft.rollback(len(s.sequence) + n)
    return list(zip([*drafts[:n], token], logits))


def _settle_tree(
    generator: Rounds, s: Sequence, tree: DraftTree, logits: torch.Tensor, slots: SlotManager
) -> list[tuple[int, torch.Tensor]]:
    """A tree round: the accepted path's slots follow the fed tokens' in the slot list (their KV
    stays where the forward wrote it), every other node's slots go back."""
    head = len(logits) - len(tree)  # committed tokens fed before the tree (its root last)
    rows = logits[head - 1 :]
    assert s.spec is not None and s.shape is not None, "`start` set the request's stats and shape"
    path, token = generator.settle_tree(rows, tree, s.params.sampling, s.out.rng, s.spec, s.shape)
    base = s.computed + head
    slots.keep(s, base, path)
    s.computed = base + len(path)
    assert s.draft is not None, "`start` opened the request's draft session"
    s.draft.rollback(len(s.sequence) + len(path))
    return list(zip([*tree.path_tokens(path), token], rows[[0, *(i + 1 for i in path)]]))
