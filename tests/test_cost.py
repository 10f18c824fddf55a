"""The cost model at the door (`kvblocks.server.cost`): the per-message cost measured from SmolLM2's
real chat template, and the estimate a lower bound on the rendered prompt for any conversation, so
a prompt that fits is never refused."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvblocks.generate import tools
from kvblocks.generate.text import encode_prompt
from kvblocks.server.bounds import chat_chars
from kvblocks.server.cost import (
    CountCaps,
    RoleCost,
    TemplateCost,
    chat_estimate,
    check_counts,
    lower_bound,
    measure,
)
from kvblocks.server.errors import APIError
from kvblocks.server.schemas import ChatCompletionRequest, ChatMessage


@functools.cache
def smollm2():
    from transformers import AutoTokenizer

    from kvblocks import models

    tokenizer = AutoTokenizer.from_pretrained(models.default_model_dir())
    parser = tools.get_parser(tools.detect_parser(tokenizer))

    def render(messages: list[dict]) -> list[int]:
        return encode_prompt(tokenizer, tools.render_messages(tokenizer, messages, None, parser))

    return tokenizer, render, measure(tokenizer, render)


def test_smollm2_messages_cost_their_two_special_tokens_and_three_more():
    _, _, cost = smollm2()
    assert cost.token_bytes == 81
    assert cost.roles["user"] == RoleCost(special=2, plain=3)  # <|im_start|> user \n <|im_end|> \n
    assert cost.roles["system"] == RoleCost(special=2, plain=3)
    assert cost.roles["tool"].plain > 0  # a result after a result joins the same user turn as text


def test_a_tokenizer_without_a_chat_template_costs_nothing_per_message():
    tokenizer, _, _ = smollm2()
    cost = measure(tokenizer, None)
    assert cost.roles == {} and cost.token_bytes == 81
    assert lower_bound(cost, ["user"] * 1000, 810) == 10


def test_the_bound_takes_the_larger_of_the_template_text_and_the_content():
    cost = TemplateCost({"user": RoleCost(2, 3)}, token_bytes=10)
    assert lower_bound(cost, ["user"] * 4, 0) == 8 + 12
    assert lower_bound(cost, ["user"] * 4, 500) == 8 + 50
    assert lower_bound(cost, ["martian"], 0) == 0  # a role never measured costs nothing


def test_115k_one_character_messages_are_bounded_far_above_any_context():
    _, _, cost = smollm2()
    assert lower_bound(cost, ["user"] * 115_000, 115_000) == 575_000


@pytest.mark.parametrize(
    ("messages", "parts", "refused"), [(2048, 8192, None), (2049, 0, "messages"), (1, 8193, "content parts")]
)
def test_counts_beyond_the_caps_are_a_400_naming_the_field(messages, parts, refused):
    if refused is None:
        check_counts(CountCaps(), messages, parts, "messages")
        return
    with pytest.raises(APIError) as caught:
        check_counts(CountCaps(), messages, parts, "messages")
    assert caught.value.status == 400 and caught.value.param == "messages"
    assert refused in str(caught.value)


PIECES = [*"a Z0.,!?é中\n\t ", "\n\n", "  ", "<|im_end|>", "<|im_start|>", "user", "<tool_response>", "😀"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=12).map("".join)


@st.composite
def conversations(draw) -> list[dict]:
    """Random shapes: any roles in any order, tool results after the calls they answer, content
    of whitespace, special-token text, characters that merge with the template's newlines."""
    out: list[dict] = []
    for turn in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["system", "developer", "user", "assistant", "calls"]))
        if kind != "calls":
            out.append({"role": kind, "content": draw(TEXT)})
            continue
        calls = draw(st.integers(1, 3))
        out.append(
            {
                "role": "assistant",
                "content": draw(st.none() | TEXT),
                "tool_calls": [
                    {"id": f"c{turn}_{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    for i in range(calls)
                ],
            }
        )
        out += [{"role": "tool", "tool_call_id": f"c{turn}_{i}", "content": draw(TEXT)} for i in range(calls)]
    return out


def estimate_of(body: ChatCompletionRequest) -> int:
    _, _, cost = smollm2()
    served = SimpleNamespace(
        config=SimpleNamespace(caps=CountCaps()), engine=SimpleNamespace(max_context=None)
    )
    served.template_cost = cost
    return chat_estimate(served, body).prompt_tokens


TOOLS = st.lists(
    st.builds(
        lambda name, text: {"type": "function", "function": {"name": name, "description": text}},
        st.sampled_from(["f", "get_weather", "search"]),
        TEXT,
    ),
    max_size=3,
    unique_by=lambda tool: tool["function"]["name"],
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(), TOOLS, st.sampled_from([None, "auto", "none", "required"]))
def test_the_estimate_never_exceeds_the_rendered_prompt(messages, tool_defs, choice):
    tokenizer, _, _ = smollm2()
    choice = choice if tool_defs else None
    body = ChatCompletionRequest(messages=messages, tools=tool_defs or None, tool_choice=choice)
    offered = tool_defs if choice != "none" else None
    parser = tools.get_parser(tools.detect_parser(tokenizer))
    rendered = encode_prompt(tokenizer, tools.render_messages(tokenizer, messages, offered or None, parser))
    assert estimate_of(body) <= len(rendered)


@pytest.mark.parametrize("text", ["a", "", " ", "\n", "hello world. " * 40])
def test_the_estimate_of_a_long_conversation_of_one_shape_stays_below_its_rendering(text):
    _, render, cost = smollm2()
    messages = [{"role": ("user", "assistant")[i % 2], "content": text} for i in range(300)]
    parsed = [ChatMessage.model_validate(m) for m in messages]
    rendered = len(render(messages))
    bound = lower_bound(cost, [m.role for m in parsed], chat_chars(parsed))
    assert bound <= rendered
    if len(text.strip()) <= 1:
        assert bound >= 0.8 * rendered - 40  # tight where the template dominates (the attack's shape)
