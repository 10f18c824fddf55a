"""The per-token rule: every decoding path finishes, scores and reports a token the same way."""

from __future__ import annotations

import math

import pytest
import torch

from kvblocks.generate.decoding import Decoding, context_room
from kvblocks.generate.params import GenerationParams
from kvblocks.generate.text import IdTokenizer, StopTextAssembler

EOS = 2


def decoding(**fields) -> Decoding:
    params = GenerationParams(**fields)
    text = StopTextAssembler(IdTokenizer(), params.stop)
    return Decoding(
        [5, 6, 7], params, params.max_new_tokens, text, None, None, frozenset({EOS}), started=10.0
    )


def logits_for(token: int, vocab: int = 16) -> torch.Tensor:
    row = torch.zeros(vocab)
    row[token] = 5.0
    return row


def test_eos_finishes_with_stop_and_its_text_is_not_emitted():
    d = decoding(max_new_tokens=8)
    first = d.push(d.choose(logits_for(4)), logits_for(4), now=11.0)
    assert first.token_ids == [4] and d.finish is None
    last = d.push(EOS, logits_for(EOS), now=12.0)
    assert d.finish == "stop" and last.text == ""
    final = d.conclude(last, now=13.0, cached_tokens=1)
    assert final.result.token_ids == [4, EOS] and final.result.text == " 4"
    assert (final.result.ttft_s, final.result.total_s, final.result.cached_tokens) == (1.0, 3.0, 1)


def test_ignore_eos_runs_to_the_length_budget():
    d = decoding(max_new_tokens=2, ignore_eos=True)
    d.push(EOS, logits_for(EOS), now=11.0)
    assert d.finish is None
    d.push(EOS, logits_for(EOS), now=11.0)
    assert d.finish == "length"


def test_stop_text_finishes_and_min_tokens_defers_it():
    early = decoding(stop=[" 3"])
    early.push(3, logits_for(3), now=11.0)
    assert early.finish == "stop" and early.text.text == ""
    deferred = decoding(stop=[" 3"], min_tokens=1)
    deferred.push(3, logits_for(3), now=11.0)
    assert deferred.finish is None


def test_logprobs_are_those_of_the_raw_logits_one_per_token():
    d = decoding(logprobs=1)
    row = logits_for(4)
    piece = d.push(4, row, now=11.0)
    expected = torch.log_softmax(row, -1)[4].item()
    assert len(piece.logprobs) == 1 and piece.logprobs[0].logprob == pytest.approx(expected)
    assert d.logprobs == piece.logprobs


def test_a_finished_sequence_takes_no_more_tokens():
    d = decoding(max_new_tokens=1)
    d.push(4, logits_for(4), now=11.0)
    with pytest.raises(AssertionError):
        d.push(4, logits_for(4), now=11.0)


def test_the_context_cap_is_the_room_left_in_the_window():
    assert context_room(None, 10**9) == math.inf
    assert context_room(32, 30) == 2 and context_room(32, 32) == 0
