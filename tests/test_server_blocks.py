"""KV blocks over real HTTP with the `openai` client: `kvblocks_block` chat parts and completions'
`prompt_blocks`, `kv_mode`/`blend_recompute` per request and as the server default, the usage
fields, /metrics, and the refusals by name."""

from __future__ import annotations

import openai
import pytest
import torch
from server_proc import scrape, start_server, stop_cleanly, tiny_model_dir, wait_idle

from kvblocks import CachedGenerator, KVCacheTrie
from kvblocks.errors import UserError

API_KEY = "sk-blocks"
DOCS = [
    "Supplier register, page 1. The code of Vendor Q7 is 4821. Vendor Q7 is based in Oslo.\n\n",
    "Supplier register, page 2. The code of Vendor K2 is 1934. Vendor K2 is based in Lyon.\n\n",
    "Supplier register, page 3. The code of Vendor Z5 is 7710. Vendor Z5 is based in Porto.\n\n",
]
QUESTION = "What is the code of Vendor K2?"


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model_dir(context=1024)


@pytest.fixture(scope="module")
def server(model_dir):
    server = start_server(
        "--model", str(model_dir), "--served-model-name", "m", "--capacity", "4096", "--kv-mode", "concat", "--api-key", API_KEY,
        api_key=API_KEY,
    )  # fmt: skip
    yield server
    stop_cleanly(server)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def messages(order: list[int]) -> list[dict]:
    parts = [{"type": "text", "text": DOCS[i], "kvblocks_block": True} for i in order]
    parts.append({"type": "text", "text": QUESTION})
    return [{"role": "system", "content": "Answer from the documents."}, {"role": "user", "content": parts}]


def chat(client, order: list[int], **extra):
    return client.chat.completions.create(
        model="m", messages=messages(order), max_tokens=6, temperature=0, extra_body=extra or None
    )


def details(r) -> dict:
    return r.usage.prompt_tokens_details.model_dump()


def test_blended_chat_reports_blended_and_recomputed_tokens_beside_the_exact_prefix(client, server):
    chat(client, [0, 1, 2], kv_mode="blend")  # blocks stored
    with server.client() as http:
        wait_idle(http)
        filled = scrape(http)["kvblocks_block_fill_tokens_total"]
    r = chat(client, [2, 0, 1], kv_mode="blend", blend_recompute=0.3)
    d = details(r)
    assert d["blended_tokens"] > 0 and d["recomputed_tokens"] > 0
    assert d["cached_tokens"] + d["blended_tokens"] + d["recomputed_tokens"] == r.usage.prompt_tokens
    with server.client() as http:
        wait_idle(http)
        metrics = scrape(http)
    assert metrics["kvblocks_block_fill_tokens_total"] == filled  # every block found at its new offset
    reused = sum(v for k, v in metrics.items() if k.startswith("kvblocks_block_reused_tokens_total{"))
    assert reused >= d["blended_tokens"]


def test_exact_and_full_share_blend_equal_the_library_on_the_same_segments(client, model_dir):
    from kvblocks import models

    model, tokenizer = models.load(str(model_dir))
    torch.set_num_threads(1)
    exact = chat(client, [1, 2], kv_mode="exact")
    full = chat(client, [1, 2], kv_mode="blend", blend_recompute=1.0)
    assert "blended_tokens" not in details(exact)
    assert exact.choices[0].message.content == full.choices[0].message.content
    assert details(full)["blended_tokens"] == 0
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer from the documents."}, {"role": "user", "content": "\0"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    head, tail = text.split("\0")

    def ids(t):
        return tokenizer(t, add_special_tokens=False)["input_ids"]

    prompt = [ids(head), *(ids(DOCS[i]) for i in (1, 2)), ids(QUESTION + tail)]
    gen = CachedGenerator(model, tokenizer, KVCacheTrie.for_model(model, capacity_tokens=2048))
    want = gen.generate([t for seg in prompt for t in seg], max_new_tokens=6)
    assert exact.choices[0].message.content == want.text
    assert exact.usage.prompt_tokens == want.prompt_tokens


def test_completions_prompt_blocks_take_the_server_default_kv_mode(client):
    blocks = [{"text": "Documents:\n"}, *({"text": d, "block": True} for d in DOCS), {"text": QUESTION}]
    first = client.completions.create(model="m", prompt="", max_tokens=4, temperature=0,
                                      extra_body={"prompt_blocks": blocks})  # fmt: skip
    again = client.completions.create(model="m", prompt="", max_tokens=4, temperature=0,
                                      extra_body={"prompt_blocks": [blocks[0], *blocks[3:0:-1], blocks[4]]})  # fmt: skip
    assert details(first)["blended_tokens"] > 0  # --kv-mode concat
    assert details(again)["blended_tokens"] == details(first)["blended_tokens"]
    # the batch-invariant engine keeps the one-request path's KV to itself (its kernels round
    # otherwise than the packed forwards'), so the plain start is computed again, not read back
    assert details(again)["cached_tokens"] == details(first)["cached_tokens"]
    assert details(again)["recomputed_tokens"] == details(first)["recomputed_tokens"]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"prompt": "x", "prompt_blocks": [{"text": "y"}]}, None, "not both"),
        ({"prompt_blocks": [{"text": "y", "token_ids": [1]}]}, None, "exactly one of 'text' and 'token_ids'"),
        ({"prompt": "x", "kv_mode": "smash"}, "kv_mode", "kv_mode"),
        ({"prompt": "x", "blend_recompute": 1.5}, "blend_recompute", "blend_recompute"),
    ],
)
def test_bad_block_requests_are_refused_by_name(client, body, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model="m", max_tokens=1, **{"prompt": body.pop("prompt", "")}, extra_body=body
        )
    assert message in str(e.value)
    if param is not None:
        assert e.value.body["param"] == param


def test_block_parts_with_tools_are_refused_by_name(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="kvblocks_block parts cannot be combined with tools"):
        client.chat.completions.create(model="m", messages=messages([0]), max_tokens=1, tools=[tool])


def test_a_server_default_kv_mode_the_model_cannot_honour_stops_the_start():
    from transformers import GPT2Config, GPT2LMHeadModel

    from kvblocks.cli.build import check_kv_mode
    from kvblocks.generate.text import IdTokenizer

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=64)).eval()
    gen = CachedGenerator(gpt2, IdTokenizer(), None)
    with pytest.raises(UserError, match="--kv-mode: model type 'gpt2' has no rotary position embedding"):
        check_kv_mode(gen, "blend", 0.15)
    check_kv_mode(gen, "exact", 0.15)
