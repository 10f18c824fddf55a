"""`kvblocks generate` with an encoder-decoder model: the prompt is the source, --decoder-prompt the
reply's prefix; the output equals plain uncached generation, and a second prompt over the same
source reuses its encoder work."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from server_proc import tiny_model_dir
from test_seq2seq_server import SOURCE, bart_dir
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from kvblocks.cli.commands import main
from kvblocks.seq2seq import Seq2SeqCachedGenerator, Seq2SeqPrompt

QUESTION = "Question: when does the ferry leave in winter?"


@pytest.fixture(scope="module")
def model_dir():
    path = Path(tempfile.mkdtemp(prefix="kvblocks-tiny-bart-cli-"))
    yield bart_dir(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(model_dir):
    torch.set_num_threads(1)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    gen = Seq2SeqCachedGenerator(model, AutoTokenizer.from_pretrained(model_dir), None)
    return gen.generate(Seq2SeqPrompt(SOURCE, QUESTION), max_new_tokens=5).text


def generate(capsys, model_dir: Path, *args: str) -> tuple[list[str], list[dict]]:
    """Run `kvblocks generate`; its stdout lines (one per prompt) and its JSON summaries."""
    assert main(["generate", "--model", str(model_dir), "--max-new-tokens", "5", "--json", *args]) == 0
    out = capsys.readouterr()
    return out.out.split("\n")[:-1], [
        json.loads(line) for line in out.err.splitlines() if line.startswith("{")
    ]


def test_source_and_decoder_prompt_give_the_uncached_output(capsys, model_dir, reference):
    texts, summaries = generate(capsys, model_dir, SOURCE, "--decoder-prompt", QUESTION)
    assert texts == [reference]
    assert summaries[0]["source_tokens"] > 0 and summaries[0]["source_cached"] == 0


def test_a_second_prompt_over_the_same_source_reuses_the_encoder(capsys, model_dir, reference):
    texts, summaries = generate(capsys, model_dir, SOURCE, SOURCE, "--decoder-prompt", QUESTION)
    assert texts == [reference, reference]
    first, second = summaries
    assert second["source_cached"] == second["source_tokens"] == first["source_tokens"]
    assert second["cached_tokens"] == second["prompt_tokens"] - 1  # the whole decoder prompt but one


def test_prompt_lookup_drafting_gives_the_same_output(capsys, model_dir, reference):
    texts, _ = generate(capsys, model_dir, SOURCE, "--decoder-prompt", QUESTION, "--draft", "lookup")
    assert texts == [reference]


def test_system_message_is_refused_for_an_encoder_decoder_model(capsys, model_dir):
    assert main(["generate", "--model", str(model_dir), SOURCE, "--system", "Be brief."]) != 0
    assert "no chat template" in capsys.readouterr().err


def test_decoder_prompt_is_refused_for_a_decoder_only_model(capsys):
    assert main(["generate", "--model", str(tiny_model_dir()), "hi", "--decoder-prompt", "x"]) != 0
    assert "--decoder-prompt is for encoder-decoder models" in capsys.readouterr().err
