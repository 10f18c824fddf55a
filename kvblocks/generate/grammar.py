"""Constrained decoding with llguidance: any JSON object, a JSON schema, or a Lark grammar.

A factory compiles its grammar once per request (an `LLMatcher` that is never advanced);
`start()` deep-copies it (microseconds), so every generated sequence has its own parser state.

Masking is branch-free: llguidance writes one bit per token into a preallocated bitmask, a
256-entry table turns each mask byte into eight additive biases (0 or -inf), and the row is
added to the logits. Ids the tokenizer lacks (a model vocabulary padded past the tokenizer's)
keep a -inf bias and are never allowed.

When the text is complete, `done()` is true: the matcher is stopped, either because the grammar
admits no further byte (a JSON value's closing brace) or because the end-of-sequence token was
consumed. The mask allows EOS only where the grammar accepts, so text cut at EOS is complete
(JSON parses). JSON whitespace is fixed (`", "` and `": "`, nothing else), so a model cannot
spend its budget on spaces between tokens.

Compiling is bounded (`GrammarLimits`). A schema is measured before llguidance sees it
(`check_schema`: size, the longest path of nesting and `$ref` hops, counts), because llguidance
compiles `$ref` chains by recursion on its thread's stack and a long enough chain overflows any
stack. It then compiles on a thread of its own whose stack fits what the limits allow (3.5 to 7 KB
per level measured, given 32 KB), within a time budget. A compile past its budget cannot be
interrupted (it runs in Rust without the GIL): its request is refused at once, the thread finishes
in the background (llguidance's own limits bound it) and its result is dropped; it keeps one of the
`MAX_COMPILING` places until then, so runaway compiles cannot pile up, and the process waits for it
when it exits. llguidance's parser limits
(`LLParserLimits`) bound the lexer and parser work of every token; a grammar that hits them while
decoding ends its request with a `ConstraintError`.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import torch
from llguidance import LLMatcher, LLParserLimits

from kvblocks.generate.params import ConstraintError

if TYPE_CHECKING:
    from collections.abc import Iterator

    from llguidance._lib import JsonCompileOptions  # the stub declares it there only

# Overrides any "x-guidance" in a user's schema: whitespace is never free-form.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

# _BYTE_BIAS[b, i] = 0 if bit i of byte b is set (token allowed), else -inf.
_BYTE_BIAS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"), 0.0, -np.inf
).astype(np.float32)

_ll_tokenizers: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_ll_lock = threading.Lock()


T = TypeVar("T")
MAX_COMPILING = 4  # compiles running at once, those past their budget included
_compiling = threading.BoundedSemaphore(MAX_COMPILING)
_stack_lock = threading.Lock()


class GrammarError(ValueError):
    """A JSON schema or grammar that cannot be compiled; the message says why."""


class GrammarBusy(GrammarError):
    """Every compile place is held (by compiles past their budget): retry later; not the schema's fault."""


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """What one request's schema may ask of the compiler (checked by `check_schema`), the time its
    compile may take, and llguidance's per-token parser limits. Real agents' schemas are a few KB
    deep to less than 20 levels; `kvblocks serve` exposes the first two and the timeout."""

    max_bytes: int = 128 << 10  # the schema (all chosen tools' schemas together) as JSON
    max_depth: int = 128  # nesting levels plus $ref hops on the longest non-repeating path
    max_nodes: int = 20_000  # objects and arrays, each $ref target counted once
    max_branches: int = 256  # entries of one anyOf / oneOf / allOf / prefixItems
    max_properties: int = 1024  # keys of one properties / patternProperties
    max_enum: int = 2048  # values of one enum
    max_enum_total: int = 16_384  # enum values in the whole schema
    max_pattern_chars: int = 4096  # one regular expression (pattern, a patternProperties key)
    compile_timeout_s: float = 5.0
    # llguidance's limits (LLParserLimits); its defaults but for fewer lexer states (memory) and
    # errors that do not echo the grammar
    step_lexer_fuel: int = 200_000  # lexer work per token (~14k/ms)
    step_max_items: int = 50_000  # Earley items per token (~20k/ms)
    max_lexer_states: int = 100_000  # ~1-2 KB each
    max_grammar_size: int = 500_000  # symbols in the compiled grammar

    @property
    def stack_bytes(self) -> int:
        """The compile thread's stack: 32 KB per level of `max_depth` (llguidance took 3.5 to 7 KB
        per level of $ref, properties, items and anyOf chains), at least 32 MB; address space that is
        touched only as deep as a compile goes."""
        return max(32 << 20, self.max_depth * (32 << 10))

    def parser_limits(self) -> LLParserLimits:
        return LLParserLimits(
            step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states,
            max_grammar_size=self.max_grammar_size,
            verbose_errors=False,
        )


DEFAULT_LIMITS = GrammarLimits()
_BRANCHES = ("anyOf", "oneOf", "allOf", "prefixItems")
_KEYED = ("properties", "patternProperties")


def check_schema(schema: Any, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """Refuse (GrammarError naming the limit and the value) a schema that would make compiling
    expensive or deep, before any of it is compiled. Linear in the schema's size.

    Depth is the longest path of nested objects and arrays where a `$ref` (a local JSON pointer:
    `#/$defs/x`, `#/definitions/x`, `#`) leads on to its target; a path stops where it would reach
    a node already on it, so a recursive schema is legal and measured by its longest non-repeating
    chain. Each node's depth is computed once (memoized), so shared `$defs` cost nothing extra.
    """
    size = len(json.dumps(schema))
    if size > limits.max_bytes:
        raise GrammarError(f"the JSON schema is {size} bytes, over this server's limit of {limits.max_bytes}")
    depth: dict[int, int] = {}  # id(node) -> depth of its subtree
    enum_total = 0
    nodes = 1
    on_path = {id(schema)}
    stack: list[list[Any]] = [[schema, _children(schema, schema), 0]]
    enum_total += _check_node(schema, limits)
    while stack:
        frame = stack[-1]
        child = next(frame[1], None)
        if child is None:
            stack.pop()
            on_path.discard(id(frame[0]))
            depth[id(frame[0])] = frame[2] + 1
            if stack:
                stack[-1][2] = max(stack[-1][2], frame[2] + 1)
            continue
        key = id(child)
        if key in depth:
            frame[2] = max(frame[2], depth[key])
        elif key not in on_path:  # a node already on the path: a recursion, which ends the path here
            nodes += 1
            if nodes > limits.max_nodes:
                raise GrammarError(
                    f"the JSON schema has more than {limits.max_nodes} objects and arrays "
                    f"(this server's limit)"
                )
            enum_total += _check_node(child, limits)
            if enum_total > limits.max_enum_total:
                raise GrammarError(
                    f"the JSON schema's enums hold {enum_total}+ values, over this server's limit of "
                    f"{limits.max_enum_total}"
                )
            on_path.add(key)
            stack.append([child, _children(child, schema), 0])
    longest = depth[id(schema)]
    if longest > limits.max_depth:
        raise GrammarError(
            f"the JSON schema is {longest} levels deep (nesting plus $ref hops), over this server's "
            f"limit of {limits.max_depth}"
        )


def _children(node: Any, root: Any) -> Iterator[Any]:
    """The objects and arrays `node` holds, then the target of its `$ref` (when local and found)."""
    values = node.values() if isinstance(node, dict) else node
    yield from (v for v in values if isinstance(v, dict | list))
    if isinstance(node, dict) and isinstance(node.get("$ref"), str):
        target = _resolve(root, node["$ref"])
        if isinstance(target, dict | list):
            yield target


def _resolve(root: Any, ref: str) -> Any:
    """The node a local `$ref` ("#" then a JSON pointer) names, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _check_node(node: Any, limits: GrammarLimits) -> int:
    """Refuse a node over a per-node limit; its enum's size (0 if none), for the total."""
    if not isinstance(node, dict):
        return 0
    for key in _BRANCHES:
        if isinstance(node.get(key), list) and len(node[key]) > limits.max_branches:
            raise GrammarError(
                f"a '{key}' of the JSON schema has {len(node[key])} entries, over this server's limit "
                f"of {limits.max_branches}"
            )
    for key in _KEYED:
        if isinstance(node.get(key), dict) and len(node[key]) > limits.max_properties:
            raise GrammarError(
                f"a '{key}' of the JSON schema has {len(node[key])} keys, over this server's limit of "
                f"{limits.max_properties}"
            )
    patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    if isinstance(node.get("patternProperties"), dict):
        patterns += list(node["patternProperties"])
    for pattern in patterns:
        if len(pattern) > limits.max_pattern_chars:
            raise GrammarError(
                f"a pattern of the JSON schema has {len(pattern)} characters, over this server's "
                f"limit of {limits.max_pattern_chars}"
            )
    enum = node.get("enum")
    if isinstance(enum, list) and len(enum) > limits.max_enum:
        raise GrammarError(
            f"an enum of the JSON schema has {len(enum)} values, over this server's limit of "
            f"{limits.max_enum}"
        )
    return len(enum) if isinstance(enum, list) else 0


def bounded(fn: Callable[[], T], limits: GrammarLimits, what: str) -> T:
    """`fn()` on a thread of its own with `limits.stack_bytes` of stack, waited for at most
    `limits.compile_timeout_s` (GrammarError past it; the thread runs on, its result dropped)."""
    budget = limits.compile_timeout_s
    began = time.monotonic()
    if not _compiling.acquire(timeout=budget):
        raise GrammarBusy(
            f"all {MAX_COMPILING} grammar compilers are busy with grammars that ran past their time "
            "budget; retry later"
        )
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the waiting request, which raises it
            box["error"] = exc
        finally:
            _compiling.release()

    with _stack_lock:  # the size applies to threads started while it is set
        previous = threading.stack_size(limits.stack_bytes)
        try:
            # not a daemon: an exiting interpreter waits for it (finalizing under a compile running
            # in Rust crashed the process, SIGSEGV at exit)
            thread = threading.Thread(target=run, name="kvblocks-grammar")
            thread.start()
        except BaseException:  # no thread (out of memory or threads): its place goes back
            _compiling.release()
            raise
        finally:
            threading.stack_size(previous)
    thread.join(max(0.0, budget - (time.monotonic() - began)))
    if thread.is_alive():
        raise GrammarError(
            f"compiling the {what} took longer than this server's limit of {budget:g} s; simplify it"
        )
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


def ll_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """The llguidance view of a Hugging Face tokenizer, built once per tokenizer (~0.5 s)."""
    with _ll_lock:
        ll = _ll_tokenizers.get(tokenizer)
        if ll is None:
            try:
                ll = llguidance.hf.from_tokenizer(tokenizer)
            except ValueError as exc:
                raise GrammarError(
                    f"this model's tokenizer does not support constrained decoding: {exc}"
                ) from exc
            _ll_tokenizers[tokenizer] = ll
    return ll


class GrammarConstraint:
    """One sequence's parser state; implements `kvblocks.generate.params.Constraint`."""

    def __init__(self, matcher: LLMatcher, n_tokens: int, vocab_size: int, param: str | None = None) -> None:
        self.matcher = matcher
        self.param = param
        self.n_tokens = n_tokens
        self.vocab_size = vocab_size
        self.bitmask = llguidance.numpy.allocate_token_bitmask(1, n_tokens)
        width = self.bitmask.shape[1] * 32
        self.bias = torch.full((max(vocab_size, width),), float("-inf"), dtype=torch.float32)
        self._bias_bytes = self.bias[:width].numpy().reshape(-1, 8)
        self._mask_bytes = self.bitmask.view(np.uint8).reshape(-1)
        self._fresh = False  # the bias matches the matcher's current state

    def mask(self, logits: torch.Tensor) -> None:
        assert logits.shape[-1] == self.vocab_size, (
            f"logits have {logits.shape[-1]} columns, the constraint was built for {self.vocab_size}"
        )
        if not self._fresh:
            llguidance.numpy.fill_next_token_bitmask(self.matcher, self.bitmask)
            if self.matcher.is_error():
                raise self._stopped()
            np.take(_BYTE_BIAS, self._mask_bytes, axis=0, out=self._bias_bytes)
            self._fresh = True
        logits.add_(self.bias[: self.vocab_size].to(logits.device))

    def advance(self, token: int) -> None:
        if not 0 <= token < self.n_tokens:
            raise ValueError(f"token {token} is not in the tokenizer's vocabulary; the grammar forbids it")
        if not self.matcher.consume_token(token):
            if self._fresh and self._mask_bytes[token >> 3] >> (token & 7) & 1:
                raise self._stopped()  # the mask allowed it: consuming it hit a limit
            reason = self.matcher.get_error().splitlines()[0]
            raise ValueError(f"token {token} is not allowed by the grammar: {reason}")
        self._fresh = False

    def done(self) -> bool:
        return self.matcher.is_stopped()

    def can_end(self) -> bool:
        """Whether the text so far is a whole sentence of the grammar (EOS may come next)."""
        return self.matcher.is_accepting()

    def _stopped(self) -> ConstraintError:
        """The matcher failed (a parser limit hit on this token): the request ends, saying why."""
        reason = self.matcher.get_error().strip().splitlines()[0]
        where = f"{self.param}: " if self.param else ""
        return ConstraintError(f"{where}the grammar stopped while decoding: {reason}", self.param)


@dataclass(frozen=True, slots=True)
class GrammarFactory:
    """A compiled grammar; implements `kvblocks.generate.params.ConstraintFactory`."""

    matcher: LLMatcher
    n_tokens: int
    vocab_size: int
    param: str | None = None  # the request field it came from, named by its decoding errors

    def start(self) -> GrammarConstraint:
        return GrammarConstraint(self.matcher.deep_copy(), self.n_tokens, self.vocab_size, self.param)


def _compile(
    tokenizer: Any, vocab_size: int, grammar: str, what: str, limits: GrammarLimits, param: str | None
) -> GrammarFactory:
    """`grammar` compiled on a bounded thread (`bounded`); `limits` also bound its decoding."""
    ll = ll_tokenizer(tokenizer)  # outside the budget: built once per tokenizer
    parser_limits = limits.parser_limits()
    matcher = bounded(lambda: LLMatcher(ll, grammar, log_level=0, limits=parser_limits), limits, what)
    if matcher.is_error():  # a panic inside llguidance comes with a backtrace: not the client's business
        raise GrammarError(f"invalid {what}: {matcher.get_error().split('<backtrace>')[0].strip()}")
    return GrammarFactory(matcher, ll.vocab_size, vocab_size, param)


def json_schema_constraint(
    tokenizer: Any,
    vocab_size: int,
    schema: dict[str, Any],
    strict: bool,
    limits: GrammarLimits = DEFAULT_LIMITS,
    param: str | None = None,
) -> GrammarFactory:
    """Output is one JSON value valid against `schema` (checked against `limits` first).

    strict: a keyword llguidance cannot enforce (`uniqueItems`, an unknown `format`) is an error;
    otherwise it is ignored and the rest of the schema is still enforced.
    """
    if not isinstance(schema, dict):
        raise GrammarError(f"invalid JSON schema: expected an object, got {type(schema).__name__}")
    check_schema(schema, limits)
    try:
        options: JsonCompileOptions = {**JSON_OPTIONS, "lenient": not strict}
        grammar = LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except ValueError as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from exc
    return _compile(tokenizer, vocab_size, grammar, "JSON schema", limits, param)


def json_object_constraint(tokenizer: Any, vocab_size: int) -> GrammarFactory:
    """Output is one JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
    return json_schema_constraint(tokenizer, vocab_size, {"type": "object"}, strict=True)


def lark_constraint(
    tokenizer: Any,
    vocab_size: int,
    grammar: str,
    limits: GrammarLimits = DEFAULT_LIMITS,
    param: str | None = None,
) -> GrammarFactory:
    """Output is a sentence of an llguidance Lark grammar (which may embed `%json {...}`). The
    schemas it embeds are the caller's to check (`check_schema`): this text is not parsed here."""
    lark = LLMatcher.grammar_from_lark(grammar)
    return _compile(tokenizer, vocab_size, lark, "grammar", limits, param)


def json_schema_rule(schema: dict[str, Any], strict: bool) -> str:
    """The body of a Lark rule (`%json {...}`) for one JSON value valid against `schema`, with the
    whitespace and strictness `json_schema_constraint` gives it: for a grammar where that value is
    one alternative (a structured final message beside tool calls). Check the schema with
    `json_schema_constraint` first; llguidance reports a bad schema only when it compiles."""
    return "%json " + json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, "lenient": not strict}})
