"""The sequence factory: a waiting request's packed-path state, made once, or its way to the serial runner.

The scheduler asks it for each request it looks at: a request the packed path serves becomes a
`Sequence`; one it does not serve (prompt log-probabilities, raw logits, a KV block to store, a
prompt too large for the pool) starts on the serial runner when that has room; a bad prompt or
parameter fails the request here, the client getting the error.
"""

from __future__ import annotations

from kvblocks.engine.admission import WaitingRoom
from kvblocks.engine.report import Reporter
from kvblocks.engine.request import Request
from kvblocks.engine.sequence import Sequence
from kvblocks.engine.serial import SerialRunner
from kvblocks.engine.slots import SlotManager
from kvblocks.engine.speculative import Rounds
from kvblocks.generate.generator import CachedGenerator


class SequenceFactory:
    def __init__(
        self,
        generator: CachedGenerator,
        slots: SlotManager,
        rounds: Rounds | None,
        room: WaitingRoom,
        serial: SerialRunner,
        report: Reporter,
    ) -> None:
        self.generator = generator
        self.slots = slots
        self.rounds = rounds
        self.room = room
        self.serial = serial
        self.report = report
        self.one_at_a_time = 0  # requests that took the serial path beside a packed one

    def __call__(self, request: Request) -> Sequence | None:
        """`request`'s packed-path state (made once), or None once it went to the serial runner or
        failed (a bad prompt or parameter: the client gets the error)."""
        if request.sequence is None and not request.serial:
            try:
                request.sequence = Sequence.of(request, self.generator, self.slots, self.rounds)
            except Exception as exc:
                self.room.remove(request.tenant, request)
                self.report.failed()
                request.emit(exc)
                return None
            request.serial = request.sequence is None
        if not request.serial:
            return request.sequence
        if self.serial.has_room():
            self.room.remove(request.tenant, request)
            self.serial.start(request)
            self.one_at_a_time += 1
        return None
