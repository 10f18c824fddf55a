"""CachedGenerator: generation that re-attaches the cached prefix and prefills only the suffix.

`stream` drives one request: it prepares the cache, lets a decode strategy (`_decode`, one token
per forward here, draft/verify in `specdec`) yield tokens, and turns them into text pieces, stop
conditions, log-probabilities and, when the request ends, cache inserts.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvblocks.adapters import hf
from kvblocks.adapters.hf_trie import KVCacheTrie
from kvblocks.blocks.segments import BlockSpan, flatten, is_segmented
from kvblocks.cache.snapshots import SnapshotPlan
from kvblocks.cache.trie import Hit, Salt
from kvblocks.generate.block_steps import BlockSteps, Working
from kvblocks.generate.decoding import Decoding, GenerationResult, Piece, context_room
from kvblocks.generate.params import GenerationParams, ParamError, params_of
from kvblocks.generate.prompt_steps import PromptSteps
from kvblocks.generate.runner import ModelRunner, context_length, eos_token_ids, vocab_size
from kvblocks.generate.sampling import LogitsProcessor, seeded_rng
from kvblocks.generate.text import Prompt, PromptError, StopTextAssembler, encode_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "CachedGenerator",
    "DecodeState",
    "GenerationResult",
    "ModelRunner",
    "Piece",
    "PromptTooLongError",
    "Working",
    "context_length",
]


class PromptTooLongError(PromptError):
    """The prompt does not fit in the model's context window."""


@dataclass(slots=True)
class DecodeState:
    """One request's decoding state, shared between the stream driver and a decode strategy.

    A decode strategy appends the raw logits row of each token to `logits` (when not None) just
    before it yields the token; the driver reads log-probabilities from it.
    """

    sequence: list[int]
    computed: int
    logits: list[torch.Tensor] | None
    salt: Salt
    past: Any = None
    spec: Any = None
    # recurrent models: where the prefill stops to snapshot the state, and the snapshots taken
    plan: SnapshotPlan = field(default_factory=SnapshotPlan)
    splits: list[int] = field(default_factory=list)
    # positions past this one were computed along a path a prefill of them would not take (one-token
    # forwards, prefill or decode, where the cache's min_prefill is 2): not reused
    reusable: int | None = None
    shared: bool = True  # False: nothing it computes enters the cache (its hit is read all the same)

    @classmethod
    def start(
        cls,
        ids: list[int],
        hit: Hit | None,
        rows: list[torch.Tensor] | None,
        salt: Salt,
        cache: KVCacheTrie | None,
        stepwise: bool,
    ) -> DecodeState:
        """The decoding state after `hit`, with the positions where a recurrent state is snapshotted
        (`stepwise`: a model whose every forward after the first is one token)."""
        run = cls(list(ids), hit.length if hit is not None else 0, rows, salt)
        if cache is not None:
            run.plan = cache.snapshot_plan(run.computed, len(ids), hit.matched if hit else 0)
            if stepwise and run.computed == 0:
                run.plan.skip_before((hit.matched if hit else 0) or len(ids) - 1)
        return run

    def conclude(
        self, out: Decoding, piece: Piece, hit: Hit | None, output_logits: bool, **extras: Any
    ) -> Piece:
        """The request's last piece (`Decoding.conclude`) with what this decoding recorded."""
        return out.conclude(
            piece,
            time.perf_counter(),
            cached_tokens=hit.length if hit is not None else 0,
            logits=self.logits if output_logits else None,
            spec=self.spec,
            prefill_splits=self.splits,
            snapshot_positions=self.plan.positions,
            **extras,
        )


class CachedGenerator(BlockSteps, PromptSteps):
    """Generate with prefix reuse from a `KVCacheTrie` (or with no reuse when `cache` is None).

    `packed` ("all", "head" or "none") runs the model's linear layers on packed weights
    (`ModelRunner`): with "all", on a CPU, a forward of a few rows costs about one of a single row,
    what speculative rounds verify."""

    def __init__(
        self, model: PreTrainedModel, tokenizer: Any, cache: KVCacheTrie | None, *, packed: str = "none"
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cache = cache
        self.runner = ModelRunner(model, packed=packed)
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.max_context = context_length(model.config)
        self.vocab_size = vocab_size(model.config)
        self._blocks = None  # a BlockPrefill, made on the first request that reuses blocks

    def encode(self, prompt: Prompt) -> list[int]:
        ids = encode_prompt(self.tokenizer, prompt)
        array = np.asarray(ids)
        outside = np.flatnonzero((array < 0) | (array >= self.vocab_size))
        if len(outside):
            bad = ids[outside[0]]
            raise PromptError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if context_room(self.max_context, len(ids)) <= 0:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but the model's context is {self.max_context} tokens"
            )
        return ids

    def generate(
        self, prompt: Prompt, params: GenerationParams | None = None, **kwargs: Any
    ) -> GenerationResult:
        """Run to completion; same arguments as `stream`."""
        result = None
        for piece in self.stream(prompt, params, **kwargs):
            if isinstance(piece, Piece):
                result = piece.result
        assert result is not None
        return result

    def check_params(self, params: GenerationParams) -> None:
        """Raise `ParamError` for options this generator cannot honour with this model.

        `stream` calls it first; a server calls it before queueing so a bad request fails early.
        """
        bad = next((t for t in params.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise ParamError(
                "logit_bias", f"logit_bias token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        if params.kv_mode != "exact":
            if params.prompt_logprobs is not None:
                raise ParamError(
                    "kv_mode",
                    f"prompt_logprobs needs every prompt position computed; kv_mode {params.kv_mode!r} "
                    "reuses block KV (use kv_mode 'exact')",
                )
            self.block_prefill()

    def prepare(self, prompt: Prompt, params: GenerationParams, started: float | None = None) -> Decoding:
        """A request's checked ids and the output state its decoding starts from (`Decoding`: the
        token budget capped by the context, the sampling generator, the stop-text assembler and the
        logits processor). `stream` and the batched engine both start here."""
        self.check_params(params)
        ids = self.encode(prompt)
        rng = None if params.sampling.greedy else seeded_rng(self.runner.device, params.seed)
        processor = None
        if params.processes_logits:
            eos = () if params.ignore_eos else self.eos_ids
            processor = LogitsProcessor(params, ids, eos, self.vocab_size, self.runner.device)
        return Decoding(
            ids,
            params,
            int(min(params.max_new_tokens, context_room(self.max_context, len(ids)))),
            StopTextAssembler(self.tokenizer, params.stop),
            rng,
            processor,
            self.eos_ids,
            time.perf_counter() if started is None else started,
        )

    def stream(
        self,
        prompt: Prompt,
        params: GenerationParams | None = None,
        *,
        salt: Salt = None,
        output_logits: bool = False,
        block_chunk: int | None = None,
        prompt_chunk: int | None = None,
        share_kv: bool = True,
        **options: Any,
    ) -> Generator[Piece | Working, None, None]:
        """Yield text as it is generated; the last piece carries the `GenerationResult`.

        `block_chunk`: a prompt's KV block work (`kv_mode` blend or concat) runs in forwards of at
        most this many tokens, each followed by a `Working` step, so an engine can interleave it with
        other requests (None: at once, and only `Piece`s are yielded).

        `prompt_chunk`: the rest of the prompt (after any block work; all of it for prompt
        log-probabilities) is prefilled in forwards of at most this many tokens too, a `Working` step
        after each but the one that gives the first token. The forwards depend on the prompt and its
        hit only, never on when the engine takes them, so the bits do not either (None: one forward).

        `share_kv=False`: the KV computed here stays the request's own, never inserted into the cache
        (a prefix it hits is read all the same). The batch-invariant engine serves half-precision
        requests it cannot pack so: these kernels round otherwise than its packed forwards, and a later
        request on the same prefix must get its bits from the packed path (`SerialRunner`).

        Options come as `params` or as `GenerationParams` fields given by keyword
        (`max_new_tokens=16, temperature=0.7`), not both. Prompt and generated ids are committed to
        the cache by id when the request ends, also when the consumer stops early, so the next turn
        hits the whole history.
        """
        params = params_of(params, options)
        started = time.perf_counter()
        spans: list[BlockSpan] = []
        if is_segmented(prompt):
            prompt, spans = flatten(self.tokenizer, prompt)
        out = self.prepare(prompt, params, started=started)
        ids = out.prompt_ids
        # Prompt log-probabilities need logits at every prompt position: no prefix reuse.
        bypass = "prompt_logprobs" if params.prompt_logprobs is not None and self.cache is not None else None
        hit = self.cache.match_or_miss(ids, salt=salt) if self.cache is not None and bypass is None else None
        rows: list[torch.Tensor] | None = [] if output_logits or params.logprobs is not None else None
        run = DecodeState.start(ids, hit, rows, salt, self.cache, self.runner.stepwise)
        run.shared = share_kv
        tokens = None
        try:
            blocks = None
            if params.kv_mode != "exact":
                blocks = yield from self._prefill_blocks(ids, spans, hit, run, params, block_chunk)
            if run.past is None:
                run.past = self._new_past(hit, salt)
            prompt_logprobs = yield from self._prompt_work(ids, run, params.prompt_logprobs, prompt_chunk)
            tokens = self._decode(ids, run, out)
            piece = yield from self._pieces(tokens, run, out, output_logits)
            tokens.close()
            extras = {"prompt_logprobs": prompt_logprobs, "cache_bypass": bypass, "blocks": blocks}
            final = run.conclude(out, piece, hit, output_logits, **extras)
        finally:
            self._end(tokens, run, hit)
        if spans and params.kv_mode == "exact":
            self.promote_blocks(spans, salt)
        # Committed before the result is handed over: a consumer that stops at the result piece
        # (without exhausting the stream) holds no lock, and its next turn hits this one.
        yield final

    def _new_past(self, hit: Hit | None, salt: Salt) -> Any:
        """The live cache a request decodes into: the hit's prefix, or an empty one."""
        return hit.to_hf_cache() if hit is not None else hf.empty_cache(self.model.config)

    def _end(self, tokens: Generator[int, None, None] | None, run: DecodeState, hit: Hit | None) -> None:
        """A request ends (also when its consumer stopped early): its decode closes, what it
        computed enters the cache and its hit is released."""
        try:
            if tokens is not None:
                tokens.close()
            if self.cache is not None and run.past is not None:
                self._commit(run, final=True)
        finally:
            if hit is not None:
                hit.release()

    def _pieces(
        self, tokens: Iterator[int], run: DecodeState, out: Decoding, output_logits: bool
    ) -> Generator[Piece, None, Piece]:
        """Each decoded token through the per-token rule: yield its piece, return the last one."""
        for token in tokens:
            now = time.perf_counter()
            if not out.generated:
                self._commit_prompt(run)
            row = None
            if run.logits is not None:
                row = run.logits[-1] if output_logits else run.logits.pop()
            piece = out.push(token, row, now)
            run.sequence.append(token)
            if out.finish is not None:
                return piece
            yield piece
        raise AssertionError("a decode strategy yields tokens until the rule finishes the sequence")

    def _commit_prompt(self, run: DecodeState) -> None:
        """Store the prompt's KV as soon as it is computed, not only when the request ends.

        Requests interleaved with this one (the server's engine) then hit the shared prefix
        instead of each prefilling it again; the end-of-request insert adds only the reply.
        """
        if self.cache is not None:
            self._commit(run)

    def _commit(self, run: DecodeState, final: bool = False) -> None:
        """Insert what the request computed, with the snapshots taken so far; at its end, also the
        state where it stops (the reply's end, where the next turn resumes); nothing where the
        request keeps its KV to itself (`stream(share_kv=False)`)."""
        if not run.shared:
            return
        end = min(run.computed, len(run.sequence))
        if run.reusable is not None:
            end = min(end, run.reusable)
        if final and end == run.computed:
            run.plan.at_end(end, run.past)
        assert self.cache is not None
        self.cache.insert(run.sequence[:end], run.past, salt=run.salt, snapshots=run.plan.hand_over(end))

    def _snapshot(self, run: DecodeState) -> None:
        """After a forward: the request's snapshot plan takes the recurrent state if it wants it here."""
        if run.reusable is None or run.computed <= run.reusable:
            run.plan.after_forward(run.computed, run.past)

    def _prefill(self, ids: list[int], run: DecodeState, end: int, keep: int = 1) -> torch.Tensor:
        """Forward `ids[run.computed:end]`, stopping at each snapshot point on the way (a recurrent
        model's state can only be copied where a forward ends); the logits of the last `keep`
        positions of the last forward, or with `keep=0` of every position prefilled."""
        stops = run.plan.stops(run.computed, end)
        out = []
        for stop in stops:
            short = self.cache is not None and stop - run.computed < self.cache.min_prefill
            if short and run.reusable is None:  # e.g. the last prompt token after prompt logprobs
                run.reusable = run.computed
            width = stop - run.computed
            out.append(
                self.runner.forward(ids[run.computed : stop], run.past, keep=min(keep, width) or width)
            )
            run.computed = stop
            run.splits.append(stop)
            self._snapshot(run)
        if self.cache is not None and self.cache.min_prefill > 1 and run.reusable is None:
            # what follows is decoded one token per forward, which such a model (hf.MIN_PREFILL_TOKENS)
            # computes otherwise than a prefill of the same tokens: not reused either
            run.reusable = run.computed
        return torch.cat(out) if keep == 0 and len(out) > 1 else out[-1]

    def _decode(self, ids: list[int], run: DecodeState, out: Decoding) -> Generator[int, None, None]:
        """Yield next tokens one at a time, chosen by the per-token rule (`out`); keep `run.computed`
        = positions of `run.past` that hold the KV of `run.sequence` (the caller appends each yielded
        token to it)."""
        logits = self._prefill(ids, run, len(ids))[-1]
        while True:
            if run.logits is not None:
                run.logits.append(logits.detach().clone())
            yield out.choose(logits)
            logits = self.runner.forward(run.sequence[-1:], run.past)[-1]
            run.computed += 1
            self._snapshot(run)
