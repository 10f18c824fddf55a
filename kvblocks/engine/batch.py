"""The batched engine: `Engine`'s loop with the packed runner (continuous batching over the KV pool).

Each loop step is one packed forward (`kvblocks.engine.attention`) over every running request: decode
tokens first, then chunks of prefill, under `max_batch_tokens`, for at most `max_batch_size`
requests (`Scheduler`). A request's KV lives in the trie's pool (`SlotManager`); with a generator
that runs speculative rounds, each step of a request is a draft/verify round (`speculative`).
Requests the packed path does not serve (prompt log-probabilities, raw logits, prompts too large
for the pool) run on the serial runner between the packed forwards.
"""

from __future__ import annotations

from kvblocks.engine import speculative
from kvblocks.engine.admission import LimitsOf, RoomLimits, no_limits
from kvblocks.engine.attention.dispatch import supports
from kvblocks.engine.attention.forward import graphs_default, scratch_slots
from kvblocks.engine.loop import Engine
from kvblocks.engine.model_runner import StepForward
from kvblocks.engine.scheduler import CHUNK, RECENT_S, BatchLimits
from kvblocks.generate.generator import CachedGenerator
from kvblocks.telemetry.metrics import Metrics

__all__ = ["CHUNK", "BatchEngine", "check_settings"]


def check_settings(
    max_batch_size: int,
    max_batch_tokens: int,
    invariant: bool,
    chunk: int = CHUNK,
    names: tuple[str, str] = ("max_batch_size", "max_batch_tokens"),
) -> None:
    """ValueError naming what is wrong with a batch size and token budget, under `names` (`kvblocks
    serve` checks its flags here before it loads the model)."""
    size, tokens = names
    if max_batch_size < 1 or max_batch_tokens < max_batch_size:
        raise ValueError(
            f"need {size} >= 1 and {tokens} >= {size}, got {max_batch_size} and {max_batch_tokens}"
        )
    if invariant and max_batch_tokens < max_batch_size + chunk:
        raise ValueError(
            f"batch-invariant batching cuts prompts every {chunk} tokens, so it needs {tokens} >= "
            f"{size} + {chunk}, got {max_batch_tokens} with {size} {max_batch_size}"
        )


def decodes_per_token(generator: CachedGenerator) -> bool:
    """Whether the generator's decoding is the plain per-token rule (no decode strategy of its own)."""
    return type(generator)._decode is CachedGenerator._decode


class BatchEngine(Engine):
    """`Engine` whose runner is the packed one; it only chooses the runner and its limits."""

    def __init__(
        self,
        generator: CachedGenerator,
        metrics: Metrics | None = None,
        max_active: int = 64,
        max_batch_size: int = 16,
        max_batch_tokens: int = 80,
        full_batch_tokens: int = 0,
        max_wait_steps: int = 64,
        join_min_tokens: int = 32,
        invariant: bool = False,
        chunk: int = CHUNK,
        watermark: float = 0.01,
        limits: RoomLimits | None = None,
        limits_of: LimitsOf = no_limits,
        attention: str | None = None,
        cuda_graphs: bool | None = None,
        packed_weights: str = "all",
    ) -> None:
        cache = generator.cache
        if cache is None or not supports(generator.model):
            raise ValueError(
                "the batched engine needs a prefix cache and a model kvblocks.engine.attention supports"
            )
        check_settings(max_batch_size, max_batch_tokens, invariant, chunk)
        if not (isinstance(generator, speculative.Rounds) or decodes_per_token(generator)):
            raise ValueError(
                f"the batched engine runs per-token decoding or speculative rounds, not {type(generator)}"
            )
        if cuda_graphs is None:  # on CUDA with its default attention (`kvblocks.engine.graphs`)
            cuda_graphs = graphs_default(cache.pool.device, invariant, attention in (None, "grouped"))
        need = scratch_slots(invariant, cuda_graphs)
        scratch = cache.reserve(need) if need else None  # held for the engine's life
        runner = StepForward(
            generator.model, cache.pool, invariant, chunk, scratch, attention, cuda_graphs, packed_weights
        )
        batch = BatchLimits(
            max_batch_size,
            max_batch_tokens,
            full_batch_tokens,
            max_active,
            max_wait_steps,
            join_min_tokens,
            invariant,
            chunk,
            max(1, int(watermark * cache.pool.capacity)),
            # on a CPU a step's time grows with its rows, and whoever arrives waits for the step in
            # flight: while a lighter tenant waits on the step, a busier one's prefill is one chunk of it
            chunk if cache.pool.device.type == "cpu" else 0,
        )
        head = runner.packed.head
        # what the weights reordered for the packed forwards cost beside the model's own (`--packed-weights`)
        self.packed_weight_bytes = 0 if head is None else head.nbytes
        super().__init__(generator, metrics, max_active, limits, limits_of, packed=(runner, batch))
        # the one-request path's kernels round the KV otherwise than the invariant packed forwards (in
        # half precision everywhere, in float32 on CPUs whose BLAS picks other kernels by shape, e.g.
        # AVX2 without AVX-512): what it computes stays its own, so every prefix in the trie is the
        # packed path's and a request gets the same bits after a hit as alone (tests/test_dtype.py)
        self.serial.shares_kv = not invariant
        if batch.contended_prefill > 0 and not self.serial.shares_kv:
            # its prompt work in cuts too, one a step while contended; only where its KV stays its own:
            # shared, a prompt's KV would enter the trie from one forward, as the packed path's bits
            self.serial.cut = batch.contended_prefill
            self.serial.contended = self._contended
            self.serial.prompted = lambda: self._batches().prompted

    def _contended(self, tenant: str) -> bool:
        """Whether `tenant` was served more than another tenant with work (the one-request path's
        rule, as `Scheduler.prefill_shares`' for the packed path)."""
        running = [s.request.tenant for s in self._running] + [r.tenant for r in self.serial.active]
        return self.room.busier(tenant, running, RECENT_S)

    @property
    def preemptions(self) -> int:
        return self._batches().preemptions

    @property
    def deferred(self) -> int:
        """Admissions put off because the pool lacked room for the prompt."""
        return self._batches().deferred
