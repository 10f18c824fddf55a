"""The prompt side of a `CachedGenerator` that an engine may interleave with other requests: a
prompt prefilled in forwards of at most `chunk` tokens, each followed by a `Working` step, and the
prompt's log-probabilities. The forwards depend on the prompt and its hit only, never on when the
engine takes them, so the bits do not either.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING

import torch

from kvblocks.generate.block_steps import Working
from kvblocks.generate.runner import ModelRunner
from kvblocks.generate.sampling import TokenLogprob, token_logprobs

if TYPE_CHECKING:
    from kvblocks.adapters.hf_trie import KVCacheTrie
    from kvblocks.generate.generator import DecodeState


class PromptSteps:
    """Prompt work of a generator; `CachedGenerator` is one (it sets the attributes below)."""

    cache: KVCacheTrie | None
    runner: ModelRunner
    # (ids, run, end, keep): forward `ids[run.computed:end]`, the logits of the last `keep` positions
    _prefill: Callable[[list[int], DecodeState, int, int], torch.Tensor]

    def _prompt_work(
        self, ids: list[int], run: DecodeState, k: int | None, chunk: int | None
    ) -> Generator[Working, None, list[TokenLogprob | None] | None]:
        """What precedes the decode: the prompt's log-probabilities (`k` per position) when asked
        for, else, with `chunk`, all but the last forward of the prompt (`_decode` runs that one)."""
        chunk = chunk if self._chunks_prefill() else None
        if k is not None:
            return (yield from self._prompt_logprobs(ids, run, k, chunk))
        if chunk is not None:
            yield from self._prefill_steps(ids, run, len(ids) - chunk, chunk)
        return None

    def _prompt_logprobs(
        self, ids: list[int], run: DecodeState, k: int, chunk: int | None = None
    ) -> Generator[Working, None, list[TokenLogprob | None]]:
        """Score each prompt token after the first by the positions before it.

        Computes all but the last prompt token (in forwards of `chunk` tokens, a `Working` step after
        each, when given); the decode strategy then feeds the last one, as it does after a full cache
        hit, so the tokens generated next are those of any other request.
        """
        assert run.computed == 0
        if len(ids) == 1:
            return [None]
        if chunk is None:
            rows = self._prefill(ids, run, len(ids) - 1, 0)
        else:
            steps = yield from self._prefill_steps(ids, run, len(ids) - 1, chunk, keep=0)
            assert steps is not None, "a prompt of two or more tokens leaves at least one to compute"
            rows = steps
        return [None, *token_logprobs(rows, ids[1:], k)]

    def _chunks_prefill(self) -> bool:
        """Whether a prompt may be prefilled in several forwards the same as in one: not where a
        forward's length changes what is computed (one-token steps, recurrent state)."""
        return not self.runner.stepwise and (self.cache is None or self.cache.min_prefill == 1)

    def _prefill_steps(
        self, ids: list[int], run: DecodeState, end: int, chunk: int, keep: int = 1
    ) -> Generator[Working, None, torch.Tensor | None]:
        """`_prefill` up to `end` in forwards of at most `chunk` tokens, a `Working` step after each;
        the logits `_prefill` gives (of every position with `keep=0`), None when nothing was left."""
        rows: list[torch.Tensor] = []
        while run.computed < end:
            start = run.computed
            rows.append(self._prefill(ids, run, min(end, start + chunk), keep))
            yield Working(run.computed - start)
        if not rows:
            return None
        return torch.cat(rows) if keep == 0 else rows[-1]
