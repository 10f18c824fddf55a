"""A request on the packed path: its tokens, the KV slots that hold them, its output state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvblocks.blocks.segments import BlockSpan, flatten, is_segmented
from kvblocks.cache.trie import Hit, Salt, as_token_array
from kvblocks.engine import speculative
from kvblocks.engine.request import Request
from kvblocks.generate.decoding import Decoding
from kvblocks.generate.params import GenerationParams

if TYPE_CHECKING:
    from kvblocks.engine.slots import SlotManager
    from kvblocks.engine.speculative import Rounds
    from kvblocks.generate.generator import CachedGenerator
    from kvblocks.specdec.drafters import DraftSession
    from kvblocks.specdec.generator import SpecStats
    from kvblocks.specdec.tree import Shape


@dataclass(eq=False)
class Sequence:
    """`slots[i]` holds the KV of `sequence[i]` for `i < computed`; `slots[:start]` are the trie's
    (a locked prefix, never copied), the rest are the request's own until they pass to the trie."""

    request: Request
    out: Decoding  # the per-token rule's state: what the client receives
    salt: Salt
    sequence: list[int]  # prompt + generated
    cached_tokens: int = 0  # the prefix its first admission found cached
    hit: Hit | None = None  # the locked resident prefix
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    start: int = 0
    computed: int = 0
    committed_prompt: bool = False
    started: bool = False  # admitted once (a preempted one keeps its first cached_tokens)
    admitted_at: int = 0  # the scheduler's step number at its admission
    waited: int = 0  # admission passes that looked at it and passed it over
    held_back: int = 0  # steps in a row this long prefill sat out for a request's first token
    draft: DraftSession | None = None  # speculative decoding: the request's own drafter session
    spec: SpecStats | None = None
    gamma: int = 0
    proposal: tuple[
        Any, ...
    ] = ()  # this step's (drafts, q, tail_q), or (fed tokens, DraftTree, None), settled after the forward
    shape: Shape | None = None  # draft trees: this request's adaptive tree size
    marked: list[BlockSpan] = field(default_factory=list)  # KV blocks the client marked (promoted at its end)
    _array: np.ndarray | None = field(default=None, repr=False)

    def token_array(self) -> np.ndarray:
        """`sequence` as the trie's token array, converted once per length (`sequence` only grows):
        the trie's lookups, adoption and the scheduler's joins take it without converting a long
        prompt's list each time."""
        if self._array is None or len(self._array) != len(self.sequence):
            self._array = as_token_array(self.sequence)
        return self._array

    @classmethod
    def of(
        cls, request: Request, generator: CachedGenerator, slots: SlotManager, rounds: Rounds | None
    ) -> Sequence | None:
        """The packed path's state for `request`, or None when it needs the serial runner (a block to
        store, prompt log-probabilities or raw logits need a forward per position; a prompt reusing KV blocks at new
        positions is prefilled by `CachedGenerator`; a sequence that cannot fit in
        the pool beside the pinned prefixes needs its own cache)."""
        options = request.options
        if options.store_block or options.output_logits or options.params.prompt_logprobs is not None:
            return None
        if options.params.kv_mode != "exact":  # KV blocks are placed by the one-request path
            return None
        prompt = request.prompt
        marked: list[BlockSpan] = []
        if is_segmented(prompt):  # exact mode: its blocks count as a prefix, stored once it ends
            prompt, marked = flatten(generator.tokenizer, prompt)
        out = generator.prepare(prompt, options.params, started=request.submitted)
        gamma = rounds.max_gamma if rounds is not None else 0
        if not slots.fits(len(out.prompt_ids) + out.max_new_tokens + gamma):
            return None
        s = cls(request, out, options.salt, list(out.prompt_ids), marked=marked)
        if rounds is not None:
            speculative.start(rounds, s)
        return s

    @property
    def ids(self) -> list[int]:
        return self.out.prompt_ids

    @property
    def params(self) -> GenerationParams:
        return self.out.params

    @property
    def generated(self) -> list[int]:
        return self.out.generated

    @property
    def left(self) -> int:
        """Positions of `sequence` whose KV is not computed yet."""
        return len(self.sequence) - self.computed
