"""The one door between the HTTP server and the engine: requests in (`submit`, `submit_all`,
`cancel`), the engine's state out (`stats`, `load`, `health_problem`, `metrics`), what a route must
know of the served model (`tokenizer`, `encode`, `max_context`, `info`) and what it asks of the prefix
cache (`explain`, `inspect`; `cache` for stats, pins and flushes). The batched engine and the
one-request path (`Engine` without a packed runner) both sit behind it; the server never reaches
the generator or the engine's insides.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvblocks.engine.loop import Engine
from kvblocks.engine.request import Emit, Load, Request
from kvblocks.generate.params import GenerationParams
from kvblocks.generate.text import Prompt

if TYPE_CHECKING:
    from kvblocks.adapters.hf_trie import KVCacheTrie
    from kvblocks.blocks.prefill import BlockPrefill
    from kvblocks.cache.explain import Explanation
    from kvblocks.cache.namespace import Namespace
    from kvblocks.seq2seq.cache import Seq2SeqCache
    from kvblocks.seq2seq.generator import Seq2SeqCachedGenerator


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """The served model as routers and clients see it: where its weights and tokenizer came from,
    its dtype and type."""

    path: str
    tokenizer_path: str
    dtype: str
    model_type: str | None
    architectures: tuple[str, ...]


class Frontend:
    """What the server may ask of one engine. `max_context` None: the model states no context
    window. `encoder_decoder`: a completion's prompt is the model's source (`encode_source`), its
    decoder prefix comes apart (`decoder_ids`, `start_id`)."""

    def __init__(self, engine: Engine) -> None:
        from kvblocks.engine.batch import BatchEngine
        from kvblocks.seq2seq.generator import Seq2SeqCachedGenerator

        gen = engine.generator
        self._engine, self._gen = engine, gen
        self.metrics = engine.metrics
        self.ledger = engine.ledger  # what tokenizing and block fills charge each tenant
        self.max_active = engine.max_active
        self.tokenizer = gen.tokenizer
        self.cache = gen.cache  # the prefix trie (None: --no-cache)
        self._seq2seq = gen if isinstance(gen, Seq2SeqCachedGenerator) else None
        self.encoder_decoder = self._seq2seq is not None
        # what the stats report and a flush empties: a seq2seq model's whole cache (source records,
        # decoder trie, encoder work), else the trie
        self.full_cache: Seq2SeqCache | KVCacheTrie | None = (
            self._seq2seq.seq2seq if self._seq2seq is not None else gen.cache
        )
        self.packed_weight_bytes = engine.packed_weight_bytes if isinstance(engine, BatchEngine) else 0
        self.max_context: int | None = gen.max_context
        self.vocab_size: int = gen.vocab_size

    # ---- requests --------------------------------------------------------------------------------

    def submit(self, prompt: Prompt, emit: Emit, *, tenant: str = "", **options: Any) -> Request:
        return self._engine.submit(prompt, emit, tenant=tenant, **options)

    def submit_all(
        self, items: Iterable[tuple[Prompt, Emit, dict[str, Any]]], tenant: str = ""
    ) -> list[Request]:
        return self._engine.submit_all(items, tenant=tenant)

    def cancel(self, request: Request) -> None:
        self._engine.cancel(request)

    def stop(self) -> None:
        self._engine.stop()

    # ---- state -----------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return self._engine.active

    @property
    def queued(self) -> int:
        return self._engine.queued

    def stats(self) -> dict[str, Any]:
        """The engine's part of `/v1/cache/stats`."""
        return {
            "active": self._engine.active,
            "queued": self._engine.queued,
            "cuda_graphs": self._engine.graph_stats(),
            "attention_kernel": self._engine.kernel_stats(),
        }

    def load(self) -> Load:
        return self._engine.load()

    def health_problem(self) -> str | None:
        return self._engine.health_problem()

    # ---- the model -------------------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        model, config = self._gen.model, self._gen.model.config
        return ModelInfo(
            path=getattr(model, "name_or_path", "") or config._name_or_path,
            tokenizer_path=self.tokenizer.name_or_path,
            dtype=str(model.dtype).removeprefix("torch."),
            model_type=getattr(config, "model_type", None),
            architectures=tuple(getattr(config, "architectures", None) or ()),
        )

    def encode(self, prompt: Prompt) -> list[int]:
        return self._gen.encode(prompt)

    def check_params(self, params: GenerationParams) -> None:
        """Raise ParamError naming what this generator cannot honour."""
        self._gen.check_params(params)

    def block_prefill(self) -> BlockPrefill:
        """The model's KV block fill (ParamError where the model cannot move cached keys)."""
        return self._gen.block_prefill()

    def encode_source(self, source: Prompt) -> list[int]:
        return self._encoder_decoder().encode_source(source)

    def decoder_ids(self, decoder: str | Sequence[int]) -> list[int]:
        return self._encoder_decoder().decoder_ids(decoder)

    @property
    def start_id(self) -> int:
        return int(self._encoder_decoder().start_id)

    def _encoder_decoder(self) -> Seq2SeqCachedGenerator:
        if self._seq2seq is None:
            raise TypeError("the served model is not an encoder-decoder model")
        return self._seq2seq

    def namespace(self) -> Namespace:
        """The cache namespace of the served weights (computed from them when there is no cache)."""
        from kvblocks.cache.namespace import namespace_for

        return self.cache.namespace if self.cache is not None else namespace_for(self._gen.model)

    # ---- the prefix cache ------------------------------------------------------------------------

    def explain(self, ids: list[int], **options: Any) -> Explanation:
        """`kvblocks.cache.explain.explain` on this cache and tokenizer."""
        from kvblocks.cache.explain import explain

        return explain(self._trie(), self.tokenizer, ids, **options)

    def inspect(self, tenant: str | None, limit: int, tree: bool, max_nodes: int) -> dict[str, Any]:
        """`kvblocks.cache.inspection.inspect_prefixes` on this cache and tokenizer."""
        from kvblocks.cache.inspection import inspect_prefixes

        return inspect_prefixes(self._trie(), self.tokenizer, tenant, limit, tree, max_nodes)

    def _trie(self) -> KVCacheTrie:
        if self.cache is None:
            raise RuntimeError("this server runs without a prefix cache")
        return self.cache
