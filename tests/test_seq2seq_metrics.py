"""/metrics of an encoder-decoder server over real HTTP: the encoder's work, the source records and
the decoder prefix hits move with traffic; `kvblocks stats` shows them."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from server_proc import scrape, start_server, stop_cleanly
from test_seq2seq_server import SOURCE, bart_dir

MODEL = "tiny-bart"


@pytest.fixture(scope="module")
def server():
    path = Path(tempfile.mkdtemp(prefix="kvblocks-tiny-bart-metrics-"))
    server = start_server("--model", str(bart_dir(path)), "--served-model-name", MODEL, "--capacity", "8192")
    yield server
    stop_cleanly(server)
    shutil.rmtree(path, ignore_errors=True)


def complete(http, source: str, decoder: str) -> dict:
    body = {"model": MODEL, "prompt": source, "max_tokens": 3, "temperature": 0}
    response = http.post("/v1/completions", json=body | {"decoder_prompt": decoder, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_metrics_count_encoder_runs_reuse_source_records_and_decoder_hits(server):
    with server.client() as http:
        before = scrape(http)
        complete(http, SOURCE, "Question: when does the ferry leave in winter?")
        complete(http, SOURCE, "Question: when does the ferry leave in summer?")
        complete(http, "Another source entirely, short.", "Summary:")
        after = scrape(http)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert delta["kvblocks_encoder_runs_total"] == 2  # the repeated source is encoded once
    assert delta["kvblocks_encoder_reused_sources_total"] == 1
    assert delta["kvblocks_encoder_reused_tokens_total"] > 0
    assert delta["kvblocks_encoder_computed_tokens_total"] > delta["kvblocks_encoder_reused_tokens_total"]
    assert delta["kvblocks_source_records_stored_total"] == 2
    assert after["kvblocks_source_records"] == 2
    assert after["kvblocks_source_cache_resident_tokens"] > 0
    assert after["kvblocks_source_cache_capacity_tokens"] >= after["kvblocks_source_cache_resident_tokens"]
    assert delta['kvblocks_prefix_cache_hit_tokens_total{tier="device"}'] > 1  # the decoder prefix


def test_reused_tokens_are_the_whole_source(server):
    with server.client() as http:
        before = scrape(http)
        usage = complete(http, SOURCE, "Summary:")
        after = scrape(http)
    details = usage["prompt_tokens_details"]
    reused = after["kvblocks_encoder_reused_tokens_total"] - before["kvblocks_encoder_reused_tokens_total"]
    assert reused == details["encoder_cached_tokens"] > 0
    assert after["kvblocks_encoder_runs_total"] == before["kvblocks_encoder_runs_total"]


def test_flush_leaves_no_source_record_held(server):
    with server.client() as http:
        complete(http, SOURCE, "Summary:")
        assert http.post("/flush_cache").status_code == 200
        after = scrape(http)
    assert after["kvblocks_source_records"] == 0
    assert after["kvblocks_source_cache_resident_tokens"] == 0


def test_kvblocks_stats_shows_encoder_tokens_records_and_decoder_hits(server, capsys):
    from kvblocks.cli.commands import main

    with server.client() as http:
        complete(http, SOURCE, "Summary:")
        complete(http, SOURCE, "Summary:")
    assert main(["stats", "--url", server.url]) == 0
    out = capsys.readouterr().out
    assert "source records held" in out
    assert "source tokens encoded / reused" in out
    assert "decoder prefix tokens hit" in out
