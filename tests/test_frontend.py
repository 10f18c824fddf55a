"""`Frontend`: what the server sees of an engine, the batched one and the one-request path alike."""

from __future__ import annotations

import threading

import pytest
from conftest import IdTokenizer
from tiny_models import VOCAB, tiny_model

from kvblocks import CachedGenerator, GenerationParams, KVCacheTrie
from kvblocks.engine.batch import BatchEngine
from kvblocks.engine.frontend import Frontend
from kvblocks.engine.loop import Engine


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def engines(model):
    yield Engine(CachedGenerator(model, IdTokenizer(), KVCacheTrie.for_model(model, capacity_tokens=256)))
    yield BatchEngine(
        CachedGenerator(model, IdTokenizer(), KVCacheTrie.for_model(model, capacity_tokens=256)),
        max_batch_size=2,
    )


@pytest.mark.parametrize("kind", ["serial", "batched"])
def test_a_request_submitted_through_the_frontend_finishes_and_the_stats_say_so(model, kind):
    engine = dict(zip(["serial", "batched"], engines(model)))[kind].start()
    front = Frontend(engine)
    try:
        done, pieces = threading.Event(), []

        def emit(item) -> None:
            pieces.append(item)
            if isinstance(item, BaseException) or item.result is not None:
                done.set()

        front.submit([1, 2, 3, 4], emit, params=GenerationParams(max_new_tokens=3, temperature=0.0))
        assert done.wait(60)
        assert len(pieces[-1].result.token_ids) == 3
        assert front.stats() | {"cuda_graphs": None} == {
            "active": 0, "queued": 0, "cuda_graphs": None, "attention_kernel": front.stats()["attention_kernel"]
        }  # fmt: skip
        assert (front.stats()["attention_kernel"] is None) == (kind == "serial")
        assert front.health_problem() is None and front.load().running == 0
    finally:
        engine.stop()


def test_the_model_facts_come_from_the_generator_without_probing_it_per_request(model):
    serial, batched = engines(model)
    serial.generator.tokenizer.name_or_path = "ids"
    front = Frontend(serial)
    assert front.encoder_decoder is False and front.full_cache is front.cache
    assert front.vocab_size == VOCAB and front.max_context == serial.generator.max_context
    assert front.info.model_type == "llama" and front.info.tokenizer_path == "ids"
    assert front.packed_weight_bytes == 0  # one request per forward reorders no weights
    assert Frontend(batched).packed_weight_bytes == batched.packed_weight_bytes
    assert front.namespace() == serial.generator.cache.namespace
    assert front.explain([1, 2, 3]).cached_tokens == 0
