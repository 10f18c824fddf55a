"""What the engine queues and answers: a request with typed options, its load, the error a failed one gets."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvblocks.blocks.report import StoredBlock
from kvblocks.cache.trie import Salt
from kvblocks.generate.block_steps import Working
from kvblocks.generate.decoding import Piece
from kvblocks.generate.params import GenerationParams, params_of
from kvblocks.generate.text import Prompt

if TYPE_CHECKING:
    from kvblocks.engine.sequence import Sequence

Emit = Callable[[Piece | StoredBlock | BaseException], None]


class EngineError(RuntimeError):
    """What a request's client receives when the engine failed it: the phase and the cause."""

    def __init__(self, phase: str, cause: BaseException) -> None:
        super().__init__(f"{phase} failed: {type(cause).__name__}: {cause}")
        self.phase = phase
        self.cause = cause


@dataclass(frozen=True, slots=True)
class Options:
    """A request's options, typed: made at submit, so an unknown keyword is a TypeError there rather
    than a request that silently takes another path."""

    params: GenerationParams = field(default_factory=GenerationParams)
    salt: Salt = None
    output_logits: bool = False  # the result keeps every generated position's raw logits
    # the prompt is a KV block to store (`CachedGenerator.store_steps`), nothing is generated: the
    # request's one answer is its `StoredBlock`
    store_block: bool = False

    @classmethod
    def of(
        cls,
        params: GenerationParams | None = None,
        salt: Salt = None,
        output_logits: bool = False,
        store_block: bool = False,
        **fields: Any,
    ) -> Options:
        """From `CachedGenerator.stream`'s keywords: `params`, or `GenerationParams` fields."""
        return cls(params_of(params, fields), salt, output_logits, store_block)


@dataclass(eq=False)
class Request:
    """One queued generation. `emit` is called on the engine thread with each Piece, or an Exception."""

    prompt: Prompt  # or a segmented prompt (`kvblocks.blocks`), as `CachedGenerator.stream` takes
    options: Options
    emit: Emit
    id: int = 0
    tenant: str = ""
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    stream: Generator[Piece | Working | StoredBlock, None, None] | None = (
        None  # on the one-request path: its `CachedGenerator.stream`
    )
    last_token_at: float = 0.0
    tokens: int = 0  # prompt ids plus tokens generated so far (the request's KV footprint)
    sequence: Sequence | None = None  # its packed-path state, made once at its first admission
    serial: bool = False  # it takes the one-request path
    spans: dict[str, Any] = field(default_factory=dict)  # its open trace spans by phase (tracing on only)

    def cancel(self) -> None:
        """Stop it at the engine's next step (a no-op once it finished); what it holds goes back."""
        self.cancelled.set()


@dataclass(frozen=True, slots=True)
class Load:
    """What the engine holds right now, as routers ask for it (`/get_load`)."""

    running: int
    waiting: int
    tokens: int  # prompt plus generated tokens of the running and waiting requests
