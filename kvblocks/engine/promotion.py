"""KV blocks that `exact` requests on the packed path marked, stored in the block store when the
engine is idle (`kvblocks.blocks`): off every request's path, so a marked block costs its request
nothing, and a later `blend` or `concat` request finds it.

A request that ends hands its marked blocks here; the engine thread promotes one request's blocks
per idle step (a lookup, else one forward over each new block alone, `BlockPrefill.promote`). At
most `PENDING` requests' blocks wait; more are dropped and counted. A promotion that fails is
counted and its traceback printed; it never fails a request or the engine. Each outcome counts in
`counts` and in `/metrics` (`kvblocks_block_promotions_total{outcome=done|dropped|failed}`).
"""

from __future__ import annotations

import traceback
from collections import deque
from dataclasses import dataclass

from kvblocks.blocks.segments import BlockSpan
from kvblocks.cache.trie import Salt
from kvblocks.telemetry.metrics import Metrics

PENDING = 64  # requests whose marked blocks wait for an idle step


@dataclass(slots=True)
class PromotionCounts:
    done: int = 0  # requests whose blocks were promoted (each block stored or found held)
    dropped: int = 0  # requests whose blocks found the queue full
    failed: int = 0


class BlockPromotions:
    def __init__(self, generator, metrics: Metrics | None = None) -> None:
        self.generator = generator
        self.metrics = metrics
        self.pending: deque[tuple[list[BlockSpan], Salt]] = deque()
        self.counts = PromotionCounts()

    def add(self, spans: list[BlockSpan], salt: Salt) -> None:
        if len(self.pending) >= PENDING:
            self._count("dropped")
        else:
            self.pending.append((spans, salt))

    def run_one(self) -> bool:
        """Promote the oldest pending request's blocks; False when none waits."""
        if not self.pending:
            return False
        spans, salt = self.pending.popleft()
        try:
            self.generator.promote_blocks(spans, salt)
        except Exception:  # a fault of this promotion alone: counted, the engine goes on
            traceback.print_exc()
            self._count("failed")
        else:
            self._count("done")
        return True

    def _count(self, outcome: str) -> None:
        setattr(self.counts, outcome, getattr(self.counts, outcome) + 1)
        if self.metrics is not None:
            self.metrics.inc("kvblocks_block_promotions_total", outcome=outcome)
