"""OpenAI tools for chat: putting tools into the prompt, reading tool calls out of the reply.

- Rendering. `render_messages` puts tool definitions, assistant `tool_calls` and `tool` results
  into the prompt: through the model's chat template when the template handles tools (probed once
  per tokenizer), otherwise through a built-in preamble on top of the plain template: a system
  section listing the tools as JSON schemas and asking for the parser's call format (Hermes by
  default); earlier calls are written in that format in the assistant turn, and tool results
  come back as a user turn of `<tool_response>` blocks (the Hermes convention).
- Parsing. A `ToolParser` per output format (`hermes`, `llama3_json`, `mistral`) splits generated
  text into content and `ToolCall`s; `ToolStreamParser` does the same piece by piece, whatever
  the tokenization of the markup. Malformed calls are never an error: their text stays content.
  A call's arguments are the JSON text the model wrote (when it wrote an object), so streamed
  fragments join to exactly the final arguments. A reply cut by max_tokens keeps every complete
  call and drops only the unfinished one (`parse_cut`).
- Constraining. `tool_call_grammar` gives an llguidance Lark grammar for `tool_choice="required"`
  or a named function, in the parser's own format, so a constrained reply always parses with
  that parser and its arguments follow the tool's `parameters` schema.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

from jinja2 import TemplateError

from kvblocks.generate.grammar import JSON_OPTIONS
from kvblocks.generate.text import PromptError


class ToolError(ValueError):
    """A malformed tool definition or tool_choice; the message names the offending field."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's wire form)
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def as_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


# ---- tool definitions ----------------------------------------------------------------------

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def validate_tools(tools: Sequence[dict] | None) -> list[dict]:
    """The `function` objects of OpenAI `tools`, checked, with `parameters` an object schema."""
    if tools is None:
        return []
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise ToolError('tools must be a list of {"type": "function", "function": {...}} objects')
    functions, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolError(f'{where}: "type" must be "function"')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f'{where}: "function" must be an object with a "name"')
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'; got {name!r}")
        if name in seen:
            raise ToolError(f"{where}: two tools are named {name!r}")
        seen.add(name)
        if not isinstance(fn.get("description", ""), str | None):
            raise ToolError(f"{where}.function.description must be a string")
        params = fn.get("parameters")
        if not params:  # no parameters: the function takes no arguments
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolError(f'{where}.function.parameters must be a JSON schema with "type": "object"')
        if not isinstance(params.get("properties", {}), dict):
            raise ToolError(f"{where}.function.parameters.properties must be an object")
        required = params.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ToolError(f"{where}.function.parameters.required must be a list of property names")
        functions.append(
            {"name": name, "parameters": {**params, "type": "object"}, "strict": fn.get("strict") is True}
        )
    return functions


# ---- parsers -------------------------------------------------------------------------------


def _call_from(obj) -> ToolCall | None:
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


def _decode_at(text: str, pos: int):
    """(value, end) of the JSON value starting at `pos` (after whitespace); None if there is none."""
    try:
        return _DECODER.raw_decode(text, _skip_space(text, pos))
    except json.JSONDecodeError:
        return None


def _complete_items(text: str, pos: int) -> list:
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
        self, alternatives: list[dict], parallel: bool, options: dict, lit: Callable[[str], str]
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

    def _spans(self, text, cut):
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

    def render(self, calls):
        return "\n".join(
            f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>"
            for n, a in calls
        )

    def grammar(self, alternatives, parallel, options, lit):
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

    def call_start(self, text):
        tag = super().call_start(text)
        body = len(text) - len(text.lstrip())
        if text[body : body + 1] == "{" and (tag is None or body < tag):
            return body
        return tag

    def _spans(self, text, cut):
        start = self.call_start(text)
        if start is None:
            return
        pos = start + len(self.markers[0]) if text.startswith(self.markers[0], start) else start
        calls = []
        while True:  # call (";" call)*; any malformed call and none of them count, unless cut off
            decoded = _decode_at(text, pos)
            call = _call_from(decoded[0]) if decoded is not None else None
            if call is None:
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

    def render(self, calls):
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)

    def grammar(self, alternatives, parallel, options, lit):
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

    def _spans(self, text, cut):
        marker = self.markers[0]
        pos = text.find(marker)
        while pos >= 0:
            body = pos + len(marker)
            named = self._NAMED.match(text, body)
            decoded = _decode_at(text, named.end() if named else body)
            calls = None
            if decoded is not None and named:
                if isinstance(decoded[0], dict):
                    calls = [ToolCall(named.group(1), json.dumps(decoded[0], ensure_ascii=False))]
            elif decoded is not None and isinstance(decoded[0], list) and decoded[0]:
                calls = [_call_from(obj) for obj in decoded[0]]
            elif decoded is None and cut and not named:  # an array cut off: its complete calls
                items = _complete_items(text, body)
                calls = [_call_from(obj) for obj in items]
                decoded = (items, len(text))
            if calls and None not in calls:
                yield pos, decoded[1], calls
                body = decoded[1]
            pos = text.find(marker, body)

    def render(self, calls):
        return "[TOOL_CALLS]" + json.dumps(
            [{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False
        )

    def grammar(self, alternatives, parallel, options, lit):
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


def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else template


def detect_parser(tokenizer) -> str:
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

    def call_deltas(self) -> list[dict]:
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

    def finish_deltas(self, calls: list[ToolCall]) -> list[dict]:
        """What the client still lacks of the parsed `calls` once the stream ended: whole calls that
        were never streamed, arguments of streamed calls that were not written as an object."""
        out = []
        for k, c in enumerate(calls):
            if k >= len(self.streamed):
                out.append(c.as_openai() | {"index": k})
            elif self.streamed[k].sent == 0:
                out.append({"index": k, "function": {"arguments": c.arguments}})
        return out

    def _delta(self, fn: dict, first: bool = False) -> dict:
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


# ---- rendering -----------------------------------------------------------------------------

_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "kvb_probe_tool",
            "description": "kvb probe description",
            "parameters": {"type": "object", "properties": {"kvb_probe_arg": {"type": "string"}}},
        },
    }
]
_PROBE_MESSAGES = [
    {"role": "user", "content": "kvb probe question"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "kvbprobe1",  # 9 alphanumerics: Mistral templates insist
                "type": "function",
                "function": {"name": "kvb_probe_tool", "arguments": {"kvb_probe_arg": "kvb probe value"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "kvbprobe1", "name": "kvb_probe_tool", "content": "kvb probe result"},
]
_probed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_probe_lock = threading.Lock()


def template_supports_tools(tokenizer) -> bool:
    """Whether the chat template renders tool definitions, assistant tool calls and tool results.

    Probed once per tokenizer by rendering a conversation with marked names and checking that
    each mark reaches the text.
    """
    with _probe_lock:
        if tokenizer not in _probed:
            _probed[tokenizer] = _probe(tokenizer)
        return _probed[tokenizer]


def _probe(tokenizer) -> bool:
    if not getattr(tokenizer, "chat_template", None):
        return False
    try:
        text = tokenizer.apply_chat_template(
            _PROBE_MESSAGES, tools=_PROBE_TOOLS, add_generation_prompt=True, tokenize=False
        )
    except Exception:  # a template is third-party code; any failure means "no tool support"
        return False
    marks = ("kvb_probe_tool", "kvb probe description", "kvb probe value", "kvb probe result")
    return all(mark in text for mark in marks)


def _text(content) -> str:
    """OpenAI message content (None, a string or text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise PromptError("message content must be a string or a list of text parts")


def _calls_of(message: dict, index: int) -> list[tuple[str, object]]:
    """(name, arguments) of an assistant message's `tool_calls`; arguments decoded when JSON."""
    calls = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise PromptError(f"message {index}: every tool call needs a function with a name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            with contextlib.suppress(json.JSONDecodeError):  # else kept as the client sent it
                args = json.loads(args)
        calls.append((fn["name"], args))
    return calls


def _check_roles(messages: Sequence[dict]) -> None:
    if not messages:
        raise PromptError("messages must not be empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise PromptError(f"message {i} needs a string 'role'")


def render_messages(
    tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None, parser: ToolParser | None = None
) -> list[dict[str, str]] | list[int]:
    """The chat prompt with tools, in a form `kvblocks.generate.text.encode_prompt` takes.

    - no tools and no tool turns: plain `{role, content}` messages, exactly as without tools;
    - the chat template handles tools: the token ids of the template rendered with `tools=`;
    - otherwise: plain messages with the built-in preamble, calls and results written as text.

    `parser` (default: the detected one) sets the call format the built-in preamble asks for.
    Raises ToolError for bad tools, PromptError for bad messages.
    """
    functions = validate_tools(tools)
    _check_roles(messages)
    has_tool_turns = any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if not functions and not has_tool_turns:
        return [{"role": m["role"], "content": _text(m.get("content"))} for m in messages]
    if template_supports_tools(tokenizer):
        return _render_with_template(tokenizer, messages, tools if functions else None)
    parser = parser or get_parser(detect_parser(tokenizer))
    return _render_builtin(messages, tools if functions else None, parser)


def _render_with_template(tokenizer, messages: Sequence[dict], tools) -> list[int]:
    converted = []
    for i, m in enumerate(messages):
        m = {**m, "content": _text(m.get("content"))}
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**call, "type": "function", "function": {"name": n, "arguments": a}}
                for call, (n, a) in zip(m["tool_calls"], _calls_of(m, i))
            ]
        converted.append(m)
    try:
        text = tokenizer.apply_chat_template(
            converted, tools=tools, add_generation_prompt=True, tokenize=False
        )
    except TemplateError as exc:
        raise PromptError(f"the chat template rejected the messages: {exc}") from exc
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _render_builtin(messages: Sequence[dict], tools, parser: ToolParser) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    after_tool = False
    for i, m in enumerate(messages):
        content = _text(m.get("content"))
        if m["role"] == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if after_tool:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            after_tool = True
            continue
        after_tool = False
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = parser.render(_calls_of(m, i))
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": m["role"], "content": content})
    if tools:
        preamble = _preamble(tools, parser)
        if out[0]["role"] in ("system", "developer"):
            out[0]["content"] = f"{out[0]['content']}\n\n{preamble}" if out[0]["content"] else preamble
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def _preamble(tools, parser: ToolParser) -> str:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\n"
        "You may call one or more functions to help with the user's request. "
        "The functions are described by these JSON schemas:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        f"To call functions, reply in this format:\n{parser.example}\n"
        "Function results come back inside <tool_response></tool_response> tags."
    )


# ---- constrained calls ---------------------------------------------------------------------


def tool_call_grammar(
    tools: Sequence[dict] | None,
    tool_choice,
    parser: ToolParser,
    *,
    parallel_tool_calls: bool = True,
    tokenizer=None,
    answer: str | None = None,
) -> str | None:
    """A Lark grammar forcing the reply to be tool calls, or None when nothing is forced.

    `tool_choice`: "none" / "auto" / None -> None; "required" -> calls to any of the tools,
    one or more if `parallel_tool_calls` else exactly one; {"type": "function", "function":
    {"name": N}} -> exactly one call to N. With `tokenizer`, markers that are special tokens
    of it (Mistral's `[TOOL_CALLS]`) are written as those tokens.

    `answer`, the body of a Lark rule (a structured final message, `%json {...}`): with "auto"
    or None the reply is either calls to any of the tools or one sentence of `answer`, so a model
    that must answer in a format can still call tools first. Forced calls ignore it: the format
    is for the final message of a later turn.
    """
    functions = validate_tools(tools)
    if tool_choice in (None, "auto") and answer is not None and functions:
        calls = _calls_grammar(functions, parallel_tool_calls, parser, tokenizer)
        assert calls.startswith("start:"), "a parser's grammar begins with its start rule"
        return f"start: tool_calls | answer\ntool_calls:{calls[len('start:') :]}answer: {answer}\n"
    if tool_choice in (None, "none", "auto"):
        return None
    if tool_choice == "required":
        chosen, parallel = functions, parallel_tool_calls
    elif (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), dict)
        and isinstance(tool_choice["function"].get("name"), str)
    ):
        name = tool_choice["function"]["name"]
        chosen, parallel = [f for f in functions if f["name"] == name], False
        if not chosen:
            raise ToolError(f"tool_choice names the function {name!r}, which is not in tools")
    else:
        raise ToolError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )
    if not chosen:
        raise ToolError('tool_choice "required" needs at least one tool')
    return _calls_grammar(chosen, parallel, parser, tokenizer)


def _calls_grammar(chosen: list[dict], parallel: bool, parser: ToolParser, tokenizer) -> str:
    """Calls to the `chosen` functions in the parser's format, each under its own schema."""
    alternatives = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, parser.args_key: _closed(f["parameters"])},
            "required": ["name", parser.args_key],
            "additionalProperties": False,
        }
        for f in chosen
    ]
    # Keywords llguidance cannot enforce are ignored, unless a chosen tool asks to be strict.
    options = {**JSON_OPTIONS, "lenient": not any(f["strict"] for f in chosen)}
    return parser.grammar(alternatives, parallel, options, _literal_writer(tokenizer))


_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")


def _closed(schema):
    """`schema` with objects that list their properties closed to others (`additionalProperties:
    false`) unless they say otherwise: a function's arguments are its parameters, nothing more.
    `allOf` branches are left alone (closing each would reject the others' properties)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(s) for name, s in out[key].items()}
    for key in _SCHEMA_VALUES:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    if "properties" in out and not any(key in out for key in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def _literal_writer(tokenizer) -> Callable[[str], str]:
    special = {}
    if tokenizer is not None:
        special = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return lambda s: f"<[{special[s]}]>" if s in special else json.dumps(s)


# ---- closing parallel calls within the budget ----------------------------------------------


def next_call_tokens(tokenizer, parser: ToolParser, tools: Sequence[dict]) -> int:
    """About the fewest tokens another call takes after a complete one: the separator and the
    markup of a call to the shortest-named tool with empty arguments (real arguments add more)."""
    name = min((f["name"] for f in validate_tools(tools)), key=len)
    one, two = (
        len(tokenizer(parser.render([(name, {})] * k), add_special_tokens=False)["input_ids"]) for k in (1, 2)
    )
    return two - one


@dataclass(frozen=True, slots=True)
class ClosingCalls:
    """A tool-call grammar (a `ConstraintFactory`) for a reply of at most `budget` tokens that also
    ends the reply after a complete call once fewer than `reserve` tokens are left (the tokens of
    the shortest next call): parallel calls then close at the last call that fits instead of being
    cut inside one that cannot."""

    factory: object  # kvblocks.generate.grammar.GrammarFactory
    budget: int
    reserve: int

    def start(self) -> _ClosingState:
        return _ClosingState(self.factory.start(), self.budget - self.reserve)


class _ClosingState:
    def __init__(self, inner, last_start: int) -> None:
        self.inner = inner
        self.last_start = last_start  # the latest token count after which another call still fits
        self.used = 0

    def mask(self, logits) -> None:
        self.inner.mask(logits)

    def advance(self, token: int) -> None:
        self.inner.advance(token)
        self.used += 1

    def done(self) -> bool:
        return self.inner.done() or (self.used > self.last_start and self.inner.can_end())
