"""Fault containment: an exception in any phase of an engine step fails only the request it concerns.

A fault is injected at one phase for one victim request (the one whose prompt carries a poison
token): the prefix lookup, admission, the packed forward, output (log-probabilities), committing
its KV to the trie, or a whole step outside any request. Every other request must finish with
exactly the tokens it gets on an engine with no fault, the engine thread must stay alive and keep
serving, and no slot or lock may leak. A failed lookup is a miss: the victim then finishes too.
"""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_batch_engine import no_leaks, run_all, workload
from tiny_models import VOCAB, tiny_model

import kvblocks.generate.decoding as decoding
from kvblocks import CachedGenerator, GenerationParams, KVCacheTrie, Scope
from kvblocks.engine.attention.probes import MIN_ROWS
from kvblocks.engine.batch import BatchEngine
from kvblocks.engine.loop import Engine, EngineError
from kvblocks.generate.params import ConstraintError
from kvblocks.generate.text import IdTokenizer

POISON = VOCAB - 1
PHASES = ("match", "admission", "forward", "logprobs", "commit", "step")


class Injected(RuntimeError):
    """The fault the test injects (never raised by kvblocks itself)."""


def prompts() -> list[list[int]]:
    return [[t if t != POISON else 0 for t in p] for p in workload(seed=3, n=5)]


def params(victim: int, logprobs: bool) -> list[GenerationParams]:
    return [
        GenerationParams(max_new_tokens=6, logprobs=1 if (logprobs and i == victim) else None)
        for i in range(5)
    ]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", torch.float32)


_reference: dict[int, list[list[int]]] = {}


def reference(model, victim: int) -> list[list[int]]:
    """Every request's tokens on a fault-free engine, the victim's prompt carrying the poison."""
    if victim not in _reference:
        ps = prompts()
        ps[victim] = ps[victim] + [POISON]
        engine = Engine(
            CachedGenerator(model, IdTokenizer(), KVCacheTrie.for_model(model, capacity_tokens=2048))
        )
        engine.start()
        try:
            _reference[victim] = [r["tokens"] for r in run_all(engine, ps, params(victim, False))]
        finally:
            engine.stop()
    return _reference[victim]


def inject(engine: BatchEngine, cache: KVCacheTrie, phase: str, monkeypatch) -> None:
    """Make `phase` raise for the request whose tokens hold POISON (for "step": once, for all)."""

    def poisoned(ids) -> bool:
        return POISON in [int(t) for t in ids]

    if phase == "match":
        real_match = cache.match
        monkeypatch.setattr(
            cache, "match", lambda ids, salt=None: _raise() if poisoned(ids) else real_match(ids, salt=salt)
        )
    elif phase == "admission":
        real_length = cache.cached_length

        def cached_length(ids, salt=None, servable=False):
            return _raise() if poisoned(ids) else real_length(ids, salt=salt, servable=servable)

        monkeypatch.setattr(cache, "cached_length", cached_length)
    elif phase == "forward":
        real_forward = engine.runner.forward
        monkeypatch.setattr(
            engine.runner,
            "forward",
            lambda segments: (
                _raise() if any(poisoned(s.token_ids) for s in segments) else real_forward(segments)
            ),
        )
    elif phase == "logprobs":  # only the victim asks for log-probabilities
        monkeypatch.setattr(decoding, "token_logprobs", lambda *a, **k: _raise())
    elif phase == "commit":
        real_adopt = cache.adopt

        def adopt(ids, slots, start, salt=None):
            return _raise() if poisoned(ids) else real_adopt(ids, slots, start, salt=salt)

        monkeypatch.setattr(cache, "adopt", adopt)
    else:
        real_schedule = engine._schedule_batch
        fired = threading.Event()

        def schedule():
            if engine._running and not fired.is_set():
                fired.set()
                raise Injected("a fault outside any one request")
            return real_schedule()

        monkeypatch.setattr(engine, "_schedule_batch", schedule)


def _raise():
    raise Injected("injected fault")


@settings(max_examples=18, deadline=None, derandomize=True)
@given(
    phase=st.sampled_from(PHASES),
    victim=st.integers(0, 4),
    batch=st.sampled_from([2, 4]),
    invariant=st.booleans(),
)
def test_a_fault_in_any_phase_fails_only_its_request(model, phase, victim, batch, invariant):
    with pytest.MonkeyPatch.context() as monkeypatch:
        cache = KVCacheTrie.for_model(model, capacity_tokens=2048)
        engine = BatchEngine(
            CachedGenerator(model, IdTokenizer(), cache),
            max_batch_size=batch,
            max_batch_tokens=batch + 64 if invariant else 24,
            invariant=invariant,
        )
        inject(engine, cache, phase, monkeypatch)
        engine.start()
        try:
            ps = prompts()
            ps[victim] = ps[victim] + [POISON]
            out = run_all(engine, ps, params(victim, phase == "logprobs"))
            expected = reference(model, victim)
            failed = [i for i, r in enumerate(out) if r["error"] is not None]
            for i, r in enumerate(out):
                if r["error"] is not None:
                    assert isinstance(r["error"], EngineError), r["error"]
                    assert "Injected" in str(r["error"])
                else:
                    assert r["tokens"] == expected[i], (phase, i)
            if phase == "match":  # a failed lookup is a miss: the victim finishes, exactly
                assert failed == [] and cache.stats()["lookup_errors"] >= 1
            elif phase != "step":
                assert failed == [victim], (phase, failed)
            # the engine still serves, and holds nothing of the failed requests
            clean = 1 if victim == 0 else 0
            after = run_all(engine, [prompts()[clean]], [GenerationParams(max_new_tokens=6)])
            assert after[0]["error"] is None and after[0]["tokens"] == expected[clean]
            assert engine.health_problem() is None
        finally:
            engine.stop()
        scratch = MIN_ROWS - 1 if invariant else 0
        no_leaks(cache, scratch)


def test_a_namespace_that_cannot_be_keyed_fails_its_request_not_the_engine(model):
    """A tenant name with a lone surrogate cannot be encoded into a key: that request fails."""
    cache = KVCacheTrie.for_model(model, capacity_tokens=2048)
    engine = BatchEngine(CachedGenerator(model, IdTokenizer(), cache), max_batch_size=4).start()
    try:
        done = threading.Event()
        errors = []

        def emit(item):
            if isinstance(item, BaseException):
                errors.append(item)
                done.set()

        engine.submit([1, 2, 3, 4], emit, params=GenerationParams(max_new_tokens=2), salt=Scope("\ud800", ""))
        assert done.wait(30)
        assert isinstance(errors[0], EngineError) and "admission" in str(errors[0])
        out = run_all(engine, [prompts()[1]], [GenerationParams(max_new_tokens=4)])
        assert out[0]["error"] is None
        assert engine.health_problem() is None
    finally:
        engine.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_is_reported_by_health_problem(model):
    engine = Engine(CachedGenerator(model, IdTokenizer(), KVCacheTrie.for_model(model, capacity_tokens=256)))

    def die():
        raise SystemExit("killed by the test")

    engine._loop = die
    engine.start()
    engine._thread.join(5)
    assert "the engine thread died" in engine.health_problem()


class GivesOut:
    """A constraint whose grammar hits a parser limit at its third token (`ConstraintError`)."""

    def __init__(self) -> None:
        self.tokens = 0

    def start(self) -> GivesOut:
        return GivesOut()

    def mask(self, logits: torch.Tensor) -> None:
        if self.tokens == 2:
            raise ConstraintError(
                "response_format: the grammar stopped while decoding: Too many items", "response_format"
            )

    def advance(self, token: int) -> None:
        self.tokens += 1

    def done(self) -> bool:
        return False


@pytest.mark.parametrize("packed", [True, False])
def test_a_constraint_that_gives_out_ends_only_its_request_without_a_traceback(model, packed, capfd):
    gen = CachedGenerator(model, IdTokenizer(), KVCacheTrie.for_model(model, capacity_tokens=2048))
    engine = (BatchEngine(gen, max_batch_size=4) if packed else Engine(gen)).start()
    try:
        out = run_all(
            engine,
            prompts()[:2],
            [GenerationParams(max_new_tokens=6, constraint=GivesOut()), GenerationParams(max_new_tokens=6)],
        )
        cause = getattr(out[0]["error"], "cause", out[0]["error"])
        assert isinstance(cause, ConstraintError) and cause.param == "response_format"
        assert len(out[0]["tokens"]) == 2
        assert out[1]["error"] is None and len(out[1]["tokens"]) == 6
        assert engine.health_problem() is None
    finally:
        engine.stop()
    assert "Traceback" not in capfd.readouterr().err
