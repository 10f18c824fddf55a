"""What a chat request will cost, known before any of it is tokenised, and refused at the door.

Rendering and tokenising a prompt takes time in proportion to its rendered length, and a chat
template writes a few tokens around every message: 115,000 one-character messages are 3.9 MB of
JSON and 690,000 tokens. So every route that renders messages first asks `chat_estimate` for a
lower bound on the prompt's tokens, from counts alone, and refuses the request at once when even
that bound exceeds the context. Caps on counts (messages, content parts, Responses input items)
bound the work of requests whatever the context.

The bound comes from `TemplateCost`, measured once at start-up by rendering: each role's marginal
cost in tokens (one more empty message of that role), split into the template's special tokens,
which content can never merge with, and the rest, which content may absorb. A prompt then has
at least sum(special) + max(sum(rest), ceil(content characters / longest token)) tokens: content
and the template's plain text share tokens, but no token spells more than `max_token_bytes`
bytes. It stays a lower bound so that a prompt that fits is never refused
(tests/test_cost.py checks it against real renderings of random conversations).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jinja2 import TemplateError

from kvblocks.server.bounds import chat_chars, max_token_bytes
from kvblocks.server.errors import APIError

if TYPE_CHECKING:
    from kvblocks.server.state import Served

MAX_MESSAGES = 2048  # OpenAI's own limit on `messages`
MAX_INPUT_ITEMS = 2048  # Responses `input` items
MAX_CONTENT_PARTS = 8192  # content parts over all the messages (or input items) of a request
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(slots=True, frozen=True)
class CountCaps:
    """Counts that cost work whatever the context; more is a 400 naming the field."""

    max_messages: int = MAX_MESSAGES
    max_input_items: int = MAX_INPUT_ITEMS
    max_content_parts: int = MAX_CONTENT_PARTS

    def __post_init__(self) -> None:
        if min(self.max_messages, self.max_input_items, self.max_content_parts) < 1:
            raise ValueError(f"every count cap must be at least 1, got {self}")


@dataclass(slots=True, frozen=True)
class RoleCost:
    """Tokens one more message of a role adds at least: `special` (template tokens content cannot
    merge with) and `plain` (template text content may share tokens with)."""

    special: int = 0
    plain: int = 0


@dataclass(slots=True)
class TemplateCost:
    """The chat template's cost per message (by role) and the longest token in bytes (None: text
    length bounds nothing, as behind a normalizer)."""

    roles: dict[str, RoleCost] = field(default_factory=dict)
    token_bytes: int | None = None


@dataclass(slots=True, frozen=True)
class Estimate:
    """What a request will cost, before tokenising it: a lower bound on its prompt tokens, its
    messages and its Responses input items. Later stages charge the tenant by it."""

    prompt_tokens: int
    messages: int
    items: int = 0


def measure(tokenizer, render: Callable[[list[dict]], list[int]] | None) -> TemplateCost:
    """The template's per-message cost, by rendering messages to ids as chat requests are (`render`;
    None: no chat): for each role the least tokens one more empty message adds over the contexts
    it can follow (after its own role, after a user turn; a tool result after a call or after
    another result). A role no rendering accepts costs 0."""
    if render is None or not getattr(tokenizer, "chat_template", None):
        return TemplateCost({}, max_token_bytes(tokenizer))
    added = set(getattr(tokenizer, "added_tokens_decoder", {}))
    user = {"role": "user", "content": ""}
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            for i in range(3)
        ],
    }

    def result(i: int) -> dict:
        return {"role": "tool", "tool_call_id": f"call_{i}", "content": ""}

    contexts: dict[str, list[tuple[list[dict], dict]]] = {
        role: [
            ([{"role": role, "content": ""}], {"role": role, "content": ""}),
            ([user], {"role": role, "content": ""}),
        ]
        for role in ROLES
        if role != "tool"
    }
    contexts["tool"] = [([user, call], result(0)), ([user, call, result(0)], result(1))]
    roles = {}
    for role, cases in contexts.items():
        costs = [c for before, one in cases if (c := _marginal(render, added, before, one)) is not None]
        if costs:
            roles[role] = RoleCost(min(c.special for c in costs), min(c.plain for c in costs))
    return TemplateCost(roles, max_token_bytes(tokenizer))


def _marginal(render, added: set[int], before: list[dict], one: dict) -> RoleCost | None:
    try:
        short, long = render(before), render([*before, one])
    except (ValueError, TemplateError):  # the template refuses this order of roles: it never occurs
        return None
    special = max(0, _count(long, added) - _count(short, added))
    return RoleCost(special, max(0, len(long) - len(short) - special))


def _count(ids: Sequence[int], added: set[int]) -> int:
    return sum(i in added for i in ids)


def lower_bound(cost: TemplateCost, roles: Sequence[str], chars: int) -> int:
    """Tokens a prompt of messages with these roles and `chars` content characters has at least."""
    special = sum(cost.roles.get(r, RoleCost()).special for r in roles)
    plain = sum(cost.roles.get(r, RoleCost()).plain for r in roles)
    content = -(-chars // cost.token_bytes) if cost.token_bytes else 0
    return special + max(plain, content)


def check_counts(caps: CountCaps, messages: int, parts: int, param: str) -> None:
    """Refuse more messages or content parts than the server takes, before any other work."""
    if messages > caps.max_messages:
        raise APIError(
            400,
            f"{param} holds {messages} messages; this server takes at most {caps.max_messages} per request",
            param=param,
        )
    if parts > caps.max_content_parts:
        raise APIError(
            400,
            f"{param} holds {parts} content parts; this server takes at most {caps.max_content_parts} "
            "per request",
            param=param,
        )


def check_input_items(caps: CountCaps, items: int, parts: int) -> None:
    """A Responses `input` of more items (or content parts) than the server takes is a 400."""
    if items > caps.max_input_items:
        raise APIError(
            400,
            f"input holds {items} items; this server takes at most {caps.max_input_items} per request",
            param="input",
        )
    check_counts(caps, 0, parts, "input")


def chat_estimate(s: Served, body, param: str = "messages", items: int = 0) -> Estimate:
    """A chat request's estimate, its counts checked and its bound held against the context: what
    every route that renders messages calls before tokenising them or queueing anything.

    Content characters count as `bounds.chat_chars` counts them; offered tools add their names and
    descriptions, which every rendering of them spells out. `items`: the Responses input items the
    messages came from."""
    messages, caps, context = body.messages, s.config.caps, s.engine.max_context
    check_counts(caps, len(messages), sum(len(m.parts()) for m in messages), param)
    chars = chat_chars(messages)
    offered = getattr(body, "tools", None) if getattr(body, "tool_choice", None) != "none" else None
    chars += sum(len(t.function.name) + len(t.function.description or "") for t in offered or ())
    estimate = Estimate(lower_bound(s.template_cost, [m.role for m in messages], chars), len(messages), items)
    if context and estimate.prompt_tokens > context:
        raise APIError(
            400,
            f"{param}: {len(messages)} messages render to at least {estimate.prompt_tokens} tokens, more "
            f"than the model's context of {context} tokens",
            param=param,
            code="context_length_exceeded",
        )
    return estimate
