from __future__ import annotations

import itertools
import json
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from kvblocks import models
from kvblocks.generate.grammar import lark_constraint
from kvblocks.generate.text import StopTextAssembler, encode_prompt
from kvblocks.generate.tools import (
    ClosingCalls,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolCall,
    ToolError,
    ToolStreamParser,
    detect_parser,
    get_parser,
    next_call_tokens,
    render_messages,
    template_supports_tools,
    tool_call_grammar,
    validate_tools,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "max_results": {"type": "integer"}},
            "required": ["query"],
        },
    },
}
TOOLS = [WEATHER, SEARCH]

PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
LLAMAS = ("search", {"query": "llamas", "max_results": 3})

# (text, content, [(name, arguments)]) per parser: single, several, with content, malformed.
CASES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
         None, [PARIS]),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "search", "arguments": {"query": "llamas", "max_results": 3}}\n</tool_call>',
         None, [PARIS, LLAMAS]),
        ('Let me check.\n<tool_call>{"name": "search", "arguments": {"query": "llamas", "max_results": 3}}'
         "</tool_call>\nDone.", "Let me check.\n\nDone.", [LLAMAS]),
        ('Sure <tool_call>\n{"name": "search", "arguments": {"query": "llamas", "max_results": 3}}',
         "Sure", [LLAMAS]),
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", {"a": 1})]),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', []),
        ('Hi <tool_call>{"arguments": {}}</tool_call>', 'Hi <tool_call>{"arguments": {}}</tool_call>', []),
        ("No tools needed, the answer is 4. <tool", "No tools needed, the answer is 4. <tool", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None, [PARIS]),
        ('<|python_tag|>{"name": "search", "arguments": {"query": "llamas", "max_results": 3}}', None, [LLAMAS]),
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
         '{"name": "search", "parameters": {"query": "llamas", "max_results": 3}}', None, [PARIS, LLAMAS]),
        ('Checking. <|python_tag|>{"name": "search", "parameters": {"query": "llamas", "max_results": 3}}',
         "Checking.", [LLAMAS]),
        ('{"name": "get_weather", "parameters": {"city": "Paris"', '{"name": "get_weather", "parameters": {"city": "Paris"', []),
        ('{"name": "a", "parameters": {}}; {"oops"', '{"name": "a", "parameters": {}}; {"oops"', []),
        ('{"answer": 42}', '{"answer": 42}', []),
        ("The set is {1, 2}.", "The set is {1, 2}.", []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', None, [PARIS]),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
         '{"name": "search", "arguments": {"query": "llamas", "max_results": 3}}]', None, [PARIS, LLAMAS]),
        ('Let me look. [TOOL_CALLS][{"name": "search", "arguments": {"query": "llamas", "max_results": 3}}]',
         "Let me look.", [LLAMAS]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', None, [PARIS]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
         '[TOOL_CALLS]search[ARGS]{"query": "llamas", "max_results": 3}', None, [PARIS, LLAMAS]),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {]', '[TOOL_CALLS][{"name": "get_weather", "arguments": {]', []),
        ('[TOOL_CALLS][{"name": "a", "arguments": {}}, {"arguments": {}}]',
         '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"arguments": {}}]', []),
        ("Plain answer [TOOL_CALL", "Plain answer [TOOL_CALL", []),
    ],
}  # fmt: skip
ALL_CASES = [(name, *case) for name, cases in CASES.items() for case in cases]


def _pairs(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(models.default_model_dir())


# ---- parsers -------------------------------------------------------------------------------


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL_CASES)
def test_parser_splits_content_and_calls(parser, text, content, calls):
    got_content, got_calls = get_parser(parser).parse(text)
    assert got_content == content
    assert _pairs(got_calls) == calls
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in got_calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL_CASES)
def test_streamed_in_random_pieces_equals_parse_of_the_whole(parser, text, content, calls):
    rng = random.Random(0)
    for _ in range(25):
        stream, deltas, pos = ToolStreamParser(get_parser(parser)), [], 0
        while pos < len(text):
            step = rng.randint(1, 7)
            deltas.append(stream.feed(text[pos : pos + step]))
            pos += step
        last, got_calls = stream.finish()
        assert "".join(deltas) + last == (content or "")
        assert _pairs(got_calls) == calls


def _assemble(deltas: list[dict]) -> list[dict]:
    """Client side of OpenAI's streamed tool calls: the first delta of an index opens the call."""
    calls: list[dict] = []
    for d in deltas:
        if d["index"] == len(calls):
            assert d["id"].startswith("call_") and d["type"] == "function" and d["function"]["name"]
            calls.append({"name": d["function"]["name"], "arguments": d["function"].get("arguments", "")})
        else:
            assert d["index"] == len(calls) - 1 and set(d) == {"index", "function"}
            calls[-1]["arguments"] += d["function"]["arguments"]
    return calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL_CASES)
def test_streamed_call_deltas_assemble_to_the_parsed_calls(parser, text, content, calls):
    rng = random.Random(1)
    for _ in range(25):
        stream, deltas, pos = ToolStreamParser(get_parser(parser)), [], 0
        while pos < len(text):
            step = rng.randint(1, 7)
            stream.feed(text[pos : pos + step])
            deltas += stream.call_deltas()
            pos += step
        _, got = stream.finish()
        deltas += stream.finish_deltas(got)
        assembled = _assemble(deltas)[: len(got)]
        assert [(c["name"], json.loads(c["arguments"])) for c in assembled] == calls


def test_call_arguments_stream_before_the_call_is_complete():
    stream = ToolStreamParser(HermesParser())
    stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    first = stream.call_deltas()
    assert first[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1]["function"]["arguments"] == '{"city": "Pa'
    stream.feed('ris"}}\n</tool_call>')
    assert stream.call_deltas() == [{"index": 0, "function": {"arguments": 'ris"}'}}]


def test_a_call_cut_by_max_tokens_is_no_call_and_leaves_no_markup():
    stream = ToolStreamParser(HermesParser())
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    assert stream.feed(text) == "Sure."
    assert stream.finish("length") == ("", [])
    assert HermesParser().parse_cut(text) == ("Sure.", [])
    assert HermesParser().parse_cut("The answer is 4. <tool") == ("The answer is 4.", [])


def test_stream_releases_content_before_a_marker_and_holds_a_partial_one():
    stream = ToolStreamParser(HermesParser())
    assert stream.feed("Let me check ") == "Let me check"
    assert stream.feed("the weather. <tool") == " the weather."
    assert stream.feed("_call>\n{") == ""
    assert stream.feed('"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}') == ""
    assert stream.finish()[0] == ""
    stream = ToolStreamParser(HermesParser())
    assert stream.feed("a <tool") == "a"
    assert stream.feed("box> b") == " <toolbox> b"


def test_tool_call_serialises_as_openai_wire_form():
    call = ToolCall("search", '{"query": "x"}')
    assert call.as_openai() == {
        "id": call.id,
        "type": "function",
        "function": {"name": "search", "arguments": '{"query": "x"}'},
    }
    assert ToolCall("a", "{}").id != ToolCall("a", "{}").id


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{% for m in messages %}<tool_call>{{ m.content }}</tool_call>{% endfor %}", "hermes"),
        ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
        ("{{ '<|python_tag|>' }}{% if message.role == 'ipython' %}{% endif %}", "llama3_json"),
        ("{% if m.role == 'ipython' %}<|start_header_id|>ipython<|end_header_id|>{% endif %}", "llama3_json"),
        ("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}", "hermes"),
        (None, "hermes"),
    ],
)
def test_detect_parser_follows_the_templates_marker(template, expected):
    assert detect_parser(SimpleNamespace(chat_template=template)) == expected


def test_unknown_parser_name_is_a_clear_error():
    with pytest.raises(ToolError, match="hermes, llama3_json, mistral"):
        get_parser("qwen9")


# ---- tool definitions ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ({"type": "function"}, "must be a list"),
        ([{"type": "retrieval"}], r'tools\[0\]: "type" must be "function"'),
        ([{"type": "function"}], r'tools\[0\]: "function" must be an object'),
        ([{"type": "function", "function": {"description": "x"}}], r"tools\[0\]\.function\.name"),
        ([{"type": "function", "function": {"name": "has space"}}], "letters, digits"),
        ([WEATHER, WEATHER], r"tools\[1\]: two tools are named 'get_weather'"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            '"type": "object"',
        ),
        ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], '"type": "object"'),
        (
            [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "required": "a"}},
                }
            ],
            "required must be a list",
        ),
    ],
)
def test_validate_tools_rejects_malformed_definitions(tools, message):
    with pytest.raises(ToolError, match=message):
        validate_tools(tools)


def test_validate_tools_gives_parameterless_functions_an_empty_object_schema():
    (fn,) = validate_tools([{"type": "function", "function": {"name": "now"}}])
    assert fn["parameters"] == {"type": "object", "properties": {}}


# ---- rendering -----------------------------------------------------------------------------

QUESTION = {"role": "user", "content": "What's the weather in Paris?"}
CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
        }
    ],
}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}


def _ids(tok, messages, tools=None) -> list[int]:
    return encode_prompt(tok, render_messages(tok, messages, tools))


def test_without_tools_messages_render_exactly_as_before(tok):
    messages = [{"role": "system", "content": "Be brief."}, QUESTION]
    assert render_messages(tok, messages) == messages
    assert render_messages(tok, messages, []) == messages


def test_smollm2_template_lacks_tools_so_the_builtin_hermes_preamble_is_used(tok):
    assert not template_supports_tools(tok)
    assert detect_parser(tok) == "hermes"
    rendered = render_messages(tok, [QUESTION], TOOLS)
    assert [m["role"] for m in rendered] == ["system", "user"]
    preamble = rendered[0]["content"]
    assert "<tools>" in preamble and "<tool_call>" in preamble
    assert "get_weather" in preamble and "Search the web." in preamble


def test_tools_calls_and_results_each_grow_the_prompt(tok):
    plain = [QUESTION, {"role": "assistant", "content": ""}, {"role": "user", "content": ""}]
    today = encode_prompt(tok, plain)  # what tool turns became before: empty turns
    question = _ids(tok, [QUESTION])
    with_tools = _ids(tok, [QUESTION], TOOLS)
    with_call = _ids(tok, [QUESTION, CALLED], TOOLS)
    with_result = _ids(tok, [QUESTION, CALLED, RESULT], TOOLS)
    assert len(question) < len(with_tools) < len(with_call) < len(with_result)
    assert len(with_result) - len(with_tools) > len(today) - len(question)
    text = tok.decode(with_result)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert "<|im_start|>user\n<tool_response>\n18 degrees and sunny\n</tool_response><|im_end|>" in text


def test_consecutive_tool_results_share_one_user_turn(tok):
    second = {"role": "tool", "tool_call_id": "call_2", "content": "no results"}
    rendered = render_messages(tok, [QUESTION, CALLED, RESULT, second], TOOLS)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert rendered[-1]["content"].count("<tool_response>") == 2


def test_tool_preamble_joins_an_existing_system_message(tok):
    rendered = render_messages(tok, [{"role": "system", "content": "Be brief."}, QUESTION], TOOLS)
    assert rendered[0]["content"].startswith("Be brief.\n\n# Tools")


def test_builtin_preamble_and_history_follow_the_chosen_parser(tok):
    rendered = render_messages(tok, [QUESTION, CALLED], TOOLS, parser=get_parser("llama3_json"))
    assert '{"name": <function-name>, "parameters": <arguments-json-object>}' in rendered[0]["content"]
    assert rendered[-1] == {
        "role": "assistant",
        "content": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
    }


TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_with_tool_support_renders_tools_itself():
    tok = AutoTokenizer.from_pretrained(models.default_model_dir())
    tok.chat_template = TOOL_TEMPLATE
    assert template_supports_tools(tok)
    ids = render_messages(tok, [QUESTION, CALLED, RESULT], TOOLS)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert encode_prompt(tok, ids) == ids
    text = tok.decode(ids)
    assert "Current weather in a city." in text
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in text
    assert "<|im_start|>tool\n18 degrees and sunny" in text


def test_a_template_that_drops_tool_calls_is_not_trusted_with_tools():
    tok = AutoTokenizer.from_pretrained(models.default_model_dir())
    tok.chat_template = TOOL_TEMPLATE.replace("{% for c in m.tool_calls or [] %}", "{% for c in [] %}")
    assert not template_supports_tools(tok)


# ---- constrained calls ---------------------------------------------------------------------


def test_tool_choice_auto_or_none_constrains_nothing():
    assert tool_call_grammar(TOOLS, "auto", HermesParser()) is None
    assert tool_call_grammar(TOOLS, "none", HermesParser()) is None


@pytest.mark.parametrize(
    ("choice", "message"),
    [
        ({"type": "function", "function": {"name": "send_email"}}, "'send_email', which is not in tools"),
        ("always", 'tool_choice must be "none", "auto", "required"'),
        ({"type": "function", "name": "search"}, "tool_choice must be"),
    ],
)
def test_bad_tool_choice_is_a_clear_error(choice, message):
    with pytest.raises(ToolError, match=message):
        tool_call_grammar(TOOLS, choice, HermesParser())


def test_required_without_tools_is_a_clear_error():
    with pytest.raises(ToolError, match="at least one tool"):
        tool_call_grammar([], "required", HermesParser())


def _feed(factory, tok, text):
    """Advance a fresh constraint through `text`; end with EOS unless the grammar already ended."""
    constraint = factory.start()
    for token in tok(text, add_special_tokens=False)["input_ids"]:
        constraint.advance(token)
    if not constraint.done():
        constraint.advance(tok.eos_token_id)
    assert constraint.done()


NAMED = {"type": "function", "function": {"name": "search"}}


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser(), MistralParser()])
def test_constrained_formats_accept_their_own_calls_and_parse_back(tok, parser):
    one, two = parser.render([PARIS]), parser.render([PARIS, LLAMAS])
    parallel = lark_constraint(tok, len(tok), tool_call_grammar(TOOLS, "required", parser))
    single = lark_constraint(
        tok, len(tok), tool_call_grammar(TOOLS, "required", parser, parallel_tool_calls=False)
    )
    named = lark_constraint(tok, len(tok), tool_call_grammar(TOOLS, NAMED, parser))
    _feed(parallel, tok, one)
    _feed(parallel, tok, two)
    _feed(single, tok, one)
    _feed(named, tok, parser.render([LLAMAS]))
    assert _pairs(parser.parse(two)[1]) == [PARIS, LLAMAS]
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        _feed(single, tok, two)
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        _feed(named, tok, one)


def test_constrained_arguments_follow_the_schema_and_admit_no_extra_keys(tok):
    parser = HermesParser()
    factory = lark_constraint(tok, len(tok), tool_call_grammar(TOOLS, "required", parser))
    for bad in [
        ("get_weather", {"city": "Paris", "unit": "kelvin"}),
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Paris", "unit": "celsius", "country": "FR"}),
        ("search", {"query": "x", "max_results": "three"}),
    ]:
        with pytest.raises(ValueError, match="not allowed by the grammar"):
            _feed(factory, tok, parser.render([bad]))


def test_special_token_markers_are_written_as_tokens():
    special = SimpleNamespace(added_tokens_decoder={5: SimpleNamespace(content="[TOOL_CALLS]", special=True)})
    grammar = tool_call_grammar(TOOLS, "required", MistralParser(), tokenizer=special)
    assert grammar.startswith("start: <[5]> calls")
    assert '"[TOOL_CALLS]"' in tool_call_grammar(TOOLS, "required", MistralParser())


# ---- streaming whatever the tokenization, cuts that keep complete calls ----------------------

# The markup written with the whitespace each format allows, beside the cases above.
SPACED = {
    "hermes": '<tool_call>\n{ "name" : "get_weather" ,\n  "arguments" :\n {"city": "Paris", "unit": "celsius"} }'
    '\n</tool_call>\n<tool_call>{"name":"search","arguments":{"query":"llamas","max_results":3}}</tool_call>',
    "llama3_json": '<|python_tag|> {"name" :"search","parameters":   {"query":"llamas","max_results":3}} ;  '
    '{"name": "get_weather", "parameters":{"city": "Paris", "unit": "celsius"}}',
    "mistral": '[TOOL_CALLS] [ {"name":"get_weather" , "arguments" :{"city":"Paris","unit":"celsius"}} ,'
    '{"name": "search", "arguments": {"query": "llamas", "max_results": 3}}]',
}
STREAMED = [(p, t) for p, t, _, calls in ALL_CASES if calls] + list(SPACED.items())


def _replay(parser, pieces: list[str], finish_reason: str | None = None):
    """Feed `pieces` as a server does (deltas after every piece); the parse's calls and, per call,
    the argument fragments its deltas carried."""
    stream, deltas = ToolStreamParser(parser), []
    for piece in pieces:
        stream.feed(piece)
        deltas += stream.call_deltas()
    _, calls = stream.finish(finish_reason)
    deltas += stream.finish_deltas(calls)
    fragments: dict[int, list[str]] = {}
    for d in deltas:
        fragments.setdefault(d["index"], [])
        if d["function"].get("arguments"):
            fragments[d["index"]].append(d["function"]["arguments"])
    return calls, fragments


def _check_streamed(parser_name: str, text: str, cuts: list[int]) -> None:
    """The fragments of each call join to exactly its final arguments, and a call's arguments come
    in as many fragments as pieces they were written across (one per piece, none held back)."""
    parser = get_parser(parser_name)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]) if b > a]
    calls, fragments = _replay(parser, pieces)
    whole = parser.parse(text)[1]
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole]
    bounds = [0, *itertools.accumulate(map(len, pieces))]
    at = 0
    for k, c in enumerate(calls):
        assert "".join(fragments[k]) == c.arguments
        begin = text.find(c.arguments, at)
        if begin >= 0:  # written as an object, not as a JSON string: streamed as written
            at = begin + len(c.arguments)
            across = sum(1 for a, b in itertools.pairwise(bounds) if a < at and b > begin)
            assert len(fragments[k]) == across


def _token_pieces(tok, text: str) -> list[str]:
    """`text` as the server streams it when the model writes SmolLM2's tokens of it."""
    assembler = StopTextAssembler(tok)
    pieces = [assembler.push(t) for t in tok(text, add_special_tokens=False)["input_ids"]]
    return [*pieces, assembler.flush()]


@pytest.mark.parametrize(("parser", "text"), STREAMED)
def test_streamed_arguments_join_to_the_final_arguments_split_per_character(parser, text):
    _check_streamed(parser, text, list(range(1, len(text))))


@pytest.mark.parametrize(("parser", "text"), STREAMED)
def test_streamed_arguments_join_to_the_final_arguments_split_per_smollm2_token(tok, parser, text):
    pieces = _token_pieces(tok, text)
    assert "".join(pieces) == text
    _check_streamed(parser, text, list(itertools.accumulate(map(len, pieces[:-1]))))
    calls, fragments = _replay(get_parser(parser), pieces)
    for k, c in enumerate(calls):
        if c.arguments in text and len(tok(c.arguments)["input_ids"]) > 4:
            assert len(fragments[k]) > 1, "a call longer than a few tokens streams in fragments"


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(STREAMED), data=st.data())
def test_streamed_arguments_join_to_the_final_arguments_split_anywhere(case, data):
    parser, text = case
    cuts = data.draw(st.lists(st.integers(1, len(text) - 1), max_size=40, unique=True).map(sorted))
    _check_streamed(parser, text, cuts)


def test_smollm2_writes_the_arguments_object_after_the_head_as_its_own_token(tok):
    """The tokenization that hid SmolLM2's arguments until the end: `":` then ` {"`."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    pieces = _token_pieces(tok, text)
    assert '":' in pieces and ' {"' in pieces
    calls, fragments = _replay(HermesParser(), pieces[:-4])  # before the call's end
    assert calls == [] and "".join(fragments[0]).startswith('{"city": "')


# (parser, text, where each call's text ends): two calls after some content.
TWO_CALLS = [
    ("hermes", 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
     '\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "llamas", "max_results": 3}}'
     "\n</tool_call>", "}"),
    ("llama3_json", 'Sure. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
     '{"name": "search", "parameters": {"query": "llamas", "max_results": 3}}', "}"),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
     '{"name": "search", "arguments": {"query": "llamas", "max_results": 3}}]', "}"),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
     '[TOOL_CALLS]search[ARGS]{"query": "llamas", "max_results": 3}', ""),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "closer"), TWO_CALLS)
def test_a_reply_cut_anywhere_keeps_every_complete_call_and_no_markup(parser, text, closer):
    p = get_parser(parser)
    full = p.parse(text)[1]
    ends, at = [], 0
    for c in full:
        at = text.index(c.arguments, at) + len(c.arguments) + len(closer)
        ends.append(at)
    for cut in range(len(text) + 1):
        content, calls = p.parse_cut(text[:cut])
        complete = [c for c, end in zip(full, ends) if end <= cut]
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in complete], cut
        assert content is None or "Sure.".startswith(content), (cut, content)


@pytest.mark.parametrize(("parser", "text", "closer"), TWO_CALLS)
def test_a_stream_cut_after_a_call_sends_its_whole_arguments(tok, parser, text, closer):
    p = get_parser(parser)
    first = p.parse(text)[1][0]
    cut = text.index(first.arguments) + len(first.arguments) + len(closer) + 3
    calls, fragments = _replay(p, _token_pieces(tok, text[:cut]), "length")
    assert [(c.name, c.arguments) for c in calls] == [(first.name, first.arguments)]
    assert "".join(fragments[0]) == first.arguments and len(fragments[0]) > 1


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser()])
def test_parallel_calls_close_after_the_last_call_that_leaves_room_for_no_other(tok, parser):
    factory = lark_constraint(tok, len(tok), tool_call_grammar(TOOLS, "required", parser))
    reserve = next_call_tokens(tok, parser, TOOLS)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    one = ids(parser.render([PARIS]))
    assert len(ids(parser.render([PARIS, LLAMAS]))) - len(one) >= reserve > 5
    for budget, closes in [(8, True), (len(one) + reserve - 1, True), (len(one) + reserve, False)]:
        state = ClosingCalls(factory, budget, reserve).start()
        for token in one:
            assert not state.done(), "a call is never closed halfway"
            state.advance(token)
        assert state.done() is closes, budget


@pytest.mark.parametrize("cut", [False, True])
def test_a_closing_tag_inside_a_hermes_argument_string_is_text_not_the_end_of_the_call(cut):
    parser = get_parser("hermes")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome}}</tool_call>  # 20"}}\n</tool_call>'
    content, calls = (parser.parse_cut if cut else parser.parse)(call + "\nDone.")
    assert content == "Done."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome}}</tool_call>  # 20"})
    ]
