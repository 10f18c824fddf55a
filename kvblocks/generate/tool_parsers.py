"""Reading tool calls out of generated text, one `ToolParser` per output format (`hermes`,
`llama3_json`, `mistral`), whole (`parse`, `parse_cut`) or piece by piece (`ToolStreamParser`).

Malformed calls are never an error: their text stays content. A call's arguments are the JSON text
the model wrote (when it wrote an object), so streamed fragments join to exactly the final
arguments. `kvblocks.generate.tools` renders tools into prompts and constrains replies to a format.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar


class ToolError(ValueError):
    """A malformed tool definition or tool_choice; the message names the offending field."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's wire form)
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


# ---- parsers -------------------------------------------------------------------------------


def _calls_from(objs: list[Any]) -> list[ToolCall]:
    """A call from each of `objs`; none at all unless every one is a call."""
    calls = [_call_from(obj) for obj in objs]
    return [c for c in calls if c is not None] if None not in calls else []


def _call_from(obj: Any) -> ToolCall | None:
    """A call from `{"name": ..., "arguments" | "parameters": {...}}`; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_DECODER = json.JSONDecoder()


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _decode_at(text: str, pos: int) -> tuple[Any, int] | None:
    """(value, end) of the JSON value starting at `pos` (after whitespace); None if there is none."""
    try:
        return _DECODER.raw_decode(text, _skip_space(text, pos))
    except json.JSONDecodeError:
        return None


def _complete_items(text: str, pos: int) -> list[Any]:
    """The complete values of a JSON array that opens at `pos` (after whitespace) and may be cut off."""
    pos = _skip_space(text, pos)
    if not text.startswith("[", pos):
        return []
    items, pos = [], pos + 1
    while (decoded := _decode_at(text, pos)) is not None:
        items.append(decoded[0])
        pos = _skip_space(text, decoded[1])
        if not text.startswith(",", pos):
            break
        pos += 1
    return items


class ToolParser:
    """One model family's tool-call format.

    `parse` removes every well-formed call span from the text; what is left, stripped, is the
    content. Spans never begin before `call_start`, which is what lets `ToolStreamParser`
    release the text before it early.
    """

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]  # text that opens a call
    args_key: ClassVar[str]  # where this format puts the arguments
    example: ClassVar[str]  # the format, as the built-in preamble teaches it

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return self._split(text, cut=False)

    def parse_cut(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """`parse` of a reply stopped by max_tokens: every complete call, and the content less the
        unfinished call and its markup (a half call is not a call)."""
        return self._split(text, cut=True)

    def _split(self, text: str, cut: bool) -> tuple[str | None, list[ToolCall]]:
        kept, calls, pos = [], [], 0
        for start, end, found in self._spans(text, cut):
            kept.append(text[pos:start])
            calls.extend(_as_written(text[start:end], found))
            pos = end
        tail = text[pos:]
        if cut:  # the unfinished call, or the marker it was beginning with
            unfinished = self.call_start(tail)
            tail = tail[: len(tail) - self.partial_marker(tail) if unfinished is None else unfinished]
        kept.append(tail)
        content = "".join(kept).strip()
        return content or None, calls

    def call_start(self, text: str) -> int | None:
        """Where the first call could begin, or None if no call has begun yet."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def partial_marker(self, text: str) -> int:
        """Length of the longest end of `text` that could grow into a marker."""
        return max(
            (
                k
                for m in self.markers
                for k in range(min(len(m) - 1, len(text)), 0, -1)
                if text.endswith(m[:k])
            ),
            default=0,
        )

    def render(self, calls: Sequence[tuple[str, object]]) -> str:
        """(name, arguments) pairs written the way this format writes them."""
        raise NotImplementedError

    def grammar(
        self,
        alternatives: list[dict[str, Any]],
        parallel: bool,
        options: Mapping[str, object],
        lit: Callable[[str], str],
    ) -> str:
        """A Lark grammar: one call (several if `parallel`), each matching one JSON schema of
        `alternatives` compiled with llguidance JSON `options`; `lit` writes a marker as a Lark
        literal (or as the special token it is)."""
        raise NotImplementedError

    def _spans(self, text: str, cut: bool) -> Iterator[tuple[int, int, list[ToolCall]]]:
        """(start, end, calls) of each well-formed call span; with `cut` (the text stopped early)
        also the complete calls of a span whose end was cut off, the span running to the end."""
        raise NotImplementedError


class HermesParser(ToolParser):
    """Hermes / Qwen: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, repeated.

    An unclosed last block (the model stopped right after the JSON) still counts.
    """

    name = "hermes"
    markers = ("<tool_call>",)
    args_key = "arguments"
    example = (
        '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>\n'
        "with one <tool_call></tool_call> block per call."
    )
    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"

    def _spans(self, text: str, cut: bool) -> Iterator[tuple[int, int, list[ToolCall]]]:
        """The JSON is decoded before the closing tag is looked for: a `</tool_call>` inside one of
        its strings (a grammar-valid argument) is text, not the end of the call."""
        pos = 0
        while (start := text.find(self._OPEN, pos)) >= 0:
            pos = start + len(self._OPEN)
            decoded = _decode_at(text, pos)
            if decoded is None:
                continue
            after = _skip_space(text, decoded[1])
            rest = text[after:]
            if rest.startswith(self._CLOSE):
                end = after + len(self._CLOSE)
            elif not rest or (cut and self._CLOSE.startswith(rest)):
                end = len(text)  # unclosed last block, or its closing tag cut off
            else:
                continue
            call = _call_from(decoded[0])
            if call is not None:
                yield start, end, [call]
                pos = end

    def render(self, calls: Sequence[tuple[str, object]]) -> str:
        return "\n".join(
            f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>"
            for n, a in calls
        )

    def grammar(
        self,
        alternatives: list[dict[str, Any]],
        parallel: bool,
        options: Mapping[str, object],
        lit: Callable[[str], str],
    ) -> str:
        newline = lit("\n")
        more = f" ({newline} call)*" if parallel else ""
        return (
            f"start: call{more}\n"
            f"call: {lit('<tool_call>')} {newline} fn {newline} {lit('</tool_call>')}\n"
            f"fn: %json {json.dumps({'anyOf': alternatives, 'x-guidance': options})}\n"
        )


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}` (or "arguments"), several
    joined by `;`, optionally after `<|python_tag|>`; a call must open the reply or follow the tag.
    """

    name = "llama3_json"
    markers = ("<|python_tag|>",)
    args_key = "parameters"
    example = (
        '{"name": <function-name>, "parameters": <arguments-json-object>}\n'
        'with several calls separated by "; ".'
    )

    def call_start(self, text: str) -> int | None:
        tag = super().call_start(text)
        body = len(text) - len(text.lstrip())
        if text[body : body + 1] == "{" and (tag is None or body < tag):
            return body
        return tag

    def _spans(self, text: str, cut: bool) -> Iterator[tuple[int, int, list[ToolCall]]]:
        start = self.call_start(text)
        if start is None:
            return
        pos = start + len(self.markers[0]) if text.startswith(self.markers[0], start) else start
        calls: list[ToolCall] = []
        while True:  # call (";" call)*; any malformed call and none of them count, unless cut off
            decoded = _decode_at(text, pos)
            call = _call_from(decoded[0]) if decoded is not None else None
            if call is None or decoded is None:
                if cut and calls:
                    yield start, len(text), calls
                return
            calls.append(call)
            pos = decoded[1]
            rest = text[pos:].lstrip()
            if not rest.startswith(";"):
                break
            pos = len(text) - len(rest) + 1
        yield start, pos, calls

    def render(self, calls: Sequence[tuple[str, object]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)

    def grammar(
        self,
        alternatives: list[dict[str, Any]],
        parallel: bool,
        options: Mapping[str, object],
        lit: Callable[[str], str],
    ) -> str:
        more = f" ({lit('; ')} fn)*" if parallel else ""
        return f"start: fn{more}\nfn: %json {json.dumps({'anyOf': alternatives, 'x-guidance': options})}\n"


class MistralParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
    `[TOOL_CALLS]name[ARGS]{...}` repeated once per call.

    `[TOOL_CALLS]` is a special token in Mistral tokenizers: decode with special tokens kept.
    """

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    args_key = "arguments"
    example = '[TOOL_CALLS][{"name": <function-name>, "arguments": <arguments-json-object>}, ...]'
    _NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")

    def _spans(self, text: str, cut: bool) -> Iterator[tuple[int, int, list[ToolCall]]]:
        marker = self.markers[0]
        pos = text.find(marker)
        while pos >= 0:
            body = pos + len(marker)
            named = self._NAMED.match(text, body)
            decoded = _decode_at(text, named.end() if named else body)
            calls: list[ToolCall] = []
            if decoded is not None and named:
                if isinstance(decoded[0], dict):
                    calls = [ToolCall(named.group(1), json.dumps(decoded[0], ensure_ascii=False))]
            elif decoded is not None and isinstance(decoded[0], list) and decoded[0]:
                calls = _calls_from(decoded[0])
            elif decoded is None and cut and not named:  # an array cut off: its complete calls
                items = _complete_items(text, body)
                calls = _calls_from(items)
                decoded = (items, len(text))
            if calls and decoded is not None:
                yield pos, decoded[1], calls
                body = decoded[1]
            pos = text.find(marker, body)

    def render(self, calls: Sequence[tuple[str, object]]) -> str:
        return "[TOOL_CALLS]" + json.dumps(
            [{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False
        )

    def grammar(
        self,
        alternatives: list[dict[str, Any]],
        parallel: bool,
        options: Mapping[str, object],
        lit: Callable[[str], str],
    ) -> str:
        schema = {"type": "array", "items": {"anyOf": alternatives}, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        schema["x-guidance"] = options
        return f"start: {lit('[TOOL_CALLS]')} calls\ncalls: %json {json.dumps(schema)}\n"


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def get_parser(name: str) -> ToolParser:
    """The parser for `--tool-parser NAME`."""
    if name not in PARSERS:
        raise ToolError(f"unknown tool parser {name!r}; choose one of {', '.join(PARSERS)}")
    return PARSERS[name]()


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else template


def detect_parser(tokenizer: Any) -> str:
    """The name of the parser matching the chat template's tool format; "hermes" (the built-in
    preamble's format) when the template shows none."""
    template = _template_text(tokenizer)
    if "<tool_call>" in template:
        return HermesParser.name
    if "[TOOL_CALLS]" in template:
        return MistralParser.name
    if "<|python_tag|>" in template or "ipython" in template:
        return Llama3JsonParser.name
    return HermesParser.name


# Where a call's name and arguments begin, in every format: `"name": "f", "arguments": ` (or
# "parameters"), and Mistral's `[TOOL_CALLS]f[ARGS]`. The grammars and the formats write the name first.
_CALL_HEAD = re.compile(
    r'"name"\s*:\s*"([A-Za-z0-9_.\-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
    r"|\[TOOL_CALLS\]\s*([A-Za-z0-9_.\-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]\s*"
)


def _as_written(span: str, calls: list[ToolCall]) -> list[ToolCall]:
    """`calls` with their arguments as the model wrote them in `span`: the object after each call's
    head, where it decodes to the parsed arguments (a call written otherwise keeps its re-encoding)."""
    heads, out = _CALL_HEAD.finditer(span), []
    for call in calls:
        parsed = json.loads(call.arguments)
        for head in heads:
            begin = _skip_space(span, head.end())
            decoded = _decode_at(span, begin)
            if (head.group(1) or head.group(2)) == call.name and decoded is not None:
                if span.startswith("{", begin) and decoded[0] == parsed:
                    call = replace(call, arguments=span[begin : decoded[1]])
                break
        out.append(call)
    return out


@dataclass(slots=True)
class _StreamedCall:
    id: str
    name: str
    sent: int = 0  # characters of the arguments text sent so far
    closed: bool = False  # its arguments object is complete


class ToolStreamParser:
    """`ToolParser.parse`, piece by piece: content deltas as soon as they are safe, and each call's
    arguments as they are generated (`call_deltas`, OpenAI's delta shape).

    Text before the first call marker is released as it arrives, less an end that could grow
    into a marker and trailing whitespace (the parse strips it). From the first marker on, content
    is held and `finish()` settles it with the full parse, so the deltas always join to exactly
    the content `parse` gives for the whole text. Arguments are streamed as the JSON text the
    model writes, which is the parsed call's `arguments`: the head that names a call may end
    anywhere in the whitespace before its object, and the object is sent as far as it is written.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.released = ""
        self.holding = False
        self.streamed: list[_StreamedCall] = []
        self._scan = 0  # where the next call head may start
        self._args_at: int | None = None  # where the open call's arguments start

    def feed(self, piece: str) -> str:
        """Add generated text; returns the content that can be shown now (maybe "")."""
        self.text += piece
        if self.holding:
            return ""
        start = self.parser.call_start(self.text)
        if start is not None:
            self.holding = True
            self._scan = start
            return self._release(self.text[:start].strip())
        return self._release(self.text[: len(self.text) - self.parser.partial_marker(self.text)].strip())

    def call_deltas(self) -> list[dict[str, Any]]:
        """OpenAI `delta.tool_calls` entries for what the calls gained since the last look: a new
        call's first entry has its id, type and name; later ones add `function.arguments` text."""
        out = []
        while self.holding:
            if self._args_at is None:
                head = _CALL_HEAD.search(self.text, self._scan)
                if head is None:
                    break
                self.streamed.append(
                    _StreamedCall("call_" + secrets.token_hex(12), head.group(1) or head.group(2))
                )
                self._args_at = head.end()
                out.append(self._delta({"name": self.streamed[-1].name, "arguments": ""}, first=True))
            call = self.streamed[-1]
            self._args_at = _skip_space(self.text, self._args_at)
            if not self.text.startswith("{", self._args_at):
                break  # arguments not begun yet, or not an object (then `finish_deltas` sends them)
            decoded = _decode_at(self.text, self._args_at)
            end = decoded[1] if decoded is not None else len(self.text)
            fragment = self.text[self._args_at + call.sent : end]
            if fragment:
                out.append(self._delta({"arguments": fragment}))
                call.sent += len(fragment)
            if decoded is None:
                break
            call.closed = True
            self._scan, self._args_at = end, None
        return out

    def finish_deltas(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """What the client still lacks of the parsed `calls` once the stream ended: whole calls that
        were never streamed, arguments of streamed calls that were not written as an object."""
        out = []
        for k, c in enumerate(calls):
            if k >= len(self.streamed):
                out.append(c.as_openai() | {"index": k})
            elif self.streamed[k].sent == 0:
                out.append({"index": k, "function": {"arguments": c.arguments}})
        return out

    def _delta(self, fn: dict[str, Any], first: bool = False) -> dict[str, Any]:
        k = len(self.streamed) - 1
        head = {"id": self.streamed[k].id, "type": "function"} if first else {}
        return {"index": k, **head, "function": fn}

    def finish(self, finish_reason: str | None = None) -> tuple[str, list[ToolCall]]:
        """The stream ended: the last content delta and every tool call (when the reply was cut by
        max_tokens, `finish_reason` "length", every complete one: `ToolParser.parse_cut`)."""
        parse = self.parser.parse_cut if finish_reason == "length" else self.parser.parse
        content, calls = parse(self.text)
        return self._release(content or ""), calls

    def _release(self, content: str) -> str:
        assert content.startswith(self.released), "released content must stay a prefix of the content"
        delta = content[len(self.released) :]
        self.released = content
        return delta
