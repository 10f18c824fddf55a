"""The per-choice stream formatter the chat, completions and Responses streams share."""

from __future__ import annotations

import json

from kvblocks.generate.decoding import GenerationResult, Piece
from kvblocks.generate.tools import get_parser
from kvblocks.server.streams import DONE, ChoiceStream, EventStream, data_event

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def pieces(texts: list[str], finish: str) -> list[Piece]:
    out = [Piece(t, [1]) for t in texts]
    out[-1].result = GenerationResult([1] * len(texts), "".join(texts), 3, 0, 0.0, 0.0, finish)
    return out


def fed(stream: ChoiceStream, texts: list[str], finish: str):
    return [stream.feed(p) for p in pieces(texts, finish)]


def test_without_a_parser_each_piece_is_shown_as_it_is_and_the_last_one_finishes():
    added = fed(ChoiceStream(None), ["Hel", "lo <tool_call>", "!"], "stop")
    assert [a.text for a in added] == ["Hel", "lo <tool_call>", "!"]
    assert [a.finish for a in added] == [None, None, "stop"]
    assert all(a.calls == [] for a in added)


def test_call_markup_becomes_call_deltas_and_the_finish_says_tool_calls():
    text = "Let me check. " + CALL
    cuts = [text[i : i + 5] for i in range(0, len(text), 5)]
    added = fed(ChoiceStream(get_parser("hermes")), cuts, "stop")
    assert "".join(a.text for a in added) == "Let me check."
    calls = [d for a in added for d in a.calls]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads("".join(d["function"].get("arguments", "") for d in calls)) == {"city": "Oslo"}
    assert [a.finish for a in added][-1] == "tool_calls"


def test_a_reply_cut_by_max_tokens_keeps_length_as_its_finish():
    added = fed(ChoiceStream(get_parser("hermes")), ["Sure. ", CALL[:30]], "length")
    assert added[-1].finish == "length"
    assert "".join(a.text for a in added) == "Sure."


def test_the_framings_chunks_end_with_done_and_events_are_numbered_from_zero():
    assert data_event({"a": 1}) == 'data: {"a": 1}\n\n' and DONE == "data: [DONE]\n\n"
    events = EventStream()
    first, second = events.event("response.created", {"x": 1}), events.event("response.completed", {})
    assert (
        first
        == 'event: response.created\ndata: {"type": "response.created", "sequence_number": 0, "x": 1}\n\n'
    )
    assert json.loads(second.split("data: ", 1)[1])["sequence_number"] == 1
