"""Engine: one loop owns the model, interleaves requests fairly, survives failures, frees locks."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch
from conftest import IdTokenizer, tiny_llama

from kvblocks import CachedGenerator, KVCacheTrie
from kvblocks.engine.loop import Engine
from kvblocks.generate.generator import Piece

PREFIX = list(range(3, 43))  # 40 tokens, cached before the tests that need a locked hit


@pytest.fixture(scope="module")
def model():
    return tiny_llama(torch.float32)


@pytest.fixture
def cache(model):
    return KVCacheTrie.for_model(model, capacity_tokens=4096)


@pytest.fixture
def gen(model, cache):
    return CachedGenerator(model, IdTokenizer(), cache)


@pytest.fixture
def engine(gen):
    engine = Engine(gen)
    yield engine
    engine.stop()


class Inbox:
    """Collects what the engine emits for one request, on the engine thread."""

    def __init__(self, on_piece=None) -> None:
        self.pieces: list[Piece] = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.on_piece = on_piece

    def __call__(self, item) -> None:
        if isinstance(item, BaseException):
            self.error = item
            self.done.set()
            return
        self.pieces.append(item)
        if self.on_piece is not None:
            self.on_piece(item)
        if item.result is not None:
            self.done.set()

    @property
    def result(self):
        return self.pieces[-1].result

    def wait(self, timeout: float = 30.0) -> None:
        assert self.done.wait(timeout), "the engine did not finish the request"


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_two_streams_advance_in_alternation(engine, gen):
    order: list[str] = []
    a = Inbox(lambda piece: order.append("a"))
    b = Inbox(lambda piece: order.append("b"))
    engine.submit([1, 2, 3, 4], a, max_new_tokens=6)
    engine.submit([9, 8, 7, 6, 5], b, max_new_tokens=6)
    engine.start()
    a.wait()
    b.wait()
    assert order == ["a", "b"] * 6
    assert a.result.token_ids == gen.generate([1, 2, 3, 4], max_new_tokens=6).token_ids
    assert b.result.token_ids == gen.generate([9, 8, 7, 6, 5], max_new_tokens=6).token_ids


def test_a_late_request_joins_the_rotation_without_waiting_for_the_first(engine):
    order: list[str] = []
    long = Inbox(lambda piece: order.append("long"))
    short = Inbox(lambda piece: order.append("short"))
    engine.start()
    request = engine.submit([1, 2, 3], long, max_new_tokens=400)
    wait_until(lambda: len(long.pieces) >= 3)
    engine.submit([4, 5, 6], short, max_new_tokens=3)
    short.wait()
    request.cancelled.set()
    wait_until(lambda: engine.active == 0)
    shorts = [i for i, who in enumerate(order) if who == "short"]
    assert [b - a for a, b in itertools.pairwise(shorts)] == [2, 2]  # one step of the other in between


def test_cancelling_a_stream_releases_its_locks_and_commits_its_tokens(engine, gen, cache):
    gen.generate(PREFIX, max_new_tokens=1)
    locked_during: list[int] = []
    holder: dict = {}

    def on_piece(piece: Piece) -> None:
        locked_during.append(cache.stats()["locked_tokens"])
        if len(locked_during) == 3:
            holder["request"].cancelled.set()

    inbox = Inbox(on_piece)
    prompt = [*PREFIX, 50, 51]
    holder["request"] = engine.submit(prompt, inbox, max_new_tokens=400)
    engine.start()
    wait_until(lambda: engine.active == 0 and engine.queued == 0)
    assert locked_during[0] >= len(PREFIX)
    assert cache.stats()["locked_tokens"] == 0
    assert engine.metrics.counters["kvblocks_requests_cancelled_total"] == 1
    assert not inbox.done.is_set()
    generated = [t for piece in inbox.pieces for t in piece.token_ids]
    assert cache.cached_length([*prompt, *generated]) >= len(prompt) + len(generated) - 1


def test_a_request_cancelled_while_queued_never_runs(engine, cache):
    inbox = Inbox()
    request = engine.submit([1, 2, 3], inbox, max_new_tokens=4)
    request.cancelled.set()
    after = Inbox()
    engine.submit([4, 5, 6], after, max_new_tokens=2)
    engine.start()
    after.wait()
    assert inbox.pieces == [] and inbox.error is None
    assert cache.cached_length([1, 2, 3]) == 0
    assert engine.metrics.counters["kvblocks_requests_cancelled_total"] == 1


def test_a_failing_request_reports_its_error_and_the_loop_keeps_serving(engine, gen, cache, monkeypatch):
    gen.generate(PREFIX, max_new_tokens=1)
    poison = 61  # a forward that sees this token fails, after the request locked its prefix
    forward = gen.runner.forward

    def failing_forward(token_ids, past, keep=1):
        if poison in token_ids:
            raise RuntimeError("injected model failure")
        return forward(token_ids, past, keep)

    monkeypatch.setattr(gen.runner, "forward", failing_forward)
    bad, good = Inbox(), Inbox()
    engine.submit([*PREFIX, poison], bad, max_new_tokens=4)
    engine.submit([7, 8, 9], good, max_new_tokens=4)
    engine.start()
    bad.wait()
    good.wait()
    assert isinstance(bad.error, RuntimeError)
    assert len(good.result.token_ids) == 4
    later = Inbox()
    engine.submit([*PREFIX, 60], later, max_new_tokens=3)
    later.wait()
    assert later.result.cached_tokens == len(PREFIX)
    assert engine.metrics.counters["kvblocks_requests_failed_total"] == 1
    assert engine.metrics.counters["kvblocks_requests_total"] == 2
    wait_until(lambda: engine.active == 0)
    assert cache.stats()["locked_tokens"] == 0


def test_stop_closes_every_active_request_and_releases_all_locks(gen, cache):
    gen.generate(PREFIX, max_new_tokens=1)
    engine = Engine(gen)
    inboxes = [Inbox() for _ in range(3)]
    for i, inbox in enumerate(inboxes):
        engine.submit([*PREFIX, 100 + i], inbox, max_new_tokens=400)
    engine.start()
    wait_until(lambda: all(len(inbox.pieces) >= 2 for inbox in inboxes))
    assert cache.stats()["locked_tokens"] >= len(PREFIX)
    engine.stop()
    assert cache.stats()["locked_tokens"] == 0


def test_metrics_record_tokens_and_latencies_of_finished_requests(engine):
    inbox = Inbox()
    engine.submit([1, 2, 3, 4, 5], inbox, max_new_tokens=5)
    engine.start()
    inbox.wait()
    m = engine.metrics
    assert m.counters["kvblocks_requests_total"] == 1
    assert m.counters["kvblocks_prompt_tokens_total"] == 5
    assert m.counters["kvblocks_generation_tokens_total"] == 5
    assert m.samples()["kvblocks_time_to_first_token_seconds_count"] == 1
    assert m.samples()["kvblocks_inter_token_seconds_count"] == 4


def test_requests_arriving_together_share_a_prompt_prefilled_by_the_first(engine, cache):
    """The first request commits its prompt as soon as it is prefilled, so the ones queued with it
    hit the shared system prompt instead of each prefilling it again."""
    system = list(range(20, 100))
    inboxes = [Inbox() for _ in range(4)]
    for i, inbox in enumerate(inboxes):
        engine.submit([*system, 100 + i], inbox, max_new_tokens=6)
    engine.start()
    for inbox in inboxes:
        inbox.wait()
    cached = [inbox.result.cached_tokens for inbox in inboxes]
    assert cached[0] == 0
    assert cached[1:] == [len(system)] * 3
    wait_until(lambda: engine.active == 0)
    assert cache.stats()["locked_tokens"] == 0
