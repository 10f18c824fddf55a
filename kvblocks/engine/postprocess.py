"""Postprocessing of a packed step: the logits each sequence got become tokens and pieces.

Tokens are chosen and finished by the per-token rule (`kvblocks.generate.decoding`), the same one
the one-request path uses; here only what the engine adds around it: the prompt's KV passes to the
trie at the first token (right after that token is sent: every admission and lookup runs on this
thread, so none can miss it), a finished sequence's KV when it ends, then its result is recorded and
sent, and the KV blocks it marked wait for an idle step (`kvblocks.engine.promotion`).
"""

from __future__ import annotations

import torch

from kvblocks.engine import speculative
from kvblocks.engine.promotion import BlockPromotions
from kvblocks.engine.report import Reporter
from kvblocks.engine.scheduler import Scheduler
from kvblocks.engine.sequence import Sequence
from kvblocks.engine.slots import SlotManager


class Postprocessor:
    def __init__(
        self,
        report: Reporter,
        scheduler: Scheduler,
        slots: SlotManager,
        rounds: speculative.Rounds | None,
        promotions: BlockPromotions,
    ) -> None:
        self.report = report
        self.scheduler = scheduler
        self.slots = slots
        self.rounds = rounds
        self.promotions = promotions

    def advance(self, s: Sequence, n: int, logits: torch.Tensor) -> None:
        """The `n` tokens `s` fed hold KV now; the tokens they yield go through the per-token rule."""
        if s.proposal:
            assert self.rounds is not None, "only speculative rounds propose drafts"
            tokens = speculative.settle(self.rounds, s, logits, self.slots)
        else:
            s.computed += n
            if s.computed < len(s.sequence):  # a prefill chunk: no token yet
                return
            tokens = [(s.out.choose(logits[-1]), logits[-1])]
        for token, row in tokens:
            if self._accept(s, token, row):
                return

    def _accept(self, s: Sequence, token: int, logits: torch.Tensor) -> bool:
        """Append `token` (chosen from `logits`), emit its piece; True when it ends the request."""
        now = self.report.observe(s.request, 1)
        prompt = None if s.generated else len(s.sequence)  # the first token: the prompt is committed
        piece = s.out.push(token, logits, now)
        s.sequence.append(token)
        if s.out.finish is None:
            s.request.emit(piece)
            if prompt is not None:  # after the piece is out: every lookup runs on this thread, later
                self.slots.commit_prompt(s, prompt)
            return False
        if prompt is not None:
            self.slots.commit_prompt(s, prompt)
        self.scheduler.finished(s)
        self.slots.complete(s)
        if s.draft is not None:
            s.draft.end(s.sequence)
        piece = s.out.conclude(piece, now, cached_tokens=s.cached_tokens, spec=s.spec)
        assert piece.result is not None, "a concluded piece carries the result"
        self.report.record(s.request, piece.result)
        s.request.emit(piece)
        if s.marked:
            self.promotions.add(s.marked, s.salt)
        return True
