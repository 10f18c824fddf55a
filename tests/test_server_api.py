"""Every OpenAI parameter is honoured or refused by name: the real openai SDK against a real
`kvblocks serve` on the tiny model (SmolLM2's tokenizer and template, random weights).

Where a parameter changes tokens, the server's output is checked against a `CachedGenerator` in
this process given the same options and no cache: exactness holds with penalties, logprobs and
`n` choices too.
"""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest
import torch
from server_proc import start_server, stop_cleanly, tiny_model_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvblocks import CachedGenerator
from kvblocks.generate.params import GenerationParams
from kvblocks.server.openai_routes import split_prompts

MODEL = "tiny"
SYSTEM = "You are a terse assistant for a ferry company. Timetables change in winter. " * 3


@pytest.fixture(scope="module")
def server():
    server = start_server(
        "--model", str(tiny_model_dir()), "--served-model-name", MODEL, "--capacity", "8192"
    )
    yield server
    stop_cleanly(server)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def local():
    """The same model in this process, without a cache: the reference for every output."""
    torch.set_num_threads(1)
    path = tiny_model_dir()
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return CachedGenerator(model, AutoTokenizer.from_pretrained(path), None)


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def refused(http, path: str, body: dict, param: str | None, status: int = 400) -> str:
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    return error["message"]


# ---- the one rule ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_an_unknown_argument_is_refused_the_way_openai_refuses_it(http, path):
    body = {"model": MODEL, "max_tokens": 2, "best_temperature": 0.3}
    body |= {"messages": chat("hi")} if "chat" in path else {"prompt": "hi"}
    assert (
        refused(http, path, body, "best_temperature")
        == "Unrecognized request argument supplied: best_temperature"
    )


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
        ("reasoning_effort", "high"),
        ("prediction", {"type": "content", "content": "x"}),
        ("store", True),
        ("modalities", ["text", "audio"]),
    ],
)
def test_parameters_this_server_cannot_honour_are_refused_by_name(http, param, value):
    body = {"model": MODEL, "messages": chat("hi"), "max_tokens": 2, param: value}
    assert param in refused(http, "/v1/chat/completions", body, param)


def test_accepted_defaults_of_unsupported_parameters_are_not_refused(client):
    r = client.chat.completions.create(
        model=MODEL, messages=chat("hi"), max_tokens=2, store=False, modalities=["text"], user="u-1"
    )
    assert r.choices[0].message.content is not None


ROUTER_FIELDS = {  # what sglang-router 0.3.2 and vllm-router 0.1.17 add to every request they forward
    "skip_special_tokens": True,
    "no_stop_trim": False,
    "continue_final_message": False,
    "return_hidden_states": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "include_reasoning": True,
}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_the_fields_routers_add_are_accepted_at_their_defaults_without_lenient(http, path):
    body = {"model": MODEL, "max_tokens": 2, **ROUTER_FIELDS}
    body |= {"messages": chat("hi")} if "chat" in path else {"prompt": "hi"}
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("param", "value"), [(k, not v) for k, v in ROUTER_FIELDS.items()])
def test_router_fields_asking_for_something_else_are_refused_by_name(http, param, value):
    body = {"model": MODEL, "messages": chat("hi"), "max_tokens": 2, param: value}
    assert f"'{param}' = {str(value).lower()} is not supported" in refused(
        http, "/v1/chat/completions", body, param
    )


def test_suffix_on_completions_is_refused_by_name(http):
    refused(http, "/v1/completions", {"model": MODEL, "prompt": "a", "suffix": "b"}, "suffix")


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("presence_penalty", 5.0),
        ("frequency_penalty", -2.5),
        ("top_logprobs", 21),
        ("n", 0),
        ("logit_bias", {"x": 1}),
    ],
)
def test_out_of_range_values_are_refused_with_their_param(http, param, value):
    body = {"model": MODEL, "messages": chat("hi"), "max_tokens": 2, "logprobs": True, param: value}
    refused(http, "/v1/chat/completions", body, param)


def test_an_image_part_is_refused_as_text_only(http):
    content = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
    ]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    message = refused(http, "/v1/chat/completions", body, "messages[0].content[1]")
    assert "text-only" in message


def test_type_errors_name_the_field_without_validator_internals(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": 42}]}
    message = refused(http, "/v1/chat/completions", body, "messages[0].content")
    assert "str" not in message.split(":")[0] and "list[" not in message


@pytest.mark.parametrize(
    ("content", "headers", "expected"),
    [
        (b"", {"content-type": "application/json"}, "empty"),
        (
            b"model=tiny",
            {"content-type": "application/x-www-form-urlencoded"},
            "Content-Type: application/json",
        ),
        (b"{not json", {"content-type": "application/json"}, "not valid JSON"),
        (b"[1, 2]", {"content-type": "application/json"}, "JSON object"),
    ],
)
def test_bodies_that_are_not_a_json_object_get_clear_messages(http, content, headers, expected):
    response = http.post("/v1/chat/completions", content=content, headers=headers)
    assert response.status_code == 400
    assert expected in response.json()["error"]["message"]


def test_a_model_is_retrievable_by_id_and_an_unknown_one_is_not_found(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


# ---- penalties, biases, lengths --------------------------------------------------------------


def test_logit_bias_forces_a_token(client, local):
    token = local.tokenizer.encode(" ferry", add_special_tokens=False)[0]
    r = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logit_bias={str(token): 100}
    )
    assert local.tokenizer.decode([token] * 5) == r.choices[0].text


def test_penalties_are_exact_against_the_same_penalties_without_the_cache(client, local):
    options = dict(presence_penalty=1.5, frequency_penalty=0.7, temperature=0, max_tokens=24)
    extra = {"repetition_penalty": 1.3, "ignore_eos": True}
    for question in ("When is the first ferry?", "When is the last ferry?"):  # the second hits the cache
        r = client.chat.completions.create(model=MODEL, messages=chat(question), extra_body=extra, **options)
        params = GenerationParams(
            max_new_tokens=24,
            presence_penalty=1.5,
            frequency_penalty=0.7,
            repetition_penalty=1.3,
            ignore_eos=True,
        )
        expected = local.generate(chat(question), params)
        assert r.choices[0].message.content == expected.text
    assert r.usage.prompt_tokens_details.cached_tokens > 0


def test_min_tokens_and_ignore_eos_pin_the_output_length(client):
    r = client.completions.create(
        model=MODEL,
        prompt="Count:",
        max_tokens=12,
        temperature=0.9,
        seed=4,
        extra_body={"min_tokens": 12, "ignore_eos": True},
    )
    assert r.usage.completion_tokens == 12
    assert r.choices[0].finish_reason == "length"


def test_max_tokens_null_on_completions_means_up_to_the_context(http, local):
    response = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Go", "max_tokens": None, "ignore_eos": True, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    room = local.max_context - body["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == room
    assert body["choices"][0]["finish_reason"] == "length"


# ---- logprobs --------------------------------------------------------------------------------


def test_chat_logprobs_leave_greedy_tokens_alone_and_equal_the_model_distribution(client, local):
    messages = chat("Is there a ferry on Sunday?")
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5
    )
    assert r.choices[0].message.content == plain.choices[0].message.content
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    reference = local.generate(messages, GenerationParams(max_new_tokens=8, logprobs=5)).logprobs
    for got, want in zip(entries, reference, strict=True):
        assert math.isclose(got.logprob, want.logprob, abs_tol=1e-4)
        assert len(got.top_logprobs) == 5
        assert [t.logprob for t in got.top_logprobs] == sorted(
            (t.logprob for t in got.top_logprobs), reverse=True
        )
        assert got.top_logprobs[0].logprob >= got.logprob - 1e-6


def test_completion_echo_with_logprobs_scores_the_prompt_and_explain_says_why_it_did_not_reuse(
    client, http, local
):
    prompt = "The ferry leaves at noon and returns at six."
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)  # now cached
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=3, temperature=0
    )
    lp = r.choices[0].logprobs
    n = r.usage.prompt_tokens
    assert r.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == n + 1 and lp.token_logprobs[0] is None
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    ids = local.encode(prompt)
    with torch.inference_mode():
        logits = local.model(torch.tensor([ids])).logits[0].log_softmax(-1)
    for i in range(1, n):
        assert math.isclose(lp.token_logprobs[i], float(logits[i - 1, ids[i]]), abs_tol=1e-4)
    explained = http.post("/v1/cache/explain", json={"prompt": prompt, "echo_logprobs": True}).json()
    assert explained["reason"] == "prompt_logprobs"


# ---- n, best_of, several prompts --------------------------------------------------------------


def test_n_choices_equal_separate_requests_with_consecutive_seeds(client):
    messages = chat("Name a harbour.")
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=1.0, seed=7, n=3
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, choice in enumerate(r.choices):
        alone = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=1.0, seed=7 + i
        )
        assert choice.message.content == alone.choices[0].message.content
    assert r.usage.prompt_tokens == alone.usage.prompt_tokens  # the prompt counts once


def test_n_choices_prefill_the_prompt_once(client, http):
    before = http.get("/v1/cache/stats").json()["cache"]["inserted_tokens"]
    question = "A brand new question about bicycles on board, never asked before?"
    r = client.chat.completions.create(
        model=MODEL, messages=chat(question), max_tokens=4, temperature=1, seed=1, n=4
    )
    inserted = http.get("/v1/cache/stats").json()["cache"]["inserted_tokens"] - before
    # the prompt's new tokens are stored once, plus each branch's own reply
    assert inserted <= r.usage.prompt_tokens + 4 * 4


def test_streamed_n_choices_carry_their_index_and_equal_the_non_streamed_ones(client):
    messages = chat("Name two islands.")
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=1, seed=3, n=2
    )
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=1, seed=3, n=2, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {c.index: c.message.content for c in whole.choices}


def test_best_of_returns_the_candidate_with_the_highest_total_logprob(client):
    kwargs = dict(model=MODEL, prompt="Once", max_tokens=6, temperature=1.0, seed=11)
    best = client.completions.create(best_of=3, **kwargs)
    candidates = [client.completions.create(logprobs=0, **(kwargs | {"seed": 11 + i})) for i in range(3)]
    scores = [sum(c.choices[0].logprobs.token_logprobs) for c in candidates]
    assert best.choices[0].text == candidates[scores.index(max(scores))].choices[0].text


def test_a_list_of_prompts_or_of_token_lists_gives_choices_indexed_like_openai(client, local):
    r = client.completions.create(model=MODEL, prompt=["Alpha", "Beta"], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy: both choices of one prompt agree
    ids = [local.encode("Alpha"), local.encode("Beta")]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    assert [c.text for c in by_ids.choices] == [r.choices[0].text, r.choices[2].text]


def test_streamed_completion_of_several_prompts_ends_with_usage(client):
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=["a", "b"],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},  # sampled: an early EOS would make the count short
        )
    )
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert chunks[-1].usage.completion_tokens == 6


def test_response_bodies_are_plain_json(http):
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert json.loads(response.text)["object"] == "text_completion"
    assert http.get("/health").json()["status"] == "ok"


@pytest.fixture(scope="module")
def lenient():
    server = start_server("--model", str(tiny_model_dir()), "--served-model-name", MODEL, "--lenient")
    yield server
    stop_cleanly(server)


def test_lenient_server_ignores_unknown_arguments_with_a_warning(lenient):
    response = httpx.post(
        f"{lenient.url}/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 1, "mystery": 1},
        timeout=60,
    )
    assert response.status_code == 200
    assert "ignoring unknown request argument 'mystery'" in lenient.stderr()


def test_a_list_of_one_id_list_is_one_prompt_of_ids_not_one_prompt_of_lists():
    """lm-eval sends `[[ids]]`: one prompt, given as a list of token-id lists."""
    assert split_prompts([[1, 2, 3]]) == [[1, 2, 3]]
    assert split_prompts([1, 2, 3]) == [[1, 2, 3]]
    assert split_prompts(["a"]) == ["a"] and split_prompts("a") == ["a"]
    assert split_prompts([[1], [2]]) == [[1], [2]] and split_prompts([]) == []
