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

from kvblocks.specdec.generator import SpecStats

if TYPE_CHECKING:
    from kvblocks.engine.sequence import Sequence
    from kvblocks.engine.slots import SlotManager


@runtime_checkable
class Rounds(Protocol):
    """What a generator offers for its decoding to run as rounds of the packed forward
    (`SpeculativeGenerator` does)."""

    drafter: object
    gamma: int
    max_gamma: int

    def propose(self, session, committed, gamma, params, rng): ...

    def settle(self, logits, proposal, params, rng, stats, gamma): ...


def start(generator: Rounds, s: Sequence) -> None:
    """`s` drafts in its own session from its first admission to its end."""
    s.draft = generator.drafter.start(s.ids, s.salt)
    s.gamma = generator.gamma
    s.spec = SpecStats(s.gamma)


def propose(generator: Rounds, s: Sequence, room: int) -> int:
    """Draft this round's tokens for `s` (at most `room`); returns how many."""
    s.proposal = generator.propose(s.draft, s.sequence, room, s.params.sampling, s.out.rng)
    return len(s.proposal[0])


def settle(
    generator: Rounds, s: Sequence, logits: torch.Tensor, slots: SlotManager
) -> list[tuple[int, torch.Tensor]]:
    """Accept a prefix of the drafts and one token of the target's; the rejected drafts' slots go
    back (rollback = a shorter slot list). The committed tokens with their logits rows, in order."""
    proposal, s.proposal = s.proposal, ()
    drafts = proposal[0]
    n, token, s.gamma = generator.settle(logits, proposal, s.params.sampling, s.out.rng, s.spec, s.gamma)
    s.computed += 1 + n  # the fed token and the accepted drafts hold KV now
    slots.trim(s, s.computed)
    s.draft.rollback(len(s.sequence) + n)
    return list(zip([*drafts[:n], token], logits))
