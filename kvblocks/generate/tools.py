"""OpenAI tools for chat: putting tools into the prompt, reading tool calls out of the reply.

- Rendering. `render_messages` puts tool definitions, assistant `tool_calls` and `tool` results
  into the prompt: through the model's chat template when the template handles tools (probed once
  per tokenizer), otherwise through a built-in preamble on top of the plain template: a system
  section listing the tools as JSON schemas and asking for the parser's call format (Hermes by
  default); earlier calls are written in that format in the assistant turn, and tool results
  come back as a user turn of `<tool_response>` blocks (the Hermes convention).
- Parsing (`kvblocks.generate.tool_parsers`, its names importable from here too). A `ToolParser`
  per output format (`hermes`, `llama3_json`, `mistral`) splits generated text into content and
  `ToolCall`s; `ToolStreamParser` does the same piece by piece, whatever the tokenization of the
  markup. Malformed calls are never an error: their text stays content.
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
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jinja2 import TemplateError

from kvblocks.generate.grammar import JSON_OPTIONS, GrammarConstraint, GrammarFactory
from kvblocks.generate.text import PromptError
from kvblocks.generate.tool_parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolCall,
    ToolError,
    ToolParser,
    ToolStreamParser,
    detect_parser,
    get_parser,
)

# the parsing side's names stay importable from here, where the server and clients found them
__all__ = [
    "PARSERS",
    "ClosingCalls",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ToolCall",
    "ToolError",
    "ToolParser",
    "ToolStreamParser",
    "detect_parser",
    "get_parser",
    "next_call_tokens",
    "render_messages",
    "template_supports_tools",
    "tool_call_grammar",
    "validate_tools",
]


_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def validate_tools(tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
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
_probed: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_probe_lock = threading.Lock()


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders tool definitions, assistant tool calls and tool results.

    Probed once per tokenizer by rendering a conversation with marked names and checking that
    each mark reaches the text.
    """
    with _probe_lock:
        if tokenizer not in _probed:
            _probed[tokenizer] = _probe(tokenizer)
        return _probed[tokenizer]


def _probe(tokenizer: Any) -> bool:
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


def _text(content: Any) -> str:
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


def _calls_of(message: dict[str, Any], index: int) -> list[tuple[str, object]]:
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


def _check_roles(messages: Sequence[dict[str, Any]]) -> None:
    if not messages:
        raise PromptError("messages must not be empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise PromptError(f"message {i} needs a string 'role'")


def render_messages(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    parser: ToolParser | None = None,
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


def _render_with_template(
    tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> list[int]:
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
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def _render_builtin(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, parser: ToolParser
) -> list[dict[str, str]]:
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


def _preamble(tools: Sequence[dict[str, Any]], parser: ToolParser) -> str:
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
    tools: Sequence[dict[str, Any]] | None,
    tool_choice: Any,
    parser: ToolParser,
    *,
    parallel_tool_calls: bool = True,
    tokenizer: Any = None,
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


def _calls_grammar(chosen: list[dict[str, Any]], parallel: bool, parser: ToolParser, tokenizer: Any) -> str:
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


def _closed(schema: Any) -> Any:
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


def _literal_writer(tokenizer: Any) -> Callable[[str], str]:
    special = {}
    if tokenizer is not None:
        special = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return lambda s: f"<[{special[s]}]>" if s in special else json.dumps(s)


# ---- closing parallel calls within the budget ----------------------------------------------


def next_call_tokens(tokenizer: Any, parser: ToolParser, tools: Sequence[dict[str, Any]]) -> int:
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

    factory: GrammarFactory
    budget: int
    reserve: int

    def start(self) -> _ClosingState:
        return _ClosingState(self.factory.start(), self.budget - self.reserve)


class _ClosingState:
    def __init__(self, inner: GrammarConstraint, last_start: int) -> None:
        self.inner = inner
        self.last_start = last_start  # the latest token count after which another call still fits
        self.used = 0

    def mask(self, logits: torch.Tensor) -> None:
        self.inner.mask(logits)

    def advance(self, token: int) -> None:
        self.inner.advance(token)
        self.used += 1

    def done(self) -> bool:
        return self.inner.done() or (self.used > self.last_start and self.inner.can_end())
