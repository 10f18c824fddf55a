"""`POST /v1/blocks` over real HTTP (tiny model): a block stored ahead of use is found by the first
request that uses it, per tenant; the route's bounds (too long, empty, bad ids are 400s naming the
field); the usage fields count a blend's probe tokens; and `kvblocks.chat_blocks` gives the ids the
server renders."""

from __future__ import annotations

import json

import httpx
import pytest
from server_proc import scrape, start_server, stop_cleanly, tiny_model_dir, wait_idle
from transformers import AutoTokenizer

from kvblocks import Block, chat_blocks

KEYS = {"acme": "sk-acme-blocks", "globex": "sk-globex-blocks", "ops": "sk-ops-blocks"}
MAX_BLOCK_TOKENS = 64
DOCS = [
    "Supplier register, page 1. The code of Vendor Q7 is 4821. Vendor Q7 is based in Oslo.\n\n",
    "Supplier register, page 2. The code of Vendor K2 is 1934. Vendor K2 is based in Lyon.\n\n",
    "Supplier register, page 3. The code of Vendor Z5 is 7710. Vendor Z5 is based in Porto.\n\n",
    "Supplier register, page 4. The code of Vendor M8 is 5530. Vendor M8 is based in Graz.\n\n",
    "Supplier register, page 5. The code of Vendor P3 is 2268. Vendor P3 is based in Turin.\n\n",
]


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model_dir()


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    entries = [{"key": k, "tenant": t, "admin": t == "ops"} for t, k in KEYS.items()]
    path.write_text(json.dumps({"keys": entries}))
    path.chmod(0o600)
    server = start_server(
        "--model", str(model_dir), "--served-model-name", "m", "--capacity", "4096", "--api-keys", str(path),
        "--max-block-tokens", str(MAX_BLOCK_TOKENS),
    )  # fmt: skip
    yield server
    stop_cleanly(server)


def http(server, tenant: str = "acme") -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=120)


def messages(doc: str) -> list[dict]:
    parts = [{"type": "text", "text": doc, "kvblocks_block": True}, {"type": "text", "text": "Which code?"}]
    return [{"role": "system", "content": "Answer from the documents."}, {"role": "user", "content": parts}]


def chat(c: httpx.Client, doc: str, kv_mode: str = "concat", **extra) -> dict:
    body = {"model": "m", "messages": messages(doc), "max_tokens": 2, "temperature": 0, "kv_mode": kv_mode}
    r = c.post("/v1/chat/completions", json=body | extra)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def store(c: httpx.Client, **body) -> httpx.Response:
    return c.post("/v1/blocks", json=body)


def refused(response: httpx.Response, param: str, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def test_a_block_stored_ahead_is_reused_whole_by_the_first_request_that_uses_it(server):
    with http(server) as c:
        first = store(c, text=DOCS[0])
        assert first.status_code == 200, first.text
        answer = first.json()
        assert answer["tokens"] > 0 and answer["computed_tokens"] == answer["tokens"]
        assert answer["already_stored"] is False
        details = chat(c, DOCS[0])["prompt_tokens_details"]
        assert details["block_fill_tokens"] == 0 and details["blended_tokens"] == answer["tokens"]


def test_storing_a_held_block_again_says_so_and_computes_nothing(server):
    with http(server) as c:
        assert store(c, text=DOCS[1]).json()["already_stored"] is False
        wait_idle(http(server, "ops"))
        with http(server, "ops") as ops:
            filled = scrape(ops)["kvblocks_block_fill_tokens_total"]
        again = store(c, text=DOCS[1]).json()
        assert again["already_stored"] is True and again["computed_tokens"] == 0
        with http(server, "ops") as ops:
            assert scrape(ops)["kvblocks_block_fill_tokens_total"] == filled


def test_token_ids_and_text_store_the_same_block(server, model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(DOCS[2], add_special_tokens=False)["input_ids"]
    with http(server) as c:
        assert store(c, token_ids=ids).json()["already_stored"] is False
        assert store(c, text=DOCS[2]).json()["already_stored"] is True


def test_a_block_one_tenant_stored_is_invisible_to_another_and_to_another_salt(server):
    with http(server, "acme") as acme, http(server, "globex") as globex:
        tokens = store(acme, text=DOCS[3]).json()["tokens"]
        assert chat(globex, DOCS[3])["prompt_tokens_details"]["block_fill_tokens"] == tokens
        assert store(globex, text=DOCS[4], cache_salt="team-a").json()["already_stored"] is False
        assert store(globex, text=DOCS[4]).json()["already_stored"] is False
        assert store(acme, text=DOCS[4], cache_salt="team-a").json()["already_stored"] is False


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"text": "word " * (MAX_BLOCK_TOKENS + 1)}, "text", ("--max-block-tokens", str(MAX_BLOCK_TOKENS))),
        ({"token_ids": list(range(1000, 1001 + MAX_BLOCK_TOKENS))}, "token_ids", ("--max-block-tokens",)),
        ({"text": "x" * 300_000}, "text", ("characters",)),
        ({"text": ""}, "text", ("empty",)),
        ({"token_ids": []}, "token_ids", ()),
        ({"token_ids": [-1]}, "token_ids[0]", ()),
        ({"token_ids": [10**9]}, "token_ids", ("vocabulary",)),
        ({"token_ids": ["1"]}, "token_ids[0]", ()),
        ({"text": 5}, "text", ()),
    ],
)
def test_bad_blocks_are_a_400_naming_the_field_and_the_server_lives(server, body, param, words):
    with http(server) as c:
        refused(store(c, **body), param, *words)
        assert c.get("/health").status_code == 200


def test_text_and_token_ids_together_or_neither_are_a_400(server):
    with http(server) as c:
        assert store(c, text="a", token_ids=[1]).status_code == 400
        assert store(c).status_code == 400
        assert store(c, text="a", colour="red").status_code == 400


def test_an_unknown_model_is_a_404(server):
    with http(server) as c:
        assert store(c, model="other", text="a").status_code == 404


def test_usage_counts_a_blends_probe_tokens_and_not_a_concats(server):
    with http(server, "ops") as c:
        concat = chat(c, DOCS[0], "concat")["prompt_tokens_details"]
        blend = chat(c, DOCS[0], "blend", blend_recompute=0.3)["prompt_tokens_details"]
    assert concat["probe_tokens"] == 0
    assert blend["probe_tokens"] >= blend["blended_tokens"] > 0


def test_chat_blocks_gives_the_ids_the_server_renders(server, model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    segments = chat_blocks(tokenizer, messages(DOCS[0]))
    flat = [t for s in segments for t in (s.content if isinstance(s, Block) else s)]
    with http(server) as c:
        body = {"model": "m", "messages": messages(DOCS[0]), "max_tokens": 2, "kv_mode": "blend"}
        rendered = c.post("/v1/chat/completions/render", json=body)
    assert rendered.status_code == 200, rendered.text
    assert rendered.json()["token_ids"] == flat
