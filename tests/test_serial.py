"""The serial runner (`kvblocks.engine.serial`): a request's KV block work (fills, blend probe and
recompute) runs one forward of at most the engine's per-step budget per step, interleaved with the
other requests, and is charged to its tenant in the engine's `TenantLedger`."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import torch
from conftest import IdTokenizer, tiny_llama
from server_proc import start_server, stop_cleanly, wait_idle

from kvblocks import Block, CachedGenerator, GenerationParams, KVCacheTrie, Scope, StoredBlock
from kvblocks.engine.batch import CHUNK, BatchEngine
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


# ---- the one-cut rule on the batched engine in half precision (the server's CPU default) ------------


def bf16_engine(model) -> BatchEngine:
    """The server's engine on a CPU in bf16 (batch-invariant, 16-token cuts); its ledger's clock
    stands still, so a tenant charged once stays recent and the charges add up exactly."""
    gen = CachedGenerator(model, IdTokenizer(), KVCacheTrie.for_model(model, capacity_tokens=4096))
    engine = BatchEngine(gen, max_batch_size=4, max_batch_tokens=80, invariant=True)
    engine.ledger.clock = lambda: 0.0
    return engine


class Forwards:
    """The widths of the one-request path's forwards (the packed path's forward passes no cache)."""

    def __init__(self, model) -> None:
        self.widths: list[int] = []
        model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs) -> None:
        if kwargs.get("use_cache"):
            self.widths.append(kwargs["input_ids"].shape[1])

    def during(self, step) -> list[int]:
        before = len(self.widths)
        step()
        return self.widths[before:]


ATTACK = {
    "logprobs": ([(13 * i) % 128 for i in range(150)], {"prompt_logprobs": 1}),
    "blend": (
        [[1, 2, 3] * 10, *[Block([(7 * i + j) % 128 for j in range(20)]) for i in range(6)], [4, 5] * 20],
        {"kv_mode": "blend", "blend_recompute": 0.3},
    ),
}


def attack(engine: BatchEngine) -> Requests:
    seen = Requests()
    for tag, (prompt, params) in ATTACK.items():
        seen.submit(engine, tag, prompt, "attacker", **params)
    return seen


def outputs(seen: Requests) -> dict[str, tuple]:
    """Each request's tokens and log-probabilities (prompt ones included), bit for bit."""
    out = {}
    for tag in ATTACK:
        r = seen.results[tag]
        prompt = [(lp.token, lp.logprob) for lp in r.prompt_logprobs or [] if lp is not None]
        out[tag] = (r.token_ids, prompt, [(lp.token, lp.logprob) for lp in r.logprobs or []])
    return out


def test_a_busier_tenants_prompt_work_is_one_cut_a_step_while_another_tenant_is_active_and_keeps_its_bits():
    """In bf16 the one-request path's KV stays its own, so its prompt work (prompt log-probabilities,
    block fills, the blend's probe and recompute, the plain prefill) runs in 16-token forwards. Alone,
    each of a tenant's requests takes a forward a step; while another tenant was served less, the
    tenant's requests together take one forward a step, so the other tenant's next token waits for a
    16-token forward at most. Its outputs are the bits it gets alone."""
    model = tiny_llama(torch.bfloat16)
    alone = bf16_engine(model)
    assert alone.serial.cut == CHUNK and not alone.serial.shares_kv
    forwards = Forwards(model)
    seen_alone = attack(alone)
    steps_alone = []
    while not all(seen_alone.done[tag].is_set() for tag in ATTACK):
        steps_alone.append(forwards.during(alone.step))
    assert max(max(w, default=0) for w in steps_alone) <= CHUNK
    assert max(len(w) for w in steps_alone) == 2  # alone, both requests advance every step

    engine = bf16_engine(model)
    victim = Requests()
    victim.submit(engine, "first", [9, 10, 11, 12], "victim")
    while not victim.done["first"].is_set():
        engine.step()  # the victim was served: active (recent) from here on, and served less
    seen = attack(engine)
    steps, turns = [], 0
    while not all(seen.done[tag].is_set() for tag in ATTACK):
        if turns % 7 == 3:  # the victim's next request arrives between steps
            victim.submit(engine, f"turn {turns}", [9, 10, 11, 12, turns % 100], "victim")
        widths = forwards.during(engine.step)
        steps.append(widths)
        if turns % 7 == 3:  # its first token came in the step after it arrived
            assert any(tag == f"turn {turns}" for tag, _ in victim.events)
        turns += 1
    prompt_steps = [w for w in steps if any(n > 1 for n in w)]
    assert all(len([n for n in w if n > 1]) == 1 and max(w) <= CHUNK for w in prompt_steps), steps
    assert len(steps) > len(steps_alone)  # the price: one forward a step instead of one per request
    assert outputs(seen) == outputs(seen_alone)


def test_a_tenants_prompt_work_is_one_cut_a_step_across_the_packed_and_the_one_request_path():
    """A busier tenant with a long prompt in the packed batch and prompt log-probabilities on the
    one-request path: while another tenant is active, a step holds the cut of one or the forward of
    the other, never both (each is a forward's fixed cost the other tenant's next token waits for)."""
    model = tiny_llama(torch.bfloat16)
    engine = bf16_engine(model)
    forwards = Forwards(model)
    victim = Requests()
    victim.submit(engine, "first", [9, 10, 11, 12], "victim")
    while not victim.done["first"].is_set():
        engine.step()
    seen = Requests()
    seen.submit(engine, "packed", [(5 * i) % 128 for i in range(200)], "attacker")
    seen.submit(engine, "serial", *ATTACK["logprobs"][:1], "attacker", **ATTACK["logprobs"][1])
    both = serial_steps = 0
    while not (seen.done["packed"].is_set() and seen.done["serial"].is_set()):
        widths = forwards.during(engine.step)
        prompt_forward = any(n > 1 for n in widths)
        serial_steps += prompt_forward
        both += prompt_forward and "attacker" in engine.scheduler.prompted
    assert serial_steps >= len(ATTACK["logprobs"][0]) // CHUNK and both == 0


# ---- over real HTTP: the server's default engine (bf16 on a CPU with native bf16, else float32) -------

SERVER_KEYS = {"attacker": "sk-serial-attacker", "victim": "sk-serial-victim", "ops": "sk-serial-ops"}


@pytest.fixture(scope="module")
def cut_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    keys = [{"key": k, "tenant": t, "admin": t == "ops"} for t, k in SERVER_KEYS.items()]
    path.write_text(json.dumps({"keys": keys}))
    server = start_server("--served-model-name", "m", "--api-keys", str(path))
    yield server
    stop_cleanly(server)


def test_a_long_prompt_logprobs_request_does_not_hold_another_tenants_request_and_keeps_its_bits(cut_server):
    """The real model in the dtype `kvblocks serve` runs by default here. An echo with log-probabilities
    (prompt log-probabilities: the one-request path) over a ~1,500-token prompt was one forward, which
    every other tenant's next token waited for; now it is 16-token forwards, one a step while the
    victim is active, so the victim's whole request ends long before it. Its log-probabilities are
    those it gets alone, bit for bit."""
    prompt = " ".join(f"item{i % 97} is filed under shelf {i % 13}." for i in range(150))
    attack = {"model": "m", "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1}
    ask = {
        "model": "m",
        "prompt": "Count: 1 2 3",
        "max_tokens": 4,
        "extra_body": {"ignore_eos": True},
        "stream": True,
    }

    def client(tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{cut_server.url}/v1", api_key=SERVER_KEYS[tenant], max_retries=0)

    attacker, victim = client("attacker"), client("victim")
    alone = attacker.completions.create(**attack)
    assert alone.usage.prompt_tokens > 1000
    ended: dict[str, float] = {}
    answer: dict = {}

    def send_attack() -> None:
        answer["r"] = attacker.completions.create(**attack)
        ended["attacker"] = time.monotonic()

    victim.completions.create(**{**ask, "stream": False})  # active: served within the last 2 s
    thread = threading.Thread(target=send_attack)
    thread.start()
    with httpx.Client(
        base_url=cut_server.url, headers={"Authorization": f"Bearer {SERVER_KEYS['ops']}"}
    ) as ops:
        while ops.get("/v1/cache/stats").json()["engine"]["active"] == 0:  # the attack is running
            time.sleep(0.01)
        started = time.monotonic()
        chunks = list(victim.completions.create(**ask))
        ended["victim"] = time.monotonic()
        thread.join()
        wait_idle(ops)
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert ended["victim"] < ended["attacker"], (
        f"the victim's 4 tokens took {ended['victim'] - started:.2f} s and ended after the attack"
    )
    assert answer["r"].choices[0].logprobs.token_logprobs == alone.choices[0].logprobs.token_logprobs
    assert answer["r"].choices[0].text == alone.choices[0].text
