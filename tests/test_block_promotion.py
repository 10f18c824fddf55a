"""KV blocks marked in `exact` requests on the batched engine: the request runs in the packed batch
with its output unchanged, and its blocks reach the block store when the engine is idle
(`kvblocks.engine.promotion`), where a later `concat` request finds them."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import IdTokenizer, tiny_llama
from test_blocks_reuse import DOC_A, DOC_B, rag

from kvblocks import CachedGenerator, GenerationParams, KVCacheTrie
from kvblocks.blocks.prefill import block_scope
from kvblocks.blocks.segments import flatten
from kvblocks.cache.namespace import Scope
from kvblocks.engine import promotion
from kvblocks.engine.batch import BatchEngine


@pytest.fixture
def engine():
    model = tiny_llama(torch.float64, num_hidden_layers=3)
    gen = CachedGenerator(model, IdTokenizer(), KVCacheTrie.for_model(model, capacity_tokens=4096))
    engine = BatchEngine(gen, max_batch_size=4, max_batch_tokens=64).start()
    yield engine
    engine.stop()


def submit(engine, prompt, **params) -> object:
    """The request's result (the engine's last piece), or its error raised."""
    done, out = threading.Event(), {}

    def emit(item):
        if isinstance(item, BaseException) or item.result is not None:
            out["item"] = item
            done.set()

    engine.submit(prompt, emit, params=GenerationParams(max_new_tokens=3, ignore_eos=True, **params))
    assert done.wait(60), "the request never finished"
    if isinstance(out["item"], BaseException):
        raise out["item"]
    return out["item"].result


def held(engine, block: list[int]) -> int:
    return engine.cache.cached_length(block, salt=block_scope(None))


def wait_until(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_an_exact_request_on_the_packed_path_promotes_its_blocks_when_the_engine_is_idle(engine):
    marked = submit(engine, rag("AB"))
    flat = submit(engine, flatten(IdTokenizer(), rag("AB"))[0])
    assert marked.token_ids == flat.token_ids and marked.blocks is None  # exact output unchanged
    assert engine.one_at_a_time == 0  # both ran in the packed batch
    assert wait_until(lambda: held(engine, DOC_A) == len(DOC_A) and held(engine, DOC_B) == len(DOC_B))
    assert engine.promotions.counts.done == 1 and not engine.promotions.pending
    later = submit(engine, rag("BA"), kv_mode="concat").blocks
    assert later.block_fill_tokens == 0 and later.reused_tokens == len(DOC_A) + len(DOC_B)


def test_promotions_beyond_the_queue_are_dropped_and_a_failed_one_is_counted(engine, monkeypatch):
    queue = promotion.BlockPromotions(engine.generator)
    spans = flatten(IdTokenizer(), rag("A"))[1]
    for _ in range(promotion.PENDING + 3):
        queue.add(spans, None)
    assert len(queue.pending) == promotion.PENDING and queue.counts.dropped == 3

    def broken(spans, salt, chunk):
        raise RuntimeError("the block store is gone")

    monkeypatch.setattr(queue.generator, "promotion", broken)
    assert queue.run_one() and queue.counts.failed == 1
    assert queue.run_one() and queue.counts.failed == 2


def test_a_promotion_runs_one_forward_of_at_most_its_chunk_per_idle_step_charged_to_its_tenant(engine):
    charged = []
    queue = promotion.BlockPromotions(engine.generator, chunk=8, charge=lambda t, n: charged.append((t, n)))
    salt = Scope("acme", "")
    queue.add(flatten(IdTokenizer(), rag("AB"))[1], salt)
    steps = 0
    while queue.run_one():
        steps += 1
    assert charged == [("acme", n) for n in (8, 8, 4, 8, 7)]  # DOC_A's 20 tokens, then DOC_B's 15
    assert steps == len(charged) + 1 and queue.counts.done == 1 and queue.current is None
    assert engine.cache.cached_length(DOC_B, salt=block_scope(salt)) == len(DOC_B)


def test_a_block_marked_prompt_of_ids_counts_its_tokens_in_the_load_routers_read():
    from kvblocks import Block
    from kvblocks.engine.loop import _known_tokens

    assert _known_tokens([[1, 2], Block([3, 4, 5]), [6]]) == 6 == _known_tokens([1, 2, 3, 4, 5, 6])
    assert _known_tokens(["text", Block([1])]) == 0  # text is tokenised later
