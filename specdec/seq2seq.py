"""Speculative decoding for encoder-decoder targets.

The draft/verify loop is `SpeculativeGenerator`'s; what changes is the cache a round rolls back.
A seq2seq runner crops the decoder's self-attention only: the cross-attention K/V depend on the
source alone and stay as they are. A seq2seq drafter (same tokenizer) runs its own encoder once
per source (or reuses its record from its own `Seq2SeqCache`) and drafts decoder tokens; the
prompt-lookup drafter also copies from the source, and the trie drafter reads the target's
decoder trie under the request's source scope.
"""

from __future__ import annotations

from kvblocks.generate.generator import context_length
from kvblocks.seq2seq.cache import Seq2SeqCache, SourceScope
from kvblocks.seq2seq.generator import (
    Seq2SeqCachedGenerator,
    Seq2SeqRunner,
    keep_source,
    new_past,
    open_source,
)

from .drafters import Drafter, ModelDrafter, ModelDraftSession
from .generator import SpeculativeGenerator

__all__ = ["Seq2SeqModelDrafter", "Seq2SeqSpeculativeGenerator"]


class Seq2SeqSpeculativeGenerator(Seq2SeqCachedGenerator, SpeculativeGenerator):
    """`SpeculativeGenerator` for a seq2seq target: `Seq2SeqPrompt` requests, source reuse from a
    `Seq2SeqCache`, drafts from any drafter (a `Seq2SeqModelDrafter`, prompt lookup, the trie)."""

    def __init__(
        self, model, tokenizer, cache: Seq2SeqCache | None, drafter: Drafter, gamma: int = 4, **options
    ):
        SpeculativeGenerator.__init__(
            self, model, tokenizer, cache.decoder if cache is not None else None, drafter, gamma, **options
        )
        self.bind_seq2seq(cache)

    def _state_layout(self, run) -> None:
        """A seq2seq decoder keeps no recurrent state: every rollback is a crop."""
        return None


class Seq2SeqModelDrafter(ModelDrafter):
    """A smaller seq2seq model with the target's tokenizer, with its own `Seq2SeqCache` (or none)."""

    def __init__(self, draft_model, draft_cache: Seq2SeqCache | None = None) -> None:
        self.model = draft_model
        self.seq2seq = draft_cache
        self.cache = draft_cache.decoder if draft_cache is not None else None
        self.runner = Seq2SeqRunner(draft_model)
        self.max_context = context_length(draft_model.config)

    def start(self, prompt_ids: list[int], salt: SourceScope) -> Seq2SeqDraftSession:
        if getattr(salt, "source", None) is None:
            raise TypeError("a seq2seq drafter drafts for a seq2seq target (its scope carries the source)")
        return Seq2SeqDraftSession(self, prompt_ids, salt)


class Seq2SeqDraftSession(ModelDraftSession):
    """The drafter's own source (encoded once, or its cached record) and decoder cache for one request."""

    def __init__(self, drafter: Seq2SeqModelDrafter, prompt_ids: list[int], salt: SourceScope) -> None:
        self.drafter = drafter
        self.salt = open_source(drafter.runner, drafter.seq2seq, salt.source.ids, salt)
        self.hit = (
            drafter.cache.match_or_miss(prompt_ids, salt=self.salt) if drafter.cache is not None else None
        )
        self.past = new_past(self.hit, self.salt)
        self.length = self.hit.length if self.hit is not None else 0

    def end(self, committed: list[int]) -> None:
        if self.past is not None:
            keep_source(self.drafter.seq2seq, self.salt, self.past)
        super().end(committed)
