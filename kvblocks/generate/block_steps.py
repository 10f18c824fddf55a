"""The KV-block side of a `CachedGenerator` (`kvblocks.blocks`): a prompt's block prefill, storing
blocks ahead of the requests that use them, and promoting the blocks an exact request marked.

Block work is resumable: each forward of at most `chunk` tokens is a `Working` step, so an engine
can interleave it with other requests.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvblocks.adapters import hf
from kvblocks.blocks.report import BlockReport, StoredBlock
from kvblocks.blocks.segments import Block, BlockSpan, flatten
from kvblocks.cache.trie import Hit, Salt
from kvblocks.generate.params import GenerationParams, ParamError
from kvblocks.generate.runner import ModelRunner
from kvblocks.generate.text import Prompt

if TYPE_CHECKING:
    from kvblocks.adapters.hf_trie import KVCacheTrie
    from kvblocks.blocks.prefill import BlockPrefill
    from kvblocks.generate.generator import DecodeState


@dataclass(frozen=True, slots=True)
class Working:
    """A stream step that computed `tokens` of a prompt's block KV (fills, probe, recompute) and has
    no text yet: what `stream(..., block_chunk=N)` yields between its forwards of block work."""

    tokens: int


def working_steps(work: Generator[int, None, Any]) -> Generator[Working, None, Any]:
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


class BlockSteps:
    """Block operations of a generator; `CachedGenerator` is one (it sets the attributes below)."""

    model: Any
    tokenizer: Any
    cache: KVCacheTrie | None
    runner: ModelRunner
    _blocks: BlockPrefill | None
    encode: Callable[[Prompt], list[int]]

    def block_prefill(self) -> BlockPrefill:
        """The `kvblocks.blocks.prefill.BlockPrefill` of this model; ParamError when the model cannot
        move cached keys (no RoPE, or a length-dependent one) or holds other than full attention."""
        if self._blocks is None:
            from kvblocks.blocks.prefill import BlockPrefill

            try:
                self._blocks = BlockPrefill(self.model, self.runner, self.cache)
            except hf.UnsupportedModelError as e:
                raise ParamError("kv_mode", str(e)) from e
        return self._blocks

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
                pre = yield from working_steps(prefill.steps(ids, spans, hit, run.salt, mode, share, chunk))
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
        assert isinstance(stored, StoredBlock)
        return stored

    def store_steps(
        self, block: Block | str | Sequence[int], salt: Salt = None, chunk: int | None = None
    ) -> Generator[Working | StoredBlock, None, None]:
        """`store_block` as stream steps: a `Working` per forward of at most `chunk` tokens (None:
        one forward), then the `StoredBlock` (the engine runs it so, beside other requests).
        PromptError for an empty block, one outside the vocabulary or the context; ParamError where
        the model cannot reuse blocks or there is no cache to store them in."""
        ids, _ = flatten(self.tokenizer, [block if isinstance(block, Block) else Block(block)])
        self.encode(ids)
        if self.cache is None:
            raise ParamError("kv_mode", "KV blocks are stored in the prefix cache: this generator has none")
        prefill = self.block_prefill()
        held = yield from working_steps(prefill.store_steps(tuple(ids), salt, chunk))
        yield StoredBlock(len(ids), held)
