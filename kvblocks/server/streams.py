"""One stream formatter per choice, for chat completions, completions and Responses alike.

`ChoiceStream` turns a choice's generated pieces into what its reply gains: the text safe to show,
tool-call deltas (OpenAI's chat shape) when a tool parser watches the reply, and, with the last
piece, the finish reason ("tool_calls" when the reply ended in calls it completed). Each API frames
these deltas its own way on the wire: `data_event` (chat and completions chunks, ended by `DONE`)
or `EventStream.event` (Responses' typed, numbered events).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvblocks.generate import tools
from kvblocks.generate.generator import Piece

DONE = "data: [DONE]\n\n"


@dataclass(slots=True)
class ChoiceDelta:
    """What one piece added to a choice: `text` to show, `calls` (tool-call deltas), `finish` (None
    until the last piece)."""

    text: str
    calls: list[dict] = field(default_factory=list)
    finish: str | None = None


class ChoiceStream:
    """One choice's pieces in order. Without a tool parser a piece's text is shown as it is; with
    one, call markup is held back and becomes call deltas, and the last piece settles the content
    with the full parse, so the text deltas join to exactly what the non-streamed reply says."""

    def __init__(self, parser: tools.ToolParser | None = None) -> None:
        self.tools = tools.ToolStreamParser(parser) if parser is not None else None

    def feed(self, piece: Piece) -> ChoiceDelta:
        finish = piece.result.finish_reason if piece.result is not None else None
        if self.tools is None:
            return ChoiceDelta(piece.text, [], finish)
        text, calls = self.tools.feed(piece.text), self.tools.call_deltas()
        if piece.result is not None:
            rest, done = self.tools.finish(finish)
            text += rest
            calls += self.tools.finish_deltas(done)
            if done and finish != "length":
                finish = "tool_calls"
        return ChoiceDelta(text, calls, finish)


def data_event(payload: dict) -> str:
    """A chat or completions chunk as a server-sent event."""
    return "data: " + json.dumps(payload) + "\n\n"


class EventStream:
    """Responses' server-sent events: each names its type and carries the next sequence number."""

    def __init__(self) -> None:
        self.sequence = 0

    def event(self, kind: str, payload: dict) -> str:
        number, self.sequence = self.sequence, self.sequence + 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': number} | payload)}\n\n"
