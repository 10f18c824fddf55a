"""Recurrent and hybrid models: prefix reuse through state snapshots is exact, family by family.

A recurrent layer's state after token t summarises every token up to t, so kvblocks serves a
prefix only where it holds a snapshot of that state (`KVCacheTrie.snapshot_points`). Each request
is checked like the attention-only suite (tests/test_exactness.py) against two references built
from plain transformers:

* one-shot (what a user compares against): the whole prompt in one forward into a fresh cache,
  then one token per step. Greedy tokens must be identical, in float32 and float64. The logits are
  only compared loosely in float64: the Mamba2-style and gated-delta layers keep their state in
  float32 even in a float64 model, so a prompt fed in two calls already differs from one call by
  up to ~1e-6 in plain transformers.
* replay, which makes the same forward calls as kvblocks: the prefill stops where the request's
  `prefill_splits` say, and a request with a hit of h tokens resumes from the attention KV of the
  earliest earlier run that computed those h tokens (the trie keeps the first KV it is given) and
  from the recurrent state of the earliest run that snapshotted position h (the trie keeps the
  first snapshot of a position). Each run keeps a copy of its live cache after every forward.
  Logits must then be bit-identical (`torch.equal`), float32 and float64: the snapshot handed back
  is bit for bit the state that was computed.
"""

from __future__ import annotations

import copy
import functools
import inspect
import subprocess
from dataclasses import dataclass, field

import pytest
import torch
from conftest import IdTokenizer
from redis_server import RedisServer
from tiny_models import HYBRID_ARCHITECTURES, HYBRID_CONFIGS, REFUSED_CONFIGS, VOCAB, random_ids, tiny_model
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from kvblocks import CachedGenerator, GenerationResult, KVCacheTrie, UnsupportedModelError
from kvblocks.adapters import hf
from kvblocks.cache.explain import explain

DTYPES = [torch.float32, torch.float64]
NEW_TOKENS = 5
EVERY = 16
STEPWISE = {"mamba", "falcon_mamba", "jamba", "zamba"}  # tokens after a snapshot go one per forward
# float64 logits against one forward of the whole prompt: olmo_hybrid keeps its RoPE, softmax and
# A_log in float32, so plain transformers differs by up to 9.5e-5 between a 40-token prompt fed as
# 32 + 8 tokens and in one forward
ONE_CALL_TOLERANCE = {"olmo_hybrid": 1e-3}


@functools.cache
def model_for(arch: str, dtype: torch.dtype):
    return tiny_model(arch, dtype)


def has_state(cache: DynamicCache) -> bool:
    return any(
        isinstance(layer, LinearAttentionCacheLayerMixin) and any(layer.has_previous_state.values())
        for layer in cache.layers
    )


@dataclass
class Run:
    sequence: list[int]  # prompt + generated tokens whose state the run computed
    copies: dict[int, DynamicCache] = field(default_factory=dict)  # live cache after each forward
    snapshots: list[int] = field(default_factory=list)


class Replay:
    """Plain-transformers runs that repeat kvblocks' forward calls (see the module doc)."""

    def __init__(self, arch: str, model) -> None:
        self.model = model
        self.stepwise = arch in STEPWISE
        self.runs: list[Run] = []

    @torch.inference_mode()
    def forward(self, cache: DynamicCache, ids: list[int]) -> torch.Tensor:
        if self.stepwise and len(ids) > 1 and has_state(cache):
            return [self.forward(cache, [t]) for t in ids][-1]
        out = self.model(
            input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1,
            **numbered(self.model, cache, len(ids)),
        )  # fmt: skip
        return out.logits[0, -1].clone()

    def run(self, ids: list[int], result: GenerationResult) -> tuple[list[int], list[torch.Tensor]]:
        hit = result.cached_tokens
        cache = self._resume(ids, hit)
        run = Run(list(ids[:hit]), snapshots=result.snapshot_positions)
        done = hit
        for end in result.prefill_splits:
            row = self.forward(cache, ids[done:end])
            done = end
            run.copies[end] = copy.deepcopy(cache)
        tokens, logits = [], []
        while True:
            logits.append(row)
            tokens.append(int(row.argmax()))
            if len(tokens) == len(result.token_ids):
                break
            row = self.forward(cache, tokens[-1:])
            done += 1
            run.copies[done] = copy.deepcopy(cache)
        run.sequence = [*ids, *tokens[:-1]]
        self.runs.append(run)
        return tokens, logits

    def _resume(self, ids: list[int], hit: int) -> DynamicCache:
        if hit == 0:
            return recording_cache(self.model)
        state = next(
            (
                r
                for r in self.runs
                if hit in r.snapshots and r.sequence[:hit] == ids[:hit] and hit in r.copies
            ),
            None,
        )
        assert state is not None, f"kvblocks hit {hit} tokens that no earlier run snapshotted"
        cache = copy.deepcopy(state.copies[hit])
        # each position's KV from the first run that computed it (a run that missed for want of a
        # snapshot recomputes tokens the trie already holds; the trie keeps the first KV)
        pieces, start = [], 0
        for r in self.runs:
            covered = next(
                (p for p, (a, b) in enumerate(zip(r.sequence[:hit], ids[:hit])) if a != b),
                min(len(r.sequence), hit),
            )
            if covered > start:
                pieces.append((r.copies[max(r.copies)], start, covered))
                start = covered
        assert start == hit
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, DynamicLayer) and layer.is_initialized:
                layer.keys = torch.cat([c.layers[i].keys[..., a:b, :] for c, a, b in pieces], dim=-2)
                layer.values = torch.cat([c.layers[i].values[..., a:b, :] for c, a, b in pieces], dim=-2)
        return cache


def recording_cache(model) -> DynamicCache:
    """A cache whose sliding-window layers keep every past token, so that a replay can splice the KV
    of several runs (lfm3, lara_mini); a sliding layer attends the same window either way."""
    cache = DynamicCache(config=model.config)
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.activate_past_recording()
    return cache


def numbered(model, cache: DynamicCache, n: int) -> dict[str, torch.Tensor]:
    """The `position_ids` of `n` tokens fed after `cache`, as transformers' `generate` passes them
    (bamba numbers a forward's tokens from 0 without them)."""
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return {}
    start = cache.get_seq_length()
    return {"position_ids": torch.arange(start, start + n)[None]}


def one_shot(model, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    cache = DynamicCache(config=model.config)
    tokens, logits = [], []
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
        while True:
            row = out.logits[0, -1]
            logits.append(row.clone())
            tokens.append(int(row.argmax()))
            if len(tokens) == n:
                return tokens, logits
            step = numbered(model, cache, 1)
            out = model(input_ids=torch.tensor([tokens[-1:]]), cache=cache, use_cache=True, **step)


class Harness:
    """One model, one trie, both references; `request` asserts exactness and returns the result."""

    def __init__(self, arch: str, dtype: torch.dtype, capacity_tokens: int = 1 << 16, **trie_options) -> None:
        self.arch = arch
        self.dtype = dtype
        self.model = model_for(arch, dtype)
        self.trie = KVCacheTrie.for_model(
            self.model, capacity_tokens=capacity_tokens, snapshot_every=EVERY, **trie_options
        )
        self.generator = CachedGenerator(self.model, IdTokenizer(), self.trie)
        self.replay = Replay(arch, self.model)

    def request(self, ids: list[int], n: int = NEW_TOKENS) -> GenerationResult:
        result = self.generator.generate(ids, max_new_tokens=n, output_logits=True, ignore_eos=True)
        assert len(result.logits) == len(result.token_ids) == n
        tokens, logits = self.replay.run(ids, result)
        assert result.token_ids == tokens
        for step, (got, want) in enumerate(zip(result.logits, logits)):
            assert torch.equal(got, want), (
                f"{self.arch}: step {step} logits differ from the replayed forward calls by "
                f"{(got - want).abs().max().item():.3e} (hit {result.cached_tokens} of {len(ids)})"
            )
        reference, ref_logits = one_shot(self.model, ids, n)
        assert result.token_ids == reference, (
            f"{self.arch}: greedy tokens differ from a run without the cache"
        )
        if self.dtype == torch.float64:
            diff = max((a - b).abs().max().item() for a, b in zip(result.logits, ref_logits))
            tolerance = ONE_CALL_TOLERANCE.get(self.arch, 1e-4)
            assert diff <= tolerance, f"{self.arch}: max logit diff {diff:.3e} against one call"
        assert self.trie.stats()["locked_tokens"] == 0
        return result


arch_and_dtype = pytest.mark.parametrize(
    ("arch", "dtype"),
    [
        pytest.param(a, d, id=f"{a}-{str(d).removeprefix('torch.')}")
        for a in HYBRID_ARCHITECTURES
        for d in DTYPES
    ],
)


@arch_and_dtype
def test_partial_hits_at_a_snapshot_and_at_the_branch_point(arch, dtype):
    h = Harness(arch, dtype)
    system = random_ids(40, seed=1)
    first = h.request([*system, *random_ids(7, seed=2)])
    assert first.cached_tokens == 0
    second = h.request([*system, *random_ids(6, seed=3)])
    # at the last periodic snapshot inside the shared prefix; a family fed one token per forward after
    # a snapshot takes none inside its first prefill
    assert second.cached_tokens == (0 if arch in STEPWISE else 32)
    assert 40 in second.snapshot_positions  # the branch point, taken while prefilling
    third = h.request([*system, *random_ids(5, seed=4)])
    assert third.cached_tokens == 40
    assert h.trie.stats()["snapshot_misses"] >= 1


@arch_and_dtype
def test_full_hit_recomputes_only_the_last_token(arch, dtype):
    h = Harness(arch, dtype)
    prompt = random_ids(30, seed=5)
    first = h.request(prompt)
    least = h.trie.min_prefill  # 2 where a one-token step differs from a prefill (zamba2, nemotron_h)
    assert {len(prompt) - least, len(prompt)} <= set(first.snapshot_positions)
    again = h.request(prompt)
    assert again.cached_tokens == len(prompt) - least
    assert again.token_ids == first.token_ids


@arch_and_dtype
def test_strict_prefix_of_a_cached_sequence_is_exact(arch, dtype):
    h = Harness(arch, dtype)
    long = random_ids(40, seed=6)
    h.request(long)
    for n in (35, 17, 16, 2, 1):
        result = h.request(long[:n])
        assert result.cached_tokens < n


@arch_and_dtype
def test_second_turn_resumes_at_the_reply_end(arch, dtype):
    h = Harness(arch, dtype)
    prompt = random_ids(20, seed=7)
    turn1 = h.request(prompt)
    history = prompt + turn1.token_ids
    turn2 = h.request(history + random_ids(4, seed=8))
    # the last generated token was never fed to the model: the state after the one before it is kept;
    # where a one-token step differs from a prefill, decoded tokens are not reused (see hf)
    assert turn2.cached_tokens == (len(history) - 1 if h.trie.min_prefill == 1 else len(prompt))


@arch_and_dtype
def test_request_after_eviction_is_exact(arch, dtype):
    model = model_for(arch, dtype)
    _, state = hf.describe(model)
    probe = KVCacheTrie.for_model(model, capacity_tokens=64)
    per_snapshot = probe.pool.slots_for(state.nbytes)
    # room for one prompt with its snapshots, not two
    h = Harness(arch, dtype, capacity_tokens=40 + 5 * per_snapshot)
    prompt = random_ids(30, seed=9, high=VOCAB // 2)
    first = h.request(prompt)
    h.request(random_ids(30, seed=10, low=VOCAB // 2))  # shares nothing: evicts what `prompt` left
    stats = h.trie.stats()
    assert stats["snapshots_evicted"] > 0
    assert stats["snapshot_slots"] == stats["snapshots"] * per_snapshot
    again = h.request(prompt)
    assert again.cached_tokens < len(prompt) - 1
    assert again.token_ids == first.token_ids


@arch_and_dtype
def test_interleaved_conversations_share_one_cache_exactly(arch, dtype):
    h = Harness(arch, dtype)
    system = random_ids(12, seed=11)
    histories = [list(system) for _ in range(3)]
    for turn in range(2):
        for c, history in enumerate(histories):
            prompt = [*history, c, *random_ids(3, seed=100 * turn + c)]
            result = h.request(prompt, n=3)
            if turn:
                assert result.cached_tokens == len(history) - (1 if h.trie.min_prefill == 1 else 3)
            history[:] = prompt + result.token_ids


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_restored_state_is_bit_identical_to_the_computed_state(arch):
    """The cache built for a hit holds exactly the live cache's KV and recurrent state."""
    model = model_for(arch, torch.float64)
    _, state = hf.describe(model)
    trie = KVCacheTrie.for_model(model, capacity_tokens=4096)
    ids = random_ids(20, seed=12)
    live = hf.empty_cache(model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), cache=live, use_cache=True)
    snap = hf.capture_state(live, state)
    trie.insert(ids, live, snapshots={len(ids): snap})
    with trie.match([*ids, 0, 0]) as hit:
        assert hit.length == len(ids)
        rebuilt = hit.to_hf_cache()
    for got, want in zip(rebuilt.layers, live.layers):
        if isinstance(want, DynamicLayer) and want.is_initialized:
            held = got.keys.shape[-2]  # a sliding-window layer is rebuilt with its window only
            assert torch.equal(got.keys, want.keys[..., -held:, :])
            assert torch.equal(got.values, want.values[..., -held:, :])
            assert got.get_seq_length() == want.get_seq_length()
        if isinstance(want, LinearAttentionCacheLayerMixin):
            for i in range(want.number_of_states):
                for name in ("conv_states", "recurrent_states"):
                    a, b = getattr(got, name)[i], getattr(want, name)[i]
                    assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
                assert got.has_previous_state[i] == want.has_previous_state[i]
    # without a snapshot there the prefix is resident but cannot be served
    with trie.match([*ids[:10], 0, 0]) as hit:
        assert hit.length == 0 and hit.matched == 10


@pytest.mark.parametrize("arch", REFUSED_CONFIGS)
def test_refused_families_are_named_with_the_measured_reason(arch):
    model = tiny_model(arch)
    with pytest.raises(UnsupportedModelError) as refused:
        KVCacheTrie.for_model(model, capacity_tokens=64)
    assert f"'{arch}' {hf.REFUSED_REASONS[arch]}" in str(refused.value)


def test_every_recurrent_family_is_supported_or_refused_with_a_reason():
    unexplained = hf.RECURRENT_MODEL_TYPES - hf.STATEFUL_MODEL_TYPES - set(hf.REFUSED_REASONS)
    assert not unexplained


def test_explain_names_the_missing_snapshot():
    h = Harness("lfm2", torch.float32)
    system = random_ids(40, seed=13)
    h.request([*system, *random_ids(7, seed=14)])
    prompt = [*system, *random_ids(6, seed=15)]
    why = explain(h.trie, IdTokenizer(), prompt)
    assert why.reason == "no_state_snapshot"
    assert why.cached_tokens == 32 and why.divergence == 40
    assert "no state snapshot at the divergence point" in why.detail


def test_snapshots_are_evicted_by_value_per_slot():
    """GDSF drops the snapshot that saves fewest tokens per slot first; a leaf's snapshot goes with it."""
    h = Harness("lfm2", torch.float32)
    h.request(random_ids(40, seed=16))
    stats = h.trie.stats()
    assert stats["snapshots"] >= 4  # 16, 32, 39, 40 and the reply's end
    per = stats["snapshot_slots"] // stats["snapshots"]
    freed = h.trie.evict(per)  # cheapest first: the one at 40 saves one token over the one at 39
    assert freed == per
    after = h.trie.stats()
    assert (
        after["snapshots"] == stats["snapshots"] - 1 and after["resident_tokens"] == stats["resident_tokens"]
    )
    prompt = h.replay.runs[0].sequence
    assert h.trie.snapshot(prompt[:40]) is None
    assert h.trie.snapshot(prompt[:39]) is not None and h.trie.snapshot(prompt[:32]) is not None


def test_snapshots_spill_to_redis_and_restore_in_another_process(tmp_path):
    """Snapshots at chunk ends are sealed records; another trie on the same Redis resumes from them
    with the same bits, and a forged record is a counted miss."""
    from kvblocks import RedisTier

    server = RedisServer(tmp_path / "redis").start()  # must start: a missing Redis fails this test
    url = server.url
    secret = b"s" * 32
    model = model_for("qwen3_next", torch.float64)
    writer = KVCacheTrie.for_model(
        model, capacity_tokens=4096, snapshot_every=16, spill=RedisTier(url, chunk_tokens=16, secret=secret)
    )
    prompt = random_ids(40, seed=17)
    first = CachedGenerator(model, IdTokenizer(), writer).generate(prompt, max_new_tokens=4)
    writer.spill.flush()
    assert writer.stats()["redis_written_states"] >= 2  # at 16 and 32
    reader = KVCacheTrie.for_model(
        model, capacity_tokens=4096, snapshot_every=16, spill=RedisTier(url, chunk_tokens=16, secret=secret)
    )
    follow = [*prompt[:35], *random_ids(5, seed=18)]
    result = CachedGenerator(model, IdTokenizer(), reader).generate(follow, max_new_tokens=4)
    assert result.cached_tokens == 32
    assert reader.stats()["redis_state_hits"] == 1
    assert torch.equal(reader.snapshot(prompt[:32]), writer.snapshot(prompt[:32]))
    assert result.token_ids == one_shot(model, follow, 4)[0]
    assert first.cached_tokens == 0

    # a record sealed for another position is rejected (the seal binds key, namespace and tokens)
    import redis as redis_py

    client = redis_py.Redis.from_url(url)
    keys = sorted(k for k in client.keys("kvblocks:*") if k.endswith(b":state"))
    assert len(keys) >= 2
    values = [client.get(k) for k in keys]
    client.set(keys[0], values[1])
    client.set(keys[1], values[0])
    victim = KVCacheTrie.for_model(
        model, capacity_tokens=4096, snapshot_every=16, spill=RedisTier(url, chunk_tokens=16, secret=secret)
    )
    result = CachedGenerator(model, IdTokenizer(), victim).generate(follow, max_new_tokens=4)
    assert result.cached_tokens == 0
    assert victim.stats()["redis_verify_failures"] >= 1
    assert result.token_ids == one_shot(model, follow, 4)[0]
    for trie in (writer, reader, victim):
        trie.close()

    # write-back: a snapshot reaches Redis when it leaves the device pool
    client.flushall()
    back = KVCacheTrie.for_model(
        model,
        capacity_tokens=4096,
        snapshot_every=16,
        spill=RedisTier(url, chunk_tokens=16, secret=secret, write_mode="back"),
    )
    CachedGenerator(model, IdTokenizer(), back).generate(prompt, max_new_tokens=4)
    back.spill.flush()
    assert back.stats()["redis_written_states"] == 0
    back.clear()
    back.spill.flush()
    assert back.stats()["redis_written_states"] >= 2
    assert back.stats()["snapshots"] == 0
    back.close()
    server.stop()


@pytest.mark.parametrize("arch", ["lfm2", "qwen3_next", "mamba2", "jamba", "bamba"])
def test_speculative_decoding_on_a_hybrid_target_is_greedy_exact(arch):
    """Rejected drafts roll back by restoring the snapshot taken before the verify and feeding the
    accepted tokens again; tokens equal a plain run without the cache, round after round."""
    from kvblocks.specdec import ModelDrafter, PromptLookupDrafter, SpeculativeGenerator

    model = model_for(arch, torch.float64)
    trie = KVCacheTrie.for_model(model, capacity_tokens=1 << 16, snapshot_every=EVERY)
    # a repetitive prompt so that prompt lookup drafts, and some drafts are rejected
    prompt = random_ids(12, seed=19) * 3
    rejected = 0
    for drafter in (PromptLookupDrafter(), ModelDrafter(tiny_model("llama", torch.float64))):
        sg = SpeculativeGenerator(model, IdTokenizer(), trie, drafter=drafter, gamma=3)
        for ids in (prompt, [*prompt, 7, 8]):
            result = sg.generate(ids, max_new_tokens=12, ignore_eos=True)
            assert result.token_ids == one_shot(model, ids, 12)[0]
            rejected += result.spec.rejected_rounds
        assert trie.stats()["locked_tokens"] == 0
    assert rejected > 0  # the rollback path ran


def test_a_recurrent_drafter_is_refused():
    from kvblocks.specdec import ModelDrafter

    with pytest.raises(UnsupportedModelError, match="recurrent state"):
        ModelDrafter(model_for("lfm2", torch.float32))
    # `--draft self:K` on a hybrid target: the same refusal, as the one-line error the CLI prints
    from kvblocks.specdec.factory import DraftSpecError, build_drafter

    with pytest.raises(DraftSpecError, match="recurrent state"):
        build_drafter(
            "self:2", model_for("lfm2", torch.float32), None, {"capacity_tokens": 64}, "float32", "cpu"
        )


def test_kvblocks_serve_reuses_a_hybrid_prefix_over_http(tmp_path):
    """`kvblocks serve` on an LFM2-shaped hybrid (SmolLM2's tokenizer), driven by the openai client:
    the third request sharing a system prompt hits it through the snapshot taken at the second one's
    branch point, and every reply equals the model's greedy reply without the cache."""
    import httpx
    import openai
    from server_proc import (
        SMOLLM2_TOKENIZER_FILES,
        cli_env,
        kvblocks_command,
        scrape,
        smollm2_dir,
        start_server,
        stop_cleanly,
    )
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    fields = dict(HYBRID_CONFIGS["lfm2"], vocab_size=49152, initializer_range=0.2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("lfm2", **fields, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    ).eval()
    model.save_pretrained(tmp_path)
    for name in SMOLLM2_TOKENIZER_FILES:
        (tmp_path / name).write_bytes((smollm2_dir() / name).read_bytes())
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    reference = CachedGenerator(model, tokenizer, None)

    system = "You are a terse assistant for a lighthouse keeper. " * 6
    server = start_server("--model", str(tmp_path), "--snapshot-every", "16")
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120) as client:
            cached = []
            for question in ("Is the lamp lit?", "How high are the waves?", "When does the ferry come?"):
                messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
                reply = client.chat.completions.create(
                    model=str(tmp_path), messages=messages, max_tokens=8, temperature=0
                )
                want = reference.generate(messages, max_new_tokens=8, ignore_eos=False)
                assert reply.choices[0].message.content == want.text
                cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        turn = tokenizer.apply_chat_template([{"role": "system", "content": system}], tokenize=False)
        system_tokens = len(tokenizer(turn, add_special_tokens=False)["input_ids"])
        assert cached[0] == 0
        assert 0 < cached[1] < system_tokens <= cached[2]  # a periodic snapshot, then the branch point
        with httpx.Client(base_url=server.url, timeout=30) as http:
            metrics = scrape(http)
        assert metrics["kvblocks_state_snapshots"] > 0
        assert metrics["kvblocks_state_snapshot_misses_total"] >= 1
        stats = subprocess.run(
            [*kvblocks_command(), "stats", "--url", server.url], capture_output=True, text=True, env=cli_env()
        )
        assert stats.returncode == 0 and "state snapshots" in stats.stdout, stats.stderr
        tree = subprocess.run(
            [*kvblocks_command(), "inspect", "--tree", "--url", server.url],
            capture_output=True,
            text=True,
            env=cli_env(),
        )
        assert tree.returncode == 0 and "snapshot" in tree.stdout, tree.stderr
    finally:
        stop_cleanly(server)


@pytest.mark.parametrize("arch", ["zamba2", "lfm2"])
def test_prompt_logprobs_requests_store_only_what_a_prefill_computes(arch):
    """A prompt-logprobs request computes all but the last prompt token, then that token alone. On a
    model whose one-token step differs from its prefill (zamba2) nothing past that point is stored;
    elsewhere (lfm2) the whole prompt and reply are. Either way later requests stay exact."""
    h = Harness(arch, torch.float32)
    prompt = random_ids(30, seed=21)
    result = h.generator.generate(prompt, max_new_tokens=4, prompt_logprobs=1, ignore_eos=True)
    assert result.cache_bypass == "prompt_logprobs"
    assert result.token_ids == one_shot(h.model, prompt, 4)[0]
    stored = h.trie.cached_length([*prompt, *result.token_ids], servable=True)
    # zamba2: up to the snapshot two tokens before the end (the last forward of the prompt took one)
    assert stored == (len(prompt) - 2 if arch == "zamba2" else len(prompt) + 3)
    follow = [*prompt, *random_ids(5, seed=22)]
    again = h.generator.generate(follow, max_new_tokens=4, ignore_eos=True)
    assert 0 < again.cached_tokens <= stored
    assert again.token_ids == one_shot(h.model, follow, 4)[0]


def test_low_level_insert_of_a_hybrid_keeps_the_state_where_past_stands():
    """`match`/`to_hf_cache`/`insert` without the generator: a hybrid's insert snapshots `past`."""
    model = model_for("qwen3_next", torch.float64)
    trie = KVCacheTrie.for_model(model, capacity_tokens=4096)
    ids = random_ids(20, seed=23)
    with trie.match(ids) as hit:
        past = hit.to_hf_cache()
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids[hit.length : -1]]), cache=past, use_cache=True)
        trie.insert(ids, past)  # 19 positions computed: stored with the state after them
    follow = [*ids[:-1], 7, 8, 9]
    with trie.match(follow) as hit:
        assert hit.length == 19
        past = hit.to_hf_cache()
        with torch.inference_mode():
            got = model(input_ids=torch.tensor([follow[19:]]), cache=past, use_cache=True).logits[0, -1]
    want = one_shot(model, follow, 1)[1][0]
    assert (got - want).abs().max().item() < 1e-4 and int(got.argmax()) == int(want.argmax())


def test_with_redis_the_last_chunk_end_of_a_prompt_is_snapshotted_for_other_processes(tmp_path):
    """Redis keeps snapshots only where a chunk ends: with a spill tier the prefill also stops at the
    last chunk end before the prompt's end, so another process resumes a multi-turn history at most
    a chunk short of it, whatever --snapshot-every is."""
    from kvblocks import RedisTier

    server = RedisServer(tmp_path / "redis").start()
    model = model_for("lfm2", torch.float32)

    def process():
        spill = RedisTier(server.url, chunk_tokens=16, secret=b"k" * 32)
        trie = KVCacheTrie.for_model(model, capacity_tokens=1 << 16, snapshot_every=256, spill=spill)
        return trie, CachedGenerator(model, IdTokenizer(), trie)

    first, gen1 = process()
    prompt = random_ids(45, seed=24)
    turn1 = gen1.generate(prompt, max_new_tokens=6, ignore_eos=True)
    assert 32 in turn1.snapshot_positions  # 45 - 1 = 44 -> the chunk end at 32
    first.spill.flush()
    second, gen2 = process()
    history = [*prompt, *turn1.token_ids, *random_ids(4, seed=25)]
    turn2 = gen2.generate(history, max_new_tokens=4, ignore_eos=True)
    assert turn2.cached_tokens == 32
    assert turn2.token_ids == one_shot(model, history, 4)[0]
    for trie in (first, second):
        trie.close()
    server.stop()
