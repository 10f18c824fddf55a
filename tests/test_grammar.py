from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import DynamicCache

from kvblocks import models
from kvblocks.generate.grammar import (
    DEFAULT_LIMITS,
    GrammarError,
    GrammarLimits,
    check_schema,
    json_object_constraint,
    json_schema_constraint,
    lark_constraint,
)
from kvblocks.generate.params import ConstraintError
from kvblocks.generate.text import encode_prompt
from kvblocks.generate.tools import detect_parser, get_parser, render_messages, tool_call_grammar

try:
    import jsonschema
except ImportError:
    jsonschema = None

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city, e.g. Paris"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web and return the top results.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
                },
                "required": ["query", "max_results"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "send_email",
            "description": "Send an email.",
            "parameters": {
                "type": "object",
                "properties": {
                    "to": {"type": "string"},
                    "subject": {"type": "string"},
                    "urgent": {"type": "boolean"},
                },
                "required": ["to", "subject"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# One prompt per tool, in TOOLS order.
PROMPTS = [
    "What's the weather like in Paris today?",
    "Look up the population of Canada.",
    "Tell Bob at bob@example.com that the meeting moved to 3pm.",
]


def _check(value, schema: dict) -> None:
    """Validate `value` against the schema features used here (jsonschema when installed)."""
    if jsonschema is not None:
        jsonschema.validate(value, schema)
        return
    kinds = {
        "object": dict,
        "array": list,
        "string": str,
        "boolean": bool,
        "integer": int,
        "number": int | float,
    }
    kind = schema.get("type")
    assert kind is None or isinstance(value, kinds[kind]), (value, schema)
    assert not (kind in ("integer", "number") and isinstance(value, bool)), value
    if "enum" in schema:
        assert value in schema["enum"], value
    if "minimum" in schema:
        assert value >= schema["minimum"], value
    if "maximum" in schema:
        assert value <= schema["maximum"], value
    if kind == "object":
        assert set(schema.get("required", ())) <= set(value), value
        for key, item in value.items():
            if key in schema.get("properties", {}):
                _check(item, schema["properties"][key])
            else:
                assert schema.get("additionalProperties", True) is not False, key
    if kind == "array":
        assert len(value) >= schema.get("minItems", 0), value
        assert len(value) <= schema.get("maxItems", len(value)), value
        for item in value:
            _check(item, schema.get("items", {}))


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(1)
    return models.load()


def _prefill(model, ids: list[int]) -> tuple[DynamicCache, torch.Tensor]:
    past = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), past_key_values=past, use_cache=True).logits
    return past, logits[0, -1]


def _greedy(model, prefilled, factory, max_new_tokens: int) -> tuple[list[int], bool]:
    """Greedy decoding under a constraint: mask, argmax, advance, forward, until done()."""
    past, logits = copy.deepcopy(prefilled)
    constraint, out = factory.start(), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            constraint.mask(logits)
            token = int(logits.argmax())
            constraint.advance(token)
            out.append(token)
            if constraint.done():
                return out, True
            step = torch.tensor([[token]])
            logits = model(input_ids=step, past_key_values=past, use_cache=True).logits[0, -1]
    return out, False


@pytest.mark.parametrize("prompt", PROMPTS)
def test_constrained_tool_calls_parse_and_follow_the_schema(smollm2, prompt):
    model, tok = smollm2
    parser = get_parser(detect_parser(tok))
    ids = encode_prompt(tok, render_messages(tok, [{"role": "user", "content": prompt}], TOOLS))
    prefilled = _prefill(model, ids)
    name = TOOLS[PROMPTS.index(prompt)]["function"]["name"]
    for tool_choice in ("required", {"type": "function", "function": {"name": name}}):
        grammar = tool_call_grammar(TOOLS, tool_choice, parser, parallel_tool_calls=False)
        factory = lark_constraint(tok, model.config.vocab_size, grammar)
        out, done = _greedy(model, prefilled, factory, max_new_tokens=80)
        assert done
        content, calls = parser.parse(tok.decode(out, skip_special_tokens=True))
        assert content is None and len(calls) == 1
        assert tool_choice == "required" or calls[0].name == name
        _check(json.loads(calls[0].arguments), {**SCHEMAS[calls[0].name], "additionalProperties": False})


def test_json_schema_output_parses_and_validates(smollm2):
    model, tok = smollm2
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        },
        "required": ["name", "age", "hobbies"],
        "additionalProperties": False,
    }
    factory = json_schema_constraint(tok, model.config.vocab_size, schema, strict=True)
    ids = encode_prompt(tok, [{"role": "user", "content": "Describe a fictional person as JSON."}])
    out, done = _greedy(model, _prefill(model, ids), factory, max_new_tokens=96)
    assert done
    _check(json.loads(tok.decode(out, skip_special_tokens=True)), schema)


def test_json_object_mode_gives_a_json_object(smollm2):
    model, tok = smollm2
    factory = json_object_constraint(tok, model.config.vocab_size)
    ids = encode_prompt(tok, [{"role": "user", "content": "List two colors as a JSON object."}])
    out, done = _greedy(model, _prefill(model, ids), factory, max_new_tokens=64)
    assert done
    assert isinstance(json.loads(tok.decode(out, skip_special_tokens=True)), dict)


# ---- the constraint itself, without the model ----------------------------------------------


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2[1]


def _token(tok, text: str) -> int:
    (token,) = tok(text, add_special_tokens=False)["input_ids"]
    return token


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "objekt"}, "invalid JSON schema: Invalid type: objekt"),
        ({"type": "integer", "minimum": 5, "maximum": 2}, "Unsatisfiable schema"),
        ({"$ref": "#/$defs/missing"}, "invalid JSON schema"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        (["not", "an", "object"], "expected an object"),
    ],
)
def test_invalid_schema_raises_grammar_error(tok, schema, message):
    with pytest.raises(GrammarError, match=message):
        json_schema_constraint(tok, len(tok), schema, strict=True)


def test_lenient_schema_ignores_what_it_cannot_enforce(tok):
    factory = json_schema_constraint(tok, len(tok), {"type": "array", "uniqueItems": True}, strict=False)
    constraint = factory.start()
    for token in tok("[1, 1]", add_special_tokens=False)["input_ids"]:
        constraint.advance(token)
    assert constraint.done()


@pytest.mark.parametrize("grammar", ["start: undefined_rule", "start: /((/", "start ::: x"])
def test_invalid_lark_grammar_raises_grammar_error(tok, grammar):
    with pytest.raises(GrammarError, match="invalid grammar"):
        lark_constraint(tok, len(tok), grammar)


def test_grammar_error_is_a_value_error():
    assert issubclass(GrammarError, ValueError)


def test_mask_forbids_ids_past_the_tokenizer_in_a_wider_vocabulary(tok):
    wide = len(tok) + 64
    constraint = json_object_constraint(tok, wide).start()
    logits = torch.zeros(1, wide)
    constraint.mask(logits)
    assert torch.isinf(logits[0, len(tok) :]).all()
    assert torch.isfinite(logits[0, _token(tok, "{")])
    assert torch.isinf(logits[0, _token(tok, "hello")])
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        constraint.advance(len(tok) + 3)


def test_mask_keeps_allowed_logits_exactly_and_works_in_float64(tok):
    constraint = json_object_constraint(tok, len(tok)).start()
    logits = torch.randn(len(tok), dtype=torch.float64)
    before = logits.clone()
    constraint.mask(logits)
    allowed = torch.isfinite(logits)
    assert 0 < int(allowed.sum()) < len(tok)
    assert torch.equal(logits[allowed], before[allowed])


def test_advance_rejects_a_forbidden_token(tok):
    constraint = json_object_constraint(tok, len(tok)).start()
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        constraint.advance(_token(tok, "hello"))


def test_json_ends_at_its_closing_brace_without_eos(tok):
    constraint = json_object_constraint(tok, len(tok)).start()
    tokens = tok('{"a": [1, 2]}', add_special_tokens=False)["input_ids"]
    for i, token in enumerate(tokens):
        assert not constraint.done(), i
        constraint.advance(token)
    assert constraint.done()


def test_eos_is_allowed_only_where_the_grammar_accepts(tok):
    constraint = lark_constraint(tok, len(tok), "start: /[0-9]+/").start()
    logits = torch.zeros(len(tok))
    constraint.mask(logits)
    assert torch.isinf(logits[tok.eos_token_id])
    constraint.advance(_token(tok, "7"))
    logits = torch.zeros(len(tok))
    constraint.mask(logits)
    assert torch.isfinite(logits[tok.eos_token_id]) and torch.isfinite(logits[_token(tok, "8")])
    assert not constraint.done()
    constraint.advance(tok.eos_token_id)
    assert constraint.done()


def test_json_whitespace_is_fixed_so_the_model_cannot_loop_on_spaces(tok):
    constraint = json_object_constraint(tok, len(tok)).start()
    constraint.advance(_token(tok, "{"))
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        constraint.advance(_token(tok, " "))


def test_each_start_is_an_independent_sequence(tok):
    factory = json_object_constraint(tok, len(tok))
    first, second = factory.start(), factory.start()
    for token in tok("{}", add_special_tokens=False)["input_ids"]:
        first.advance(token)
    assert first.done() and not second.done()
    second.advance(_token(tok, "{"))


# ---- limits on what a schema may ask of the compiler -----------------------------------------


def ref_chain(links: int, kind: str = "ref") -> dict:
    """A schema whose `$defs` form a flat chain of `links` `$ref`s (the issue 41 attack)."""
    link = {
        "ref": lambda ref: {"$ref": ref},
        "properties": lambda ref: {"type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]},
        "items": lambda ref: {"type": "array", "items": {"$ref": ref}},
        "anyOf": lambda ref: {"anyOf": [{"$ref": ref}, {"type": "null"}]},
    }[kind]
    defs = {f"d{i}": link(f"#/$defs/d{i + 1}") for i in range(links)}
    defs[f"d{links}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def depth_of(schema) -> int:
    with pytest.raises(GrammarError, match="levels deep") as refused:
        check_schema(schema, GrammarLimits(max_depth=0))
    return int(str(refused.value).split(" is ")[1].split()[0])


@pytest.mark.parametrize("links", [3000, 10000])
def test_a_long_ref_chain_is_refused_before_compiling_with_its_depth(links):
    with pytest.raises(GrammarError, match=rf"is {links + 3} levels deep .* limit of 128"):
        check_schema(ref_chain(links), GrammarLimits(max_bytes=1 << 30))


def test_depth_counts_nesting_and_ref_hops_along_the_longest_path():
    assert depth_of({"type": "string"}) == 1
    assert depth_of({"type": "object", "properties": {"a": {"type": "string"}}}) == 3
    assert depth_of(ref_chain(10)) == 13
    assert depth_of(ref_chain(10, "properties")) == 3 * 10 + 3


def test_a_recursive_schema_is_legal_and_measured_by_its_longest_non_repeating_chain(tok):
    tree = {
        "$ref": "#/$defs/node",
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
            }
        },
    }
    check_schema(tree)
    assert depth_of(tree) == 6  # root, $defs, node, properties, kids, items; back to node: cut there
    check_schema({"$ref": "#"})
    json_schema_constraint(tok, len(tok), tree, strict=True)


def test_shared_defs_are_measured_once_so_a_diamond_of_refs_is_cheap():
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 2} for i in range(60)}
    defs["d60"] = {"type": "integer"}
    check_schema({"$ref": "#/$defs/d0", "$defs": defs}, GrammarLimits(max_depth=1000))  # 2^60 paths


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"enum": list(range(DEFAULT_LIMITS.max_enum + 1))}, "an enum of the JSON schema has 2049 values"),
        ({"anyOf": [{"type": "null"}] * 257}, "'anyOf' of the JSON schema has 257 entries"),
        ({"allOf": [{"type": "object"}] * 257}, "'allOf' of the JSON schema has 257 entries"),
        (
            {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1025)}},
            "'properties' of the JSON schema has 1025 keys",
        ),
        ({"type": "string", "pattern": "a" * 4097}, "a pattern of the JSON schema has 4097 characters"),
        ({"type": "string", "description": "x" * (128 << 10)}, r"is 131\d+ bytes, over .* limit of 131072"),
        (
            {"anyOf": [{"enum": list(range(2000))} for _ in range(9)]},
            "enums hold 18000\\+ values, over this server's limit of 16384",
        ),
    ],
)
def test_a_schema_over_a_count_or_size_limit_is_refused_naming_the_limit_and_the_value(schema, message):
    with pytest.raises(GrammarError, match=message):
        check_schema(schema)


def test_real_agent_schemas_pass_the_default_limits():
    for t in TOOLS:
        check_schema(t["function"]["parameters"])
    check_schema(ref_chain(40, "properties"))  # 123 levels: deeper than any real agent's


@pytest.mark.parametrize("kind", ["ref", "properties", "items", "anyOf"])
def test_the_deepest_schema_the_default_limit_allows_compiles_on_the_compile_thread(tok, kind):
    """The default thread stack would take 3.5-7 KB a level; the compile thread's stack holds
    `max_depth` levels at 32 KB each, so the deepest allowed chain of every kind compiles."""
    links = {"ref": 125, "properties": 41, "items": 62, "anyOf": 41}[kind]
    schema = ref_chain(links, kind)
    assert depth_of(schema) <= DEFAULT_LIMITS.max_depth
    json_schema_constraint(tok, len(tok), schema, strict=True)


def test_a_compile_past_its_time_budget_is_a_grammar_error(tok):
    with pytest.raises(GrammarError, match=r"took longer than this server.s limit of 0\.1 s"):
        json_schema_constraint(tok, len(tok), slow_schema(), True, GrammarLimits(compile_timeout_s=0.1))


def slow_schema(n: int = 10) -> dict:
    """Small (7 KB) but slow to compile: allOf over n two-way anyOfs, 2^n cases (0.6 s on an idle
    core, 4 s on a loaded one, then llguidance gives up: too many symbols)."""
    closed = {
        "type": "object",
        "properties": {f"p{j}": {"type": "string"} for j in range(n)},
        "required": [f"p{j}" for j in range(n)],
    }
    other = {"type": "object", "properties": {f"q{k}": {"type": "integer"} for k in range(n)}}
    return {"allOf": [{"anyOf": [closed, other]} for _ in range(n)]}


@pytest.mark.parametrize(
    ("limits", "reason"),
    [
        (GrammarLimits(step_max_items=5), "Too many items"),
        (GrammarLimits(step_lexer_fuel=100), "too many expressions"),
        (GrammarLimits(max_lexer_states=30), "too many states"),
    ],
)
def test_a_parser_limit_hit_while_decoding_is_a_constraint_error_naming_the_field(tok, limits, reason):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    constraint = json_schema_constraint(tok, len(tok), schema, True, limits, param="response_format").start()
    with pytest.raises(
        ConstraintError, match=f"response_format: the grammar stopped while decoding: .*{reason}"
    ) as stopped:
        for token in tok.encode('{"name": "Bob", "age": 42}'):
            constraint.mask(torch.zeros(len(tok)))
            constraint.advance(token)
    assert stopped.value.param == "response_format"


def test_the_cli_defaults_are_the_grammar_limits_defaults():
    from kvblocks.cli.args import GRAMMAR_TIMEOUT_S, SCHEMA_BYTES, SCHEMA_DEPTH

    assert (
        DEFAULT_LIMITS.max_bytes,
        DEFAULT_LIMITS.max_depth,
        DEFAULT_LIMITS.compile_timeout_s,
    ) == (SCHEMA_BYTES, SCHEMA_DEPTH, GRAMMAR_TIMEOUT_S)
