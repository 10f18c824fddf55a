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
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import torch
from llguidance import LLMatcher

# Overrides any "x-guidance" in a user's schema: whitespace is never free-form.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# _BYTE_BIAS[b, i] = 0 if bit i of byte b is set (token allowed), else -inf.
_BYTE_BIAS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"), 0.0, -np.inf
).astype(np.float32)

_ll_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ll_lock = threading.Lock()


class GrammarError(ValueError):
    """A JSON schema or grammar that cannot be compiled; the message says why."""


def ll_tokenizer(tokenizer) -> llguidance.LLTokenizer:
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

    def __init__(self, matcher: LLMatcher, n_tokens: int, vocab_size: int) -> None:
        self.matcher = matcher
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
            np.take(_BYTE_BIAS, self._mask_bytes, axis=0, out=self._bias_bytes)
            self._fresh = True
        logits.add_(self.bias[: self.vocab_size].to(logits.device))

    def advance(self, token: int) -> None:
        if not 0 <= token < self.n_tokens:
            raise ValueError(f"token {token} is not in the tokenizer's vocabulary; the grammar forbids it")
        if not self.matcher.consume_token(token):
            reason = self.matcher.get_error().splitlines()[0]
            raise ValueError(f"token {token} is not allowed by the grammar: {reason}")
        self._fresh = False

    def done(self) -> bool:
        return self.matcher.is_stopped()


@dataclass(frozen=True, slots=True)
class GrammarFactory:
    """A compiled grammar; implements `kvblocks.generate.params.ConstraintFactory`."""

    matcher: LLMatcher
    n_tokens: int
    vocab_size: int

    def start(self) -> GrammarConstraint:
        return GrammarConstraint(self.matcher.deep_copy(), self.n_tokens, self.vocab_size)


def _compile(tokenizer, vocab_size: int, grammar: str, what: str) -> GrammarFactory:
    ll = ll_tokenizer(tokenizer)
    matcher = LLMatcher(ll, grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(f"invalid {what}: {matcher.get_error().strip()}")
    return GrammarFactory(matcher, ll.vocab_size, vocab_size)


def json_schema_constraint(tokenizer, vocab_size: int, schema: dict, strict: bool) -> GrammarFactory:
    """Output is one JSON value valid against `schema`.

    strict: a keyword llguidance cannot enforce (`uniqueItems`, an unknown `format`) is an error;
    otherwise it is ignored and the rest of the schema is still enforced.
    """
    if not isinstance(schema, dict):
        raise GrammarError(f"invalid JSON schema: expected an object, got {type(schema).__name__}")
    try:
        grammar = LLMatcher.grammar_from_json_schema(
            schema, overrides={**JSON_OPTIONS, "lenient": not strict}
        )
    except ValueError as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from exc
    return _compile(tokenizer, vocab_size, grammar, "JSON schema")


def json_object_constraint(tokenizer, vocab_size: int) -> GrammarFactory:
    """Output is one JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
    return json_schema_constraint(tokenizer, vocab_size, {"type": "object"}, strict=True)


def lark_constraint(tokenizer, vocab_size: int, grammar: str) -> GrammarFactory:
    """Output is a sentence of an llguidance Lark grammar (which may embed `%json {...}`)."""
    return _compile(tokenizer, vocab_size, LLMatcher.grammar_from_lark(grammar), "grammar")
