"""CachedGenerator: generation that re-attaches the cached prefix and prefills only the suffix.

`stream` drives one request: it prepares the cache, lets a decode strategy (`_decode`, one token
per forward here, draft/verify in `specdec`) yield tokens, and turns them into text pieces, stop
conditions, log-probabilities and, when the request ends, cache inserts.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvblocks.adapters import hf
from kvblocks.adapters.hf_trie import KVCacheTrie
from kvblocks.blocks.report import BlockReport, StoredBlock
from kvblocks.blocks.segments import Block, BlockSpan, flatten, is_segmented
from kvblocks.cache.snapshots import SnapshotPlan
from kvblocks.cache.trie import Hit, Salt
from kvblocks.generate.decoding import Decoding, GenerationResult, Piece, context_room
from kvblocks.generate.params import GenerationParams, ParamError, params_of
from kvblocks.generate.sampling import LogitsProcessor, TokenLogprob, seeded_rng, token_logprobs
from kvblocks.generate.text import Prompt, PromptError, StopTextAssembler, encode_prompt

__all__ = [
    "CachedGenerator",
    "DecodeState",
    "GenerationResult",
    "ModelRunner",
    "Piece",
    "PromptTooLongError",
    "Working",
]


class PromptTooLongError(PromptError):
    """The prompt does not fit in the model's context window."""


@dataclass(frozen=True, slots=True)
class Working:
    """A stream step that computed `tokens` of a prompt's block KV (fills, probe, recompute) and has
    no text yet: what `stream(..., block_chunk=N)` yields between its forwards of block work."""

    tokens: int


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


def context_length(config) -> int | None:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def vocab_size(config) -> int:
    """Token ids the model embeds (and logits it returns): `config.vocab_size` of the text model."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def _working(work: Generator[int, None, Any]) -> Generator[Working, None, Any]:
    """Resumable block work (`BlockPrefill.steps`) as `Working` steps; its result. Closed with it: the
    block matches it holds are released when the stream is."""
    try:
        while True:
            try:
                tokens = next(work)
            except StopIteration as done:
                return done.value
            yield Working(tokens)
    finally:
        work.close()


class ModelRunner:
    """Forward passes for one model: one at a time, logits only for the positions asked for."""

    def __init__(self, model) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.lock = threading.Lock()
        self._keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_arg = hf.cache_argument(model)
        self._position_args = hf.position_arguments(model)
        self.stepwise = getattr(model.config, "model_type", None) in hf.STEPWISE_MODEL_TYPES

    @torch.inference_mode()
    def forward(
        self,
        token_ids: Sequence[int],
        past,
        keep: int = 1,
        *,
        positions: Sequence[int] | None = None,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits `[keep, vocab]` of the last `keep` positions; `past` grows by `len(token_ids)`.

        `positions` and `allowed` (`[new, cached + new]` booleans: which keys each new token sees)
        replace the causal numbering and mask, for a draft tree (`kvblocks.specdec.tree`).
        A model that cannot continue a recurrent state over several tokens in one forward
        (`hf.STEPWISE_MODEL_TYPES`) gets them one per forward once `past` holds a state."""
        if self.stepwise and len(token_ids) > 1 and hf.has_state(past):
            assert allowed is None, "a stepwise model reads no tree"
            rows = [self.forward([t], past) for t in token_ids]
            return torch.cat(rows[len(rows) - keep :])
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        kwargs = {"logits_to_keep": keep} if self._keep_arg else {}
        kwargs.update(hf.positions(self._position_args, past, len(token_ids), self.device))
        if positions is not None and "position_ids" in kwargs:
            kwargs["position_ids"] = torch.tensor([list(positions)], dtype=torch.long, device=self.device)
        if allowed is not None:
            dtype = next(self.model.parameters()).dtype
            bias = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
            kwargs["attention_mask"] = bias.masked_fill_(~allowed.to(self.device), torch.finfo(dtype).min)[
                None, None
            ]
        with self.lock:
            out = self.model(input_ids=input_ids, use_cache=True, **{self._cache_arg: past}, **kwargs)
        return out.logits[0, -keep:]

    def crop(self, past, length: int) -> None:
        """Roll `past` back to its first `length` positions (rejected drafts)."""
        hf.crop(past, length)


class CachedGenerator:
    """Generate with prefix reuse from a `KVCacheTrie` (or with no reuse when `cache` is None)."""

    def __init__(self, model, tokenizer, cache: KVCacheTrie | None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cache = cache
        self.runner = ModelRunner(model)
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

    def generate(self, prompt: Prompt, params: GenerationParams | None = None, **kwargs) -> GenerationResult:
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

    def block_prefill(self):
        """The `kvblocks.blocks.prefill.BlockPrefill` of this model; ParamError when the model cannot
        move cached keys (no RoPE, or a length-dependent one) or holds other than full attention."""
        if self._blocks is None:
            from kvblocks.blocks.prefill import BlockPrefill

            try:
                self._blocks = BlockPrefill(self.model, self.runner, self.cache)
            except hf.UnsupportedModelError as e:
                raise ParamError("kv_mode", str(e)) from e
        return self._blocks

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
            min(params.max_new_tokens, context_room(self.max_context, len(ids))),
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
        **options,
    ) -> Iterator[Piece | Working]:
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
        run = self._start(ids, hit, rows, salt)
        run.shared = share_kv
        tokens = None
        try:
            blocks = None
            if params.kv_mode != "exact":
                blocks = yield from self._prefill_blocks(ids, spans, hit, run, params, block_chunk)
            if run.past is None:
                run.past = self._new_past(hit, salt)
            prompt_logprobs = None
            chunk = prompt_chunk if self._chunks_prefill() else None
            if params.prompt_logprobs is not None:
                prompt_logprobs = yield from self._prompt_logprobs(ids, run, params.prompt_logprobs, chunk)
            elif chunk is not None:  # all but the last forward: `_decode` runs that one
                yield from self._prefill_steps(ids, run, len(ids) - chunk, chunk)
            tokens = self._decode(ids, run, out)
            piece = yield from self._pieces(tokens, run, out, output_logits)
            tokens.close()
            final = out.conclude(
                piece,
                time.perf_counter(),
                cached_tokens=hit.length if hit is not None else 0,
                logits=run.logits if output_logits else None,
                spec=run.spec,
                prompt_logprobs=prompt_logprobs,
                cache_bypass=bypass,
                prefill_splits=run.splits,
                snapshot_positions=run.plan.positions,
                blocks=blocks,
            )
        finally:
            try:
                if tokens is not None:
                    tokens.close()
                if self.cache is not None and run.past is not None:
                    self._commit(run, final=True)
            finally:
                if hit is not None:
                    hit.release()
        if spans and params.kv_mode == "exact":
            self.promote_blocks(spans, salt)
        # Committed before the result is handed over: a consumer that stops at the result piece
        # (without exhausting the stream) holds no lock, and its next turn hits this one.
        yield final

    def _prefill_blocks(
        self,
        ids: list[int],
        spans: list[BlockSpan],
        hit: Hit | None,
        run: DecodeState,
        params: GenerationParams,
        chunk: int | None,
    ) -> Generator[Working, None, BlockReport]:
        """Start `run` from stored block KV (`kvblocks.blocks`), a `Working` step per forward of at
        most `chunk` tokens (None: at once, no steps); a blend that recomputes every token, or a
        prompt with no block past the exact hit, prefills as usual (so share 1.0 is exact)."""
        h = hit.length if hit is not None else 0
        pre = None
        if not (params.kv_mode == "blend" and params.blend_recompute >= 1.0):
            prefill, mode, share = self.block_prefill(), params.kv_mode, params.blend_recompute
            if chunk is None:
                pre = prefill.run(ids, spans, hit, run.salt, mode, share)
            else:
                pre = yield from _working(prefill.steps(ids, spans, hit, run.salt, mode, share, chunk))
        if pre is None:
            return BlockReport(params.kv_mode, params.blend_recompute, h, recomputed_tokens=len(ids) - h)
        run.past, run.computed, run.reusable = pre.past, pre.computed, pre.reusable
        return pre.report

    def promote_blocks(self, spans: list[BlockSpan], salt: Salt) -> None:
        """Store the blocks an exact request marked (`BlockPrefill.promote`), where the model can
        reuse blocks at all; an exact request never fails for it."""
        work = self.promotion(spans, salt)
        for _ in work or ():  # its forwards, at once
            pass

    def promotion(
        self, spans: list[BlockSpan], salt: Salt, chunk: int | None = None
    ) -> Generator[int, None, None] | None:
        """`promote_blocks` as resumable work, a forward of at most `chunk` tokens per step
        (`BlockPrefill.promote_steps`); None where there is nothing to do (no cache, or a model that
        cannot reuse blocks). The batched engine runs it a step at a time when idle
        (`kvblocks.engine.promotion`)."""
        if self.cache is None:
            return None
        try:
            prefill = self.block_prefill()
        except ParamError:
            return None
        return prefill.promote_steps(spans, salt, chunk)

    def store_block(self, block: Block | str | Sequence[int], salt: Salt = None) -> StoredBlock:
        """Compute and store a block's KV (a document, before the first request that uses it) in the
        block store of `salt`'s tenant, so that request finds it; a block held already costs a lookup.
        Text is tokenised on its own, as a `Block` in a prompt is."""
        *_, stored = self.store_steps(block, salt)
        return stored

    def store_steps(
        self, block: Block | str | Sequence[int], salt: Salt = None, chunk: int | None = None
    ) -> Iterator[Working | StoredBlock]:
        """`store_block` as stream steps: a `Working` per forward of at most `chunk` tokens (None:
        one forward), then the `StoredBlock` (the engine runs it so, beside other requests).
        PromptError for an empty block, one outside the vocabulary or the context; ParamError where
        the model cannot reuse blocks or there is no cache to store them in."""
        ids, _ = flatten(self.tokenizer, [block if isinstance(block, Block) else Block(block)])
        self.encode(ids)
        if self.cache is None:
            raise ParamError("kv_mode", "KV blocks are stored in the prefix cache: this generator has none")
        prefill = self.block_prefill()
        held = yield from _working(prefill.store_steps(tuple(ids), salt, chunk))
        yield StoredBlock(len(ids), held)

    def _new_past(self, hit: Hit | None, salt: Salt) -> Any:
        """The live cache a request decodes into: the hit's prefix, or an empty one."""
        return hit.to_hf_cache() if hit is not None else hf.empty_cache(self.model.config)

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

    def _start(
        self, ids: list[int], hit: Hit | None, rows: list[torch.Tensor] | None, salt: Salt
    ) -> DecodeState:
        """The decoding state after `hit`, with the positions where a recurrent state is snapshotted."""
        run = DecodeState(list(ids), hit.length if hit is not None else 0, rows, salt)
        if self.cache is not None:
            run.plan = self.cache.snapshot_plan(run.computed, len(ids), hit.matched if hit else 0)
            if self.runner.stepwise and run.computed == 0:  # every forward after the first is one token
                run.plan.skip_before((hit.matched if hit else 0) or len(ids) - 1)
        return run

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
            rows = self._prefill(ids, run, len(ids) - 1, keep=0)
        else:
            rows = yield from self._prefill_steps(ids, run, len(ids) - 1, chunk, keep=0)
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
        rows = []
        while run.computed < end:
            start = run.computed
            rows.append(self._prefill(ids, run, min(end, start + chunk), keep))
            yield Working(run.computed - start)
        if not rows:
            return None
        return torch.cat(rows) if keep == 0 else rows[-1]

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

    def _decode(self, ids: list[int], run: DecodeState, out: Decoding) -> Iterator[int]:
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
