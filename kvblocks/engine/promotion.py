"""KV blocks that `exact` requests on the packed path marked, stored in the block store when the
engine is idle (`kvblocks.blocks`): off every request's path, so a marked block costs its request
nothing, and a later `blend` or `concat` request finds it.

A request that ends hands its marked blocks here; the engine thread promotes them one request at a
time, one forward of at most `chunk` tokens per idle step (a lookup, else a forward over each new
block alone, `BlockPrefill.promote_steps`), so a request that arrives meanwhile waits for one
forward, not for a request's every block; the tokens are charged to the tenant (`charge`). At
most `PENDING` requests' blocks wait; more are dropped and counted. A promotion that fails is
counted and its traceback printed; it never fails a request or the engine. Each outcome counts in
`counts` and in `/metrics` (`kvblocks_block_promotions_total{outcome=done|dropped|failed}`).
"""

from __future__ import annotations

import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvblocks.blocks.prefill import block_scope
from kvblocks.blocks.segments import BlockSpan
from kvblocks.cache.trie import Salt
from kvblocks.telemetry.metrics import Metrics

if TYPE_CHECKING:
    from kvblocks.generate.generator import CachedGenerator

PENDING = 64  # requests whose marked blocks wait for an idle step


@dataclass(slots=True)
class PromotionCounts:
    done: int = 0  # requests whose blocks were promoted (each block stored or found held)
    dropped: int = 0  # requests whose blocks found the queue full
    failed: int = 0


class BlockPromotions:
    def __init__(
        self,
        generator: CachedGenerator,
        metrics: Metrics | None = None,
        chunk: int | None = None,
        charge: Callable[[str, float], None] = lambda tenant, tokens: None,
    ) -> None:
        self.generator = generator
        self.metrics = metrics
        self.chunk = chunk
        self.charge = charge  # (tenant, tokens) of each forward
        self.pending: deque[tuple[list[BlockSpan], Salt]] = deque()
        self.current: tuple[Iterator[int], str] | None = None  # the promotion under way, its tenant
        self.counts = PromotionCounts()

    def add(self, spans: list[BlockSpan], salt: Salt) -> None:
        if len(self.pending) >= PENDING:
            self._count("dropped")
        else:
            self.pending.append((spans, salt))

    def run_one(self) -> bool:
        """One forward of the promotion under way, else of the oldest pending request's; False when
        none waits."""
        if self.current is None:
            if not self.pending:
                return False
            spans, salt = self.pending.popleft()
            self.current = (self._work(spans, salt), block_scope(salt).tenant)
        work, tenant = self.current
        try:
            tokens = next(work)
        except StopIteration:
            self.current = None
            self._count("done")
        except Exception:  # a fault of this promotion alone: counted, the engine goes on
            self.current = None
            traceback.print_exc()
            self._count("failed")
        else:
            self.charge(tenant, tokens)
        return True

    def _work(self, spans: list[BlockSpan], salt: Salt) -> Iterator[int]:
        """The promotion's forwards (its faults surface at the first step, where `run_one` counts them)."""
        yield from self.generator.promotion(spans, salt, self.chunk) or ()

    def _count(self, outcome: str) -> None:
        setattr(self.counts, outcome, getattr(self.counts, outcome) + 1)
        if self.metrics is not None:
            self.metrics.inc("kvblocks_block_promotions_total", outcome=outcome)
