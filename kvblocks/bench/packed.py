"""`kvblocks bench packed`: the paged, batched engine against one request at a time and the ideal.

- decode: B requests each hold a C-token context. One timed run is one decode step for all of
  them: one packed forward (`kvblocks.engine.attention.forward.PackedForward`: every request's next token in one `[1, B]`
  sequence, attention per request through its pool slots) or B forwards of one token each on the
  request's own `DynamicCache` (what `Engine` does). Both greedy-decode the same tokens; the suite
  checks that the token streams are identical.
- head-of-line: TTFT of short requests (max_tokens 1) sent one after another while a long prompt
  prefills, against their TTFT on an idle engine; `Engine` and `BatchEngine` at several token
  budgets, so the price in the long prompt's own TTFT shows beside the gain.
- memory: RSS growth while N requests decode over one cached document (sampled every 5 ms, peak
  minus the level before they were sent): `Engine` gathers a private copy of the document's KV per
  request, `BatchEngine` reads the trie's slots in place.
- ttft: a prompt of a cached prefix plus a few new tokens, submit to first token, against the ideal
  (the bare model prefilling only the new tokens over a cache that already holds the prefix).
- flood: a victim tenant's TTFT (a cached system prompt plus a short question, one request at a
  time) idle and beside a tenant flooding with long prompts, the server's CPU scheduler against the
  one before issue 41's fix (64-token cuts, a step's prefill split by shares only), variants
  alternating; and the flooder's tokens per second, the price of the victim's bound.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import threading
import time

import numpy as np

from kvblocks.bench import fixtures
from kvblocks.bench.harness import (
    BenchOptions,
    Check,
    Option,
    Report,
    Variant,
    add_suite,
    fmt_seconds,
    ints,
    measure,
)
from kvblocks.errors import UserError

BENCHMARKS = ("decode", "head-of-line", "memory", "ttft", "exactness", "flood")
OPTIONS = (
    Option(
        "--shared",
        int,
        0,
        "decode: leading tokens of context every request shares, stored once in the pool as the trie "
        "stores a system prompt (default 0)",
    ),
    Option(
        "--profile",
        bool,
        False,
        "decode: also say where a packed step goes (attention timed by its own clock, Python "
        "included; matmul, copies, python split by one profiled step) and its FLOP/s against a "
        "matmul peak of the model's shapes at 64 rows",
    ),
    *ints("", [
        ("requests", 16, "decode: concurrent requests"),
        ("context", 600, "decode: tokens of context per request"),
        ("steps", 10, "decode: timed decode steps per variant"),
        ("long-prompt", 3000, "head-of-line: tokens of the long prompt"),
        ("short-requests", 6, "head-of-line: short requests timed per variant (idle and loaded)"),
        ("document", 2800, "memory: tokens of the cached document"),
        ("readers", 8, "memory: concurrent requests over the document"),
        ("cached", 1000, "ttft: cached prefix tokens"),
        ("new", 30, "ttft: new tokens after the prefix"),
        ("runs", 10, "ttft: timed runs per variant"),
        ("agents", 16, "exactness: requests (chat turns sharing a system prompt)"),
        ("reply", 32, "exactness: greedy tokens per request"),
        ("system-tokens", 600, "exactness: shared system prompt"),
        ("flood-seconds", 20, "flood: seconds of victim requests beside the flooder, per variant and round"),
        ("flood-rounds", 2, "flood: rounds, the variants alternating"),
        ("flood-system", 300, "flood: the victim's cached system prompt"),
    ]),
)  # fmt: skip


def add_parser(suites: argparse._SubParsersAction) -> None:
    add_suite(
        suites,
        "packed",
        run,
        help="decode throughput: one packed forward over the pool vs one forward per request",
        description="Decode steps of B requests as one packed forward (kvblocks.engine.attention) vs one at a time.",
        model=True,
        dtype=True,
        only=BENCHMARKS,
        options=OPTIONS,
    )


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    dtype = fixtures.model_dtype(args, packed=True)
    model, tokenizer = fixtures.load_model(args.model, dtype)
    suites = dict(zip(BENCHMARKS, (decode, head_of_line, memory, ttft, exactness, flood)))
    reports = [suites[name](model, tokenizer, args, opts) for name in args.only or BENCHMARKS]
    for report in reports:
        report.params["dtype"] = dtype
    return reports


PACKED, SOLO = "packed forward", "one request at a time"
PER_SEGMENT = "packed, one attention call per request"
INVARIANT = "packed, batch-invariant (the server's default)"
GATHERED = "packed, batch-invariant, keys gathered (no CPU kernel)"


class DecodeBoth:
    """B prompts prefilled both ways: into pool slots for the packed runners (the first `shared`
    tokens, common to every prompt, stored once and pointed at by every request, as the trie hands
    out a cached system prompt), and each into its own `DynamicCache`; every step then greedy-decodes
    one more token per request, per way. Four packed runners read the same slots: cascade attention
    (the CPU default without batch invariance), one attention call per request, the batch-invariant
    runner (the server's default: short segments attended in place by the CPU kernel where it
    builds), and the same without the kernel (blocks cut at fixed positions, own keys gathered)."""

    def __init__(self, model, prompts: list[list[int]], capacity: int, shared: int = 0) -> None:
        import torch

        from kvblocks.adapters import hf
        from kvblocks.cache.layout import KVLayout
        from kvblocks.cache.pool import KVPool
        from kvblocks.engine.attention.batch import Segment
        from kvblocks.engine.attention.forward import PackedForward
        from kvblocks.engine.scheduler import CHUNK

        self.model, self.segment = model, Segment
        self.pool = KVPool(
            KVLayout(next(model.parameters()).dtype, tuple(hf.describe_layers(model))), capacity, "cpu"
        )
        self.runners = {
            PACKED: PackedForward(model, self.pool),
            PER_SEGMENT: PackedForward(model, self.pool, attention="per-segment"),
            INVARIANT: PackedForward(model, self.pool, invariant=True, chunk=CHUNK),
            GATHERED: PackedForward(model, self.pool, invariant=True, chunk=CHUNK, direct=False),
        }
        common = self.pool.alloc(shared)
        if shared:
            self.runners[PACKED].forward([Segment(prompts[0][:shared], common)])
        self.pool.alloc(1)  # no request's own slots continue the shared run (the trie's tokens would)
        self.slots = [np.concatenate([common, self.pool.alloc(len(p) - shared)]) for p in prompts]
        self.tokens: dict[str, list[list[int]]] = {name: [] for name in (*self.runners, SOLO)}
        self.caches = []
        with torch.inference_mode():
            for i, prompt in enumerate(prompts):
                first = self.runners[PACKED].forward([Segment(prompt[shared:], self.slots[i])])[0][-1]
                for name in self.runners:
                    self.tokens[name].append([int(first.argmax())])
                cache = hf.empty_cache(model.config)
                logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits
                self.tokens[SOLO].append([int(logits[0, -1].argmax())])
                self.caches.append(cache)
        self.grown = {name: list(self.slots) for name in self.runners}

    def step(self, name: str):
        """One decode step of every request with the packed runner `name` (each way keeps its own
        slots for the tokens it decodes)."""

        def run() -> None:
            segments = []
            for i, tokens in enumerate(self.tokens[name]):
                self.grown[name][i] = np.concatenate([self.grown[name][i], self.pool.alloc(1)])
                segments.append(self.segment(tokens[-1:], self.grown[name][i]))
            for tokens, logits in zip(self.tokens[name], self.runners[name].forward(segments)):
                tokens.append(int(logits[-1].argmax()))

        return run

    def replay(self, name: str = PACKED):
        """The last step of runner `name` again (same segments, the same slots rewritten): what the
        profile times."""

        def run() -> None:
            segments = [
                self.segment(tokens[-2:-1], slots)
                for tokens, slots in zip(self.tokens[name], self.grown[name])
            ]
            self.runners[name].forward(segments)

        return run

    def solo_step(self) -> None:
        import torch

        with torch.inference_mode():
            for tokens, cache in zip(self.tokens[SOLO], self.caches):
                logits = self.model(
                    input_ids=torch.tensor([tokens[-1:]]), past_key_values=cache, use_cache=True
                ).logits
                tokens.append(int(logits[0, -1].argmax()))


def decode(model, tokenizer, args: argparse.Namespace, opts: BenchOptions) -> Report:
    b, context, shared = args.requests, args.context, args.shared
    if not 0 <= shared < context:
        raise UserError(f"--shared must be at least 0 and below --context ({context}); got {shared}")
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    common = rng.integers(vocab // 8, vocab // 2, shared).tolist()
    prompts = [common + rng.integers(vocab // 8, vocab // 2, context - shared).tolist() for _ in range(b)]
    steps = 2 * (args.steps + opts.warmup) + 4
    both = DecodeBoth(model, prompts, capacity=b * (context + 2 * steps) + shared + 8, shared=shared)
    variants = [Variant(name, both.step(name)) for name in both.runners]
    samples = measure([*variants, Variant(SOLO, both.solo_step)], args.steps, opts, "packed")
    params = {
        "model": args.model or "SmolLM2-135M-Instruct",
        "requests": b,
        "context": context,
        "steps": args.steps,
    }
    if shared:
        params["shared"] = shared
    title = f"Decode steps of {b} requests, {context}-token contexts" + (
        f" ({shared} shared)" if shared else ""
    )
    report = Report("packed-decode", title, params, samples, baseline=SOLO)
    differ = {
        name: sum(p != s for p, s in zip(both.tokens[name], both.tokens[SOLO])) for name in both.runners
    }
    import torch

    exact = 0 if next(model.parameters()).dtype == torch.float32 else None
    report.checks = [
        Check("decode throughput, packed / one at a time", report.ratio(SOLO, PACKED), "x", 2.5, True),
        Check("decode throughput, batch-invariant / one at a time", report.ratio(SOLO, INVARIANT), "x"),
        Check(
            "decode throughput, batch-invariant / one call per request",
            report.ratio(PER_SEGMENT, INVARIANT),
            "x",
        ),
        Check(
            "decode throughput, batch-invariant / keys gathered (no CPU kernel)",
            report.ratio(GATHERED, INVARIANT),
            "x",
        ),
        # the reference is transformers' own forward: equal greedy tokens are promised in float32
        # only; in half precision the promise is batched = alone in the invariant engine (`exactness`)
        Check("requests whose greedy tokens differ", differ[PACKED], "", exact),
        Check("requests whose greedy tokens differ, batch-invariant", differ[INVARIANT], "", exact),
        Check("requests whose greedy tokens differ, keys gathered", differ[GATHERED], "", exact),
    ]
    report.notes = [
        "tokens/s: " + ", ".join(f"{name} {b / report.median(name):.1f}" for name in (*both.runners, SOLO)),
        "packed = kvblocks.engine.attention.forward.PackedForward (K/V written to and read from pool slots; cascade "
        "attention: the shared run read once for every request; batch-invariant: cut into pieces at fixed "
        "positions, each read once for every request that holds it); one at a time = a transformers "
        "DynamicCache per request, one forward per token",
        "CPU attention kernel (kvblocks.engine.kernel): "
        + (
            "in use"
            if both.runners[PACKED].attention.direct
            else f"off: {both.runners[PACKED].attention.direct_reason}"
        ),
    ]
    if args.profile:
        profile_checks(report, model, both, b, PACKED)
        profile_checks(report, model, both, b, INVARIANT)
    return report


def profile_checks(report: Report, model, both: DecodeBoth, requests: int, name: str) -> None:
    """Where a step of runner `name` goes, and its FLOP/s against the model's matmul peak (issue
    23's targets)."""
    from kvblocks.bench import stepprofile

    profile = stepprofile.profile_step(both.replay(name))
    keys = sum(both.grown[name][i].size for i in range(requests))
    flops = stepprofile.step_flops(model, requests, keys)
    peak = stepprofile.matmul_peak(model)
    achieved = flops / profile.seconds
    label = "a packed step" if name == PACKED else "a batch-invariant step"
    report.checks += [
        Check(f"attention (gather + attend) share of {label}", profile.shares["attention"], "", 0.25),
        Check(f"achieved FLOP/s / matmul peak at 64 rows, {label}", achieved / peak, "", 0.4, True),
    ]
    shares = ", ".join(f"{part} {share:.0%}" for part, share in profile.shares.items())
    report.notes.append(
        f"{label} ({profile.seconds * 1e3:.0f} ms CPU): {shares} (attention timed directly, "
        f"{profile.attention_kernels:.0%} of it inside operators; the rest split by a profiled run); "
        f"{achieved / 1e9:.1f} GFLOP/s achieved, matmul peak {peak / 1e9:.1f} GFLOP/s"
    )


# ---- engine-level: head of line, memory, TTFT against the ideal ---------------------------------


def _engine(model, tokenizer, batch: int, tokens: int = 80, capacity: int = 16384, invariant: bool = True):
    """`Engine` (batch 1) or `BatchEngine` over a fresh trie, started, with the server's budget
    while the batch is full."""
    from kvblocks import CachedGenerator, KVCacheTrie
    from kvblocks.engine.batch import BatchEngine
    from kvblocks.engine.loop import Engine
    from kvblocks.engine.scheduler import FULL_BATCH_TOKENS

    gen = CachedGenerator(model, tokenizer, KVCacheTrie.for_model(model, capacity_tokens=capacity))
    if batch == 1:
        return Engine(gen).start()
    return BatchEngine(
        gen,
        max_batch_size=batch,
        max_batch_tokens=tokens,
        full_batch_tokens=FULL_BATCH_TOKENS,
        invariant=invariant,
    ).start()


class EngineCall:
    """One request submitted to an engine: when it was sent, its first piece, its tokens (the GPU
    suite times its requests with it too)."""

    def __init__(
        self, engine, ids: list[int], max_tokens: int, logprobs: int | None = None, tenant: str = ""
    ) -> None:
        from kvblocks import GenerationParams

        self.done = threading.Event()
        self.first = 0.0
        self.error: BaseException | None = None
        self.tokens: list[int] = []
        self.logprobs: list = []
        self.sent = time.perf_counter()
        params = GenerationParams(max_new_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
        engine.submit(ids, self._emit, tenant=tenant, params=params)

    def _emit(self, item) -> None:
        if isinstance(item, BaseException):
            self.error = item
            self.done.set()
            return
        self.first = self.first or time.perf_counter()
        self.tokens += item.token_ids
        self.logprobs += item.logprobs or []
        if item.result is not None:
            self.done.set()

    def wait(self) -> float:
        """TTFT in seconds once the request has finished."""
        if not self.done.wait(1800) or self.error is not None:
            raise RuntimeError(f"a benchmark request failed: {self.error}")
        return self.first - self.sent


def random_ids(rng, vocab: int, n: int) -> list[int]:
    """Ids from the middle of the vocabulary (no special tokens), for random prompts."""
    return rng.integers(vocab // 8, vocab // 2, n).tolist()


def head_of_line(model, tokenizer, args: argparse.Namespace, opts: BenchOptions) -> Report:
    vocab = model.config.vocab_size
    rng = np.random.default_rng(1)
    configs = [("Engine (batch 1)", 1, 0, True)]
    configs += [(f"BatchEngine, {t} tokens/step", 16, t, True) for t in (512, 128)]
    configs += [("BatchEngine, 80 tokens/step (default)", 16, 80, True)]
    configs += [("BatchEngine --no-batch-invariant, 32 tokens/step", 16, 32, False)]
    samples: dict[str, list[float]] = {}
    checks, notes = [], []
    long_ttft = {}
    for name, batch, tokens, invariant in configs:
        engine = _engine(model, tokenizer, batch, tokens or 80, invariant=invariant)
        try:
            for _ in range(opts.warmup):
                EngineCall(engine, random_ids(rng, vocab, 24), 1).wait()
            idle = [
                EngineCall(engine, random_ids(rng, vocab, 24), 1).wait() for _ in range(args.short_requests)
            ]
            long = EngineCall(engine, random_ids(rng, vocab, args.long_prompt), 1)
            time.sleep(0.2)
            loaded = []
            while len(loaded) < args.short_requests and not (loaded and long.done.is_set()):
                time.sleep(float(rng.uniform(0.0, 0.25)))  # arrivals fall anywhere in a step
                loaded.append(EngineCall(engine, random_ids(rng, vocab, 24), 1).wait())
            long_ttft[name] = long.wait()
        finally:
            engine.stop()
        samples[f"{name}: idle"] = idle
        samples[f"{name}: while the long prompt prefills"] = loaded
        ratio = float(np.median(loaded) / np.median(idle))
        target = 2.0 if name.endswith("(default)") else None
        checks.append(Check(f"short-request TTFT loaded / idle, {name}", ratio, "x", target))
        checks.append(Check(f"long prompt TTFT, {name}", long_ttft[name], "s"))
        notes.append(
            f"{name}: short-request TTFT median idle {fmt_seconds(float(np.median(idle)))}, loaded "
            f"{fmt_seconds(float(np.median(loaded)))} over {len(loaded)} requests; the "
            f"{args.long_prompt}-token prompt's own TTFT {fmt_seconds(long_ttft[name])}"
        )
    title = f"Short requests while a {args.long_prompt}-token prompt prefills"
    params = {"long_prompt": args.long_prompt, "short_prompt": 24, "short_requests": args.short_requests}
    report = Report("head-of-line", title, params, samples, checks)
    report.notes = [
        *notes,
        "short requests: 24 fresh tokens, max_tokens 1, sent one after another (each a random 0-250 ms "
        "after the previous answered, so arrivals fall anywhere in a step) from 0.2 s after the long prompt was submitted until it finished (at least one); BatchEngine "
        "runs batch-invariant (prompts cut every 16 tokens, so at least batch size + 16 tokens per step) unless "
        "named otherwise; the step in flight when a short request "
        "arrives is not interrupted, so its TTFT is at least what remains of that step",
    ]
    return report


FLOOD_CLIENTS, FLOOD_BATCH, FLOOD_PROMPT, FLOOD_REPLY = 6, 8, 90, 16  # the soak's flooder, in the engine


def flood(model, tokenizer, args: argparse.Namespace, opts: BenchOptions) -> Report:
    from kvblocks.engine.scheduler import CHUNK

    vocab = model.config.vocab_size
    rng = np.random.default_rng(3)
    system = random_ids(rng, vocab, args.flood_system)
    questions = [random_ids(rng, vocab, 12) for _ in range(5)]
    configs = {
        f"server default ({CHUNK}-token cuts, one cut while contended)": (CHUNK, CHUNK),
        "before (64-token cuts, shares only)": (64, 0),
    }
    samples: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {}
    for _ in range(args.flood_rounds):
        for name, (chunk, contended) in configs.items():
            idle, flooded, rate = _flood_once(
                model, tokenizer, args, system, questions, chunk, contended, rng
            )
            samples.setdefault(f"{name}: idle", []).extend(idle)
            samples.setdefault(f"{name}: beside the flooder", []).extend(flooded)
            rates.setdefault(name, []).append(rate)
    checks = []
    for name in configs:
        idle, flooded = samples[f"{name}: idle"], samples[f"{name}: beside the flooder"]
        target = 2.0 if name.startswith("server default") else None
        p99 = float(np.percentile(flooded, 99) / np.percentile(idle, 99))
        checks.append(Check(f"victim TTFT p99 beside the flooder / idle, {name}", p99, "x", target))
        p50 = float(np.median(flooded) / np.median(idle))
        checks.append(Check(f"victim TTFT p50 beside the flooder / idle, {name}", p50, "x"))
        checks.append(Check(f"flooder tokens/s, {name}", float(np.median(rates[name])), "tok/s"))
    params = {"flood_seconds": args.flood_seconds, "rounds": args.flood_rounds, "system": args.flood_system}
    report = Report(
        "flood", "A victim's TTFT beside a flooding tenant, in the engine", params, samples, checks
    )
    report.notes = [
        f"victim: a {args.flood_system}-token system prompt (cached) plus a 12-token question, max_tokens 1, one request at a "
        f"time, a random 0-100 ms apart; flooder: {FLOOD_CLIENTS} clients each sending {FLOOD_BATCH} "
        f"prompts of {FLOOD_PROMPT} fresh tokens (max_tokens {FLOOD_REPLY}) and waiting for them, "
        "max_running 4 (the soak's flooder); BatchEngine batch-invariant, 80 tokens a step; flooder "
        "tokens/s counts prompt and reply tokens of its finished requests",
    ]
    return report


def _flood_once(model, tokenizer, args, system, questions, chunk: int, contended: int, rng):
    """(victim TTFTs idle, victim TTFTs beside the flooder, flooder tokens/s) on a fresh engine."""
    import dataclasses

    from kvblocks import CachedGenerator, KVCacheTrie
    from kvblocks.engine.admission import TenantLimits
    from kvblocks.engine.batch import BatchEngine
    from kvblocks.engine.scheduler import FULL_BATCH_TOKENS

    vocab = model.config.vocab_size
    gen = CachedGenerator(model, tokenizer, KVCacheTrie.for_model(model, capacity_tokens=3000))
    limits = {"flood": TenantLimits(max_running=4)}
    engine = BatchEngine(gen, max_batch_tokens=80, full_batch_tokens=FULL_BATCH_TOKENS, invariant=True,
                         chunk=chunk, limits_of=lambda t: limits.get(t, TenantLimits()))  # fmt: skip
    engine.scheduler.limits = dataclasses.replace(engine.scheduler.limits, contended_prefill=contended)
    engine.start()

    def victim(i: int) -> float:
        time.sleep(float(rng.uniform(0.0, 0.1)))  # arrivals fall anywhere in a step
        return EngineCall(engine, system + questions[i % len(questions)], 1, tenant="victim").wait()

    stop, done, lock = threading.Event(), [0], threading.Lock()

    def flooder(seed: int) -> None:
        own = np.random.default_rng(seed)
        while not stop.is_set():
            prompts = [random_ids(own, vocab, FLOOD_PROMPT) for _ in range(FLOOD_BATCH)]
            for call in [EngineCall(engine, p, FLOOD_REPLY, tenant="flood") for p in prompts]:
                while not call.done.wait(0.1):
                    if stop.is_set():  # the engine stops with the rest unfinished
                        return
                with lock:
                    done[0] += FLOOD_PROMPT + FLOOD_REPLY

    try:
        for i in range(len(questions)):  # the system prompt and the questions are cached from here on
            victim(i)
        idle = [victim(i) for i in range(16)]
        threads = [
            threading.Thread(target=flooder, args=(seed,), daemon=True) for seed in range(FLOOD_CLIENTS)
        ]
        for t in threads:
            t.start()
        time.sleep(1.0)
        start, before = time.perf_counter(), done[0]
        flooded, deadline = [], time.monotonic() + args.flood_seconds
        while time.monotonic() < deadline or len(flooded) < 2:
            flooded.append(victim(len(flooded)))
        rate = (done[0] - before) / (time.perf_counter() - start)
        stop.set()
        for t in threads:
            t.join()
    finally:
        engine.stop()
    return idle, flooded, rate


class _PeakRss:
    """Peak resident set size (from /proc/self/statm) sampled every 5 ms on a thread."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.now())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.now())


def memory(model, tokenizer, args: argparse.Namespace, opts: BenchOptions) -> Report:
    vocab = model.config.vocab_size
    rng = np.random.default_rng(2)
    document = random_ids(rng, vocab, args.document)
    growth: dict[str, list[float]] = {}
    for name, batch in (("Engine (batch 1)", 1), ("BatchEngine", 16)):
        engine = _engine(model, tokenizer, batch)
        growth[name] = []
        try:
            EngineCall(engine, document, 1).wait()  # the document is cached from here on
            for _ in range(opts.warmup + 3):
                gc.collect()
                _trim()  # freed memory back to the OS: what one round allocates shows as growth
                meter = _PeakRss()
                before = meter.now()
                for call in [
                    EngineCall(engine, document + random_ids(rng, vocab, 20), 16) for _ in range(args.readers)
                ]:
                    call.wait()
                growth[name].append((meter.stop() - before) / 2**20)
        finally:
            engine.stop()
        growth[name] = growth[name][opts.warmup :]
    engine_mb, batch_mb = (float(np.median(growth[k])) for k in ("Engine (batch 1)", "BatchEngine"))
    kv_mb = args.document * model_token_bytes(model) / 2**20
    title = f"RSS growth: {args.readers} concurrent requests over one cached {args.document}-token document"
    params = {"document": args.document, "readers": args.readers, "new_tokens": 20, "max_tokens": 16}
    report = Report("memory", title, params)
    report.checks = [
        Check("RSS growth, Engine (batch 1)", engine_mb, "MiB"),
        Check("RSS growth, BatchEngine", batch_mb, "MiB"),
        Check("RSS growth BatchEngine / Engine", batch_mb / max(engine_mb, 0.1), "", 0.15),
    ]
    report.notes = [
        f"the document's KV is {kv_mb:.0f} MiB; each reader adds 20 prompt and 16 reply tokens; RSS sampled "
        "every 5 ms from /proc/self/statm, peak minus the level just before the readers were sent (after "
        "gc and malloc_trim), median of 3 rounds after warm-up rounds: "
        + "; ".join(f"{k} {', '.join(f'{v:.0f}' for v in rounds)} MiB" for k, rounds in growth.items())
    ]
    return report


def _trim() -> None:
    """glibc's malloc_trim(0), where there is one: return freed heap pages to the OS."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def model_token_bytes(model) -> int:
    from kvblocks.adapters import hf
    from kvblocks.cache.layout import KVLayout

    return KVLayout(next(model.parameters()).dtype, tuple(hf.describe_layers(model))).token_bytes()


def ttft(model, tokenizer, args: argparse.Namespace, opts: BenchOptions) -> Report:
    import torch

    from kvblocks.adapters import hf

    vocab = model.config.vocab_size
    rng = np.random.default_rng(3)
    prefix = random_ids(rng, vocab, args.cached)
    engines = {"BatchEngine": _engine(model, tokenizer, 16), "Engine (batch 1)": _engine(model, tokenizer, 1)}
    with torch.inference_mode():
        ready = hf.empty_cache(model.config)
        model(input_ids=torch.tensor([prefix]), past_key_values=ready, use_cache=True)
    state: dict[str, object] = {}

    def fresh() -> None:
        state["new"] = random_ids(rng, vocab, args.new)

    @torch.inference_mode()
    def ideal() -> None:
        logits = model(input_ids=torch.tensor([state["new"]]), past_key_values=ready, use_cache=True).logits
        int(logits[0, -1].argmax())

    def ideal_teardown() -> None:
        hf.crop(ready, args.cached)  # back to the prefix alone, nothing copied

    def through(engine):
        return lambda: EngineCall(engine, prefix + state["new"], 1).wait()

    try:
        for engine in engines.values():
            EngineCall(engine, prefix, 1).wait()  # the prefix is cached
        variants = [Variant("ideal (prefill the new tokens only)", ideal, fresh, ideal_teardown)]
        variants += [Variant(name, through(engine), fresh) for name, engine in engines.items()]
        samples = measure(variants, args.runs, opts, "ttft")
    finally:
        for engine in engines.values():
            engine.stop()
    title = f"TTFT with {args.cached} cached + {args.new} new tokens against the ideal"
    params = {"cached": args.cached, "new": args.new, "runs": args.runs}
    report = Report("ttft-cached", title, params, samples, baseline="ideal (prefill the new tokens only)")
    ideal_s = report.median("ideal (prefill the new tokens only)")
    report.checks = [
        Check("TTFT BatchEngine / ideal", report.median("BatchEngine") / ideal_s, "", 1.02),
        Check("TTFT Engine (batch 1) / ideal", report.median("Engine (batch 1)") / ideal_s),
    ]
    report.notes = [
        "engines: submit to first piece on the engine's thread (ids given, no tokenizer), max_tokens 1; ideal: "
        "the bare model's forward of the new tokens over a DynamicCache already holding the prefix (cropped "
        "back to the prefix after each run, untimed) and the argmax; Engine gathers the cached prefix into a new DynamicCache "
        "per request, BatchEngine reads it from the pool in place"
    ]
    return report


UNCACHED = "BatchEngine invariant, alone, uncached"
EXACT_RUNS = (  # name, batch size, batch-invariant, how the requests are sent
    ("Engine, alone", 1, True, "alone"),
    (UNCACHED, 16, True, "uncached"),
    ("BatchEngine invariant, alone", 16, True, "alone"),
    ("BatchEngine invariant, all at once", 16, True, "together"),
    ("BatchEngine --no-batch-invariant, alone", 16, False, "alone"),
    ("BatchEngine --no-batch-invariant, all at once", 16, False, "together"),
)
EXACT_PAIRS = (  # run, reference; flips are a target only against the invariant engine alone
    ("BatchEngine invariant, alone", UNCACHED),
    ("BatchEngine invariant, all at once", UNCACHED),
    ("BatchEngine invariant, all at once", "BatchEngine invariant, alone"),
    ("BatchEngine invariant, all at once", "Engine, alone"),
    ("BatchEngine --no-batch-invariant, all at once", "BatchEngine --no-batch-invariant, alone"),
    ("BatchEngine --no-batch-invariant, all at once", "Engine, alone"),
    ("BatchEngine invariant, alone", "Engine, alone"),
)


def send(
    engine, prompts: list[list[int]], reply: int, together: bool, uncached: bool = False
) -> list[EngineCall]:
    """Greedy replies with top-2 logprobs: each request once the previous finished (`uncached`: the
    cache emptied before each), or all at once."""
    calls = []
    for ids in prompts:
        if uncached:
            engine.cache.clear()
        calls.append(EngineCall(engine, ids, reply, logprobs=2))
        if not together:
            calls[-1].wait()
    for call in calls:
        call.wait()
    return calls


def compare(
    runs: list[EngineCall], reference: list[EngineCall]
) -> tuple[list[tuple[int, float]], int, float]:
    """(first differing token and the reference's top-2 margin there) per flipped reply, replies with
    bit-identical logprobs, and the largest chosen-token logprob difference before any flip."""
    flips, exact, worst = [], 0, 0.0
    for a, b in zip(runs, reference):
        exact += [(lp.token, lp.logprob, tuple(lp.top)) for lp in a.logprobs] == [
            (lp.token, lp.logprob, tuple(lp.top)) for lp in b.logprobs
        ]
        steps = min(len(a.tokens), len(b.tokens))
        same = next((i for i in range(steps) if a.tokens[i] != b.tokens[i]), steps)
        worst = max(
            [worst] + [abs(x.logprob - y.logprob) for x, y in zip(a.logprobs[:same], b.logprobs[:same])]
        )
        if same < steps:
            top = b.logprobs[same].top
            flips.append((same, top[0][1] - top[1][1]))
    return flips, exact, worst


def exactness(model, tokenizer, args: argparse.Namespace, opts: BenchOptions) -> Report:
    """Greedy replies of chat turns sharing a system prompt: each request alone vs all at once."""
    from kvblocks.bench.server import system_prompt
    from kvblocks.generate.text import encode_prompt

    system = system_prompt(tokenizer, args.system_tokens)
    chats = [
        [{"role": "system", "content": system}, {"role": "user", "content": _question(i)}]
        for i in range(args.agents)
    ]
    prompts = [encode_prompt(tokenizer, chat) for chat in chats]
    runs: dict[str, list[EngineCall]] = {}
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    t0 = time.perf_counter()
    for name, batch, invariant, how in EXACT_RUNS:
        engine = _engine(model, tokenizer, batch, invariant=invariant)
        try:
            runs[name] = send(engine, prompts, args.reply, how == "together", how == "uncached")
        finally:
            engine.stop()
    elapsed = time.perf_counter() - t0
    title = f"Greedy replies of {args.agents} chat turns sharing a system prompt, alone vs all at once"
    params = {"agents": args.agents, "reply_tokens": args.reply, "system_prompt_tokens": args.system_tokens}
    report = Report("exactness", title, params)
    for name, reference in EXACT_PAIRS:
        flips, exact, worst = compare(runs[name], runs[reference])
        invariant = reference in (UNCACHED, "BatchEngine invariant, alone")  # what batch invariance promises
        report.checks.append(
            Check(f"greedy flips, {name} vs {reference}", len(flips), "", 0 if invariant else None)
        )
        share = f"share of replies with bit-identical logprobs, {name} vs {reference}"
        report.checks.append(Check(share, exact / len(prompts), "", 1.0 if invariant else None, True))
        report.notes.append(
            f"{name} vs {reference}: {len(flips)} of {len(prompts)} replies differ"
            + "".join(f"; at token {i} (top-2 logprob margin {m:.2e})" for i, m in flips)
            + f"; largest chosen-token logprob difference before any flip {worst:.2e}"
        )
    report.notes.append(
        f"{dtype} on CPU, {args.reply} greedy tokens per request (ignore_eos), logprobs with the top 2; alone = "
        "each request submitted once the previous one finished (cached: the shared system prompt is a hit "
        f"from the second on; uncached: the cache emptied before each); all at once = {args.agents} requests submitted "
        f"together (batch 16, 80 tokens/step, the server's defaults); margin = top-1 minus top-2 logprob of the reference at the first "
        f"differing token; {elapsed:.0f} s for the {len(EXACT_RUNS)} runs"
    )
    return report


def _question(i: int) -> str:
    return f"Customer {i} asks about order {1000 + 37 * i}: {_QUESTIONS[i % 4]}"


_QUESTIONS = (
    "it has not arrived yet, what should I do?",
    "can I change the delivery address?",
    "the box was damaged, how do I return it?",
    "why was I charged twice?",
)
