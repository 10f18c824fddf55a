"""The serial runner (`kvblocks.engine.serial`): a request's KV block work (fills, blend probe and
recompute) runs one forward of at most the engine's per-step budget per step, interleaved with the
other requests, and is charged to its tenant in the engine's `TenantLedger`."""

from __future__ import annotations

import threading
import time

import torch
from conftest import IdTokenizer, tiny_llama

from kvblocks import Block, CachedGenerator, GenerationParams, KVCacheTrie, Scope, StoredBlock
from kvblocks.engine.batch import BatchEngine
from kvblocks.engine.loop import Engine


class Requests:
    """What the engine emitted, in order: (tag, 'token' | 'result' | 'error') per piece."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.results: dict[str, object] = {}
        self.done = {}

    def submit(self, engine: Engine, tag: str, prompt, tenant: str, **params) -> None:
        self.done[tag] = threading.Event()

        def emit(item) -> None:
            if isinstance(item, BaseException):
                self.events.append((tag, "error"))
                self.results[tag] = item
                self.done[tag].set()
            elif item.result is not None:
                self.events.append((tag, "result"))
                self.results[tag] = item.result
                self.done[tag].set()
            else:
                self.events.append((tag, "token"))

        params = GenerationParams(max_new_tokens=3, ignore_eos=True, **params)
        engine.submit(prompt, emit, tenant=tenant, params=params)


def test_another_tenants_short_request_finishes_while_one_requests_block_work_runs():
    """Driven step by step (no engine thread): the blend request's 40 fills take a step each, so a
    request submitted after its block work began ends before that request's first token."""
    model = tiny_llama(torch.float32)
    gen = CachedGenerator(model, IdTokenizer(), KVCacheTrie.for_model(model, capacity_tokens=4096))
    engine = Engine(gen)
    engine.ledger.clock = lambda: 0.0  # no decay: the charges add up exactly
    seen = Requests()
    blocks = [Block([(7 * i + j) % 128 for j in range(3)]) for i in range(40)]
    seen.submit(engine, "blocks", [[1, 2], *blocks, [3, 4]], "attacker", kv_mode="blend")
    for _ in range(3):
        engine.step()
    assert engine.ledger.work("attacker") > 0 and not seen.events
    seen.submit(engine, "short", [5, 6, 7, 8], "victim")
    while not seen.done["short"].is_set():
        engine.step()
    assert ("blocks", "token") not in seen.events and ("blocks", "result") not in seen.events
    while not seen.done["blocks"].is_set():
        engine.step()
    b = seen.results["blocks"].blocks
    assert b.reused_tokens > 0
    # every forward of its block work was charged to its tenant: the exact start, 40 fills, the probe,
    # the recompute (all but the trailing [3, 4], which the ordinary prefill computes)
    assert engine.ledger.work("attacker") == b.block_fill_tokens + b.probe_tokens + b.recomputed_tokens - 2
    assert engine.ledger.work("victim") == 0  # the serial runner charges block work only


def test_the_engine_completes_a_step_every_2_s_while_a_request_blends_64_one_token_blocks(smollm2):
    """The real model, the batched engine as the server runs it: a blend request with 64 one-token
    blocks (each a fill of its own) beside another tenant's short request; the loop's heartbeat
    (`Engine._beat`) never stands still for 2 s, and the short request still ends."""
    torch.set_num_threads(1)
    model, tokenizer = smollm2
    gen = CachedGenerator(model, tokenizer, KVCacheTrie.for_model(model, capacity_tokens=4096))
    engine = BatchEngine(gen, max_batch_size=4, max_batch_tokens=80).start()
    try:
        seen = Requests()
        widest, stop = [0.0], threading.Event()

        def watch() -> None:
            while not stop.is_set():
                widest[0] = max(widest[0], time.monotonic() - engine._beat)
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        blocks = [Block([1000 + i]) for i in range(64)]
        seen.submit(engine, "blocks", [[1, 2, 3], *blocks, [4, 5]], "attacker", kv_mode="blend")
        seen.submit(engine, "short", [6, 7, 8, 9], "victim")
        assert seen.done["short"].wait(120) and seen.done["blocks"].wait(120)
        stop.set()
        watcher.join()
        assert seen.results["blocks"].blocks.block_fill_tokens == 64
        assert engine.health_problem() is None
        assert widest[0] < 2.0, f"the engine went {widest[0]:.2f} s without completing a step"
    finally:
        engine.stop()


def test_a_block_stored_ahead_runs_a_forward_per_step_charged_to_its_tenant_beside_another_request():
    """`store_block` requests (`POST /v1/blocks`) take the serial path: a forward of at most the step
    budget (80 tokens) per step, so another tenant's short request ends before a 400-token fill does;
    the fill is charged to its tenant, and that tenant's next request finds the block whole."""
    model = tiny_llama(torch.float32)
    gen = CachedGenerator(model, IdTokenizer(), KVCacheTrie.for_model(model, capacity_tokens=4096))
    engine = Engine(gen)
    engine.ledger.clock = lambda: 0.0
    doc = [(11 * i) % 128 for i in range(400)]
    stored = []
    engine.submit(doc, stored.append, tenant="attacker", salt=Scope("attacker", ""), store_block=True)
    engine.step()
    seen = Requests()
    seen.submit(engine, "short", [5, 6, 7, 8], "victim")
    while not seen.done["short"].is_set():
        engine.step()
    assert not stored
    while not stored:
        engine.step()
    assert stored == [StoredBlock(400, 0)]
    assert engine.ledger.work("attacker") == 400 and engine.ledger.work("victim") == 0
    other = gen.generate(
        [[1, 2], Block(doc), [3]], max_new_tokens=1, kv_mode="concat", salt=Scope("victim", "")
    )
    assert other.blocks.block_fill_tokens == 400  # stored in the attacker's block store only
    hit = gen.generate(
        [[1, 2], Block(doc), [3]], max_new_tokens=1, kv_mode="concat", salt=Scope("attacker", "")
    )
    assert hit.blocks.block_fill_tokens == 0
