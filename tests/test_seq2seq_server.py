"""`kvblocks serve --model` with an encoder-decoder checkpoint, over real HTTP with the openai SDK:
the prompt is the source, `decoder_prompt` the decoder's prefix; usage counts encoder and decoder
reuse apart; chat and echo are refused by name."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import openai
import pytest
import torch
from server_proc import SMOLLM2_TOKENIZER_FILES, smollm2_dir, start_server, stop_cleanly
from tiny_seq2seq import BART
from transformers import AutoTokenizer

from kvblocks.seq2seq import Seq2SeqCachedGenerator, Seq2SeqPrompt

MODEL = "tiny-bart"
SOURCE = "The ferry to the northern islands leaves at nine in winter and at seven in summer. " * 12


def bart_dir(path: Path) -> Path:
    """A 2-layer random BART with SmolLM2's vocabulary and tokenizer, saved in `path`."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(
        **(BART | {"max_position_embeddings": 1024}),
        vocab_size=49152,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        forced_eos_token_id=None,
        decoder_start_token_id=1,
    )
    BartForConditionalGeneration(config).eval().save_pretrained(path)
    for name in SMOLLM2_TOKENIZER_FILES:
        shutil.copy(smollm2_dir() / name, path / name)
    return path


@pytest.fixture(scope="module")
def model_dir():
    path = Path(tempfile.mkdtemp(prefix="kvblocks-tiny-bart-"))
    yield bart_dir(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def server(model_dir):
    server = start_server("--model", str(model_dir), "--served-model-name", MODEL, "--capacity", "8192")
    yield server
    stop_cleanly(server)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def local(model_dir):
    """The same model in this process, without a cache: the reference for every output."""
    from transformers import AutoModelForSeq2SeqLM

    torch.set_num_threads(1)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    return Seq2SeqCachedGenerator(model, AutoTokenizer.from_pretrained(model_dir), None)


def complete(client, decoder: str, **options):
    return client.completions.create(
        model=MODEL,
        prompt=SOURCE,
        max_tokens=6,
        temperature=0,
        extra_body={"decoder_prompt": decoder, "ignore_eos": True},
        **options,
    )


def test_questions_over_one_source_reuse_its_encoder_work_and_decoder_prefix(client, local):
    source_tokens = len(local.encode_source(SOURCE))
    first = complete(client, "Question: when does the ferry leave in winter?")
    details = first.usage.prompt_tokens_details.model_extra
    assert (details["encoder_cached_tokens"], details["decoder_cached_tokens"]) == (0, 0)
    second = complete(client, "Question: when does the ferry leave in summer?")
    details = second.usage.prompt_tokens_details
    assert details.model_extra["encoder_cached_tokens"] == source_tokens
    assert details.model_extra["decoder_cached_tokens"] > 1  # the start token and "Question: when ..."
    assert details.cached_tokens == source_tokens + details.model_extra["decoder_cached_tokens"]
    decoder = local.decoder_ids("Question: when does the ferry leave in summer?")
    assert second.usage.prompt_tokens == source_tokens + len(decoder)
    want = local.generate(
        Seq2SeqPrompt(SOURCE, "Question: when does the ferry leave in summer?"),
        max_new_tokens=6,
        ignore_eos=True,
    )
    assert second.choices[0].text == want.text


def test_a_stream_gives_the_same_text(client):
    whole = complete(client, "Summary:").choices[0].text
    pieces = complete(client, "Summary:", stream=True)
    assert "".join(c.choices[0].text for c in pieces if c.choices) == whole


def test_stats_report_encoder_work_and_source_records(server):
    with server.client() as http:
        stats = http.get("/v1/cache/stats").json()["cache"]
    assert stats["encoder_runs"] == 1 and stats["encoder_reused"] >= 1
    assert stats["source_resident_tokens"] > 0 and stats["resident_tokens"] > 0


def test_chat_and_echo_are_refused_by_name(client):
    with pytest.raises(openai.BadRequestError, match="encoder-decoder"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="echo"):
        complete(client, "Summary:", echo=True)


def test_explain_tells_whether_the_source_is_held_and_how_much_decoder_prefix(server):
    with server.client() as http:
        body = {"prompt": SOURCE, "decoder_prompt": "Question: when does the ferry leave in winter?"}
        held = http.post("/v1/cache/explain", json=body).json()
        other = http.post("/v1/cache/explain", json=body | {"prompt": "Another source entirely."}).json()
    assert held["source"]["cached"] and not held["source"]["encoder_would_run"]
    assert held["cached_tokens"] > 1
    assert not other["source"]["cached"] and other["cached_tokens"] == 0


def test_kvblocks_stats_and_explain_show_the_source(server, capsys):
    from kvblocks.cli.commands import main

    assert main(["stats", "--url", server.url]) == 0
    out = capsys.readouterr().out
    assert "source records" in out and "encoder runs / sources reused" in out
    assert main(["explain", SOURCE, "--decoder-prompt", "Summary:", "--url", server.url]) == 0
    assert "held: the encoder does not run" in capsys.readouterr().out


def test_flush_cache_empties_the_source_records_too(server, client):
    complete(client, "Summary:")
    with server.client() as http:
        assert http.post("/flush_cache").status_code == 200
        stats = http.get("/v1/cache/stats").json()["cache"]
    assert stats["source_resident_tokens"] == 0 and stats["resident_tokens"] == 0
