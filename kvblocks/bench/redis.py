"""`kvblocks bench redis`: the Redis spill tier against its targets.

- restore: `RedisTier.fetch` of N chunks (pipelined STRLEN and bounded GETRANGE, verify, decode,
  to device) as a throughput ratio to a raw pipelined redis-py GET of the same keys, without and
  with a secret (sealed records), side by side in one run;
- ttft: time to first token in "process B", a second process with its own copy of the model and
  an empty pool that finds a 1,000-token prefix process A (this one) wrote to Redis, against no
  cache and against a device hit;
- decode: per-token decode latency while the tier spills in the background, against no tier.

The suite starts a private redis-server unless `--redis URL` names a running one.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import redis

from kvblocks.adapters.hf_trie import KVCacheTrie
from kvblocks.bench import fixtures
from kvblocks.bench.harness import (
    SMOLLM2_KV_SHAPE,
    BenchOptions,
    Check,
    Group,
    Option,
    Ratio,
    Report,
    Variant,
    add_suite,
    fmt_seconds,
    ints,
    measure,
    positive_int,
    prefixed,
    repeats_row,
    set_threads,
)
from kvblocks.errors import UserError
from kvblocks.launch.redis_server import RedisServer
from kvblocks.launch.service import ServiceError
from kvblocks.spill.redis_tier import RedisTier

BENCHMARKS = ("restore", "ttft", "decode")
MB = 1e6
# The restore benchmark's sealed tier: a fixed bench-only secret (>= 16 bytes), never a deployment's.
BENCH_SECRET = b"kvblocks-bench-restore-secret-0001"


OPTIONS = (
    Option("--redis", None, None,
           "use this running Redis (keys get a unique prefix and a 1 h TTL) instead of a private "
           "redis-server", metavar="URL"),
    Option("--chunk-tokens", positive_int, 64, "tokens per Redis chunk (default 64)"),
    Group("restore (fetch throughput vs raw GET; the layout defaults to SmolLM2's)",
          ints("restore", [("tokens", 1024, "tokens fetched per run"), *SMOLLM2_KV_SHAPE, repeats_row(60)])),
    Group("ttft (process B restoring a shared prefix from Redis)", ints("ttft", [
        ("prefix", 1000, "shared prefix tokens"),
        ("question", 30, "uncached question tokens"),
        repeats_row(8),
    ])),
    Group("decode (per-token latency with background spilling)", ints("decode", [
        ("tokens", 32, "tokens generated per run"),
        ("prefix", 1000, "cached prefix before each question"),
        ("spill", 512, "tokens of an earlier request spilled in the background during each run"),
        repeats_row(10),
    ])),
)  # fmt: skip


def add_parser(suites: argparse._SubParsersAction) -> None:
    add_suite(
        suites,
        "redis",
        run,
        help="Redis spill tier: restore throughput, time to first token from Redis, decode while spilling",
        description="Benchmarks of the Redis spill tier (RedisTier), each checked against its target.",
        model=True,
        only=BENCHMARKS,
        options=OPTIONS,
    )


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    selected = args.only or list(BENCHMARKS)
    reports: list[Report] = []
    tmp = tempfile.TemporaryDirectory(prefix="kvblocks-bench-redis-")
    with tmp, redis_url(args.redis, Path(tmp.name)) as (url, tier_kwargs):
        tier_kwargs["chunk_tokens"] = args.chunk_tokens
        if "restore" in selected:
            reports.append(bench_restore(opts, url, tier_kwargs, **prefixed(args, "restore")))
        if "ttft" in selected or "decode" in selected:
            model, tokenizer = fixtures.load_model(args.model)
            if "ttft" in selected:
                ttft = prefixed(args, "ttft")
                reports.append(bench_ttft(opts, model, tokenizer, args.model, url, tier_kwargs, **ttft))
            if "decode" in selected:
                decode = prefixed(args, "decode")
                reports.append(bench_decode(opts, model, tokenizer, url, tier_kwargs, **decode))
    return reports


@contextmanager
def redis_url(external: str | None, workdir: Path) -> Iterator[tuple[str, dict]]:
    """(URL, RedisTier keywords): a private server, or a running one with a unique key prefix and TTL."""
    if external:
        yield external, {"key_prefix": f"kvblocks-bench-{uuid.uuid4().hex[:8]}", "ttl_s": 3600.0}
        return
    try:
        server = RedisServer(workdir / "redis").start()
    except ServiceError as exc:
        raise UserError(str(exc)) from exc
    with server:
        yield server.url, {}


def random_ids(rng: np.random.Generator, vocab: int, n: int, avoid: int | None = None) -> list[int]:
    """Random ids above the low range where tokenizers keep special tokens; the first differs from `avoid`."""
    low = min(256, vocab // 2)
    ids = rng.integers(low, vocab, n).tolist()
    if avoid is not None and ids[0] == avoid:
        ids[0] = low + (avoid + 1 - low) % (vocab - low)
    return ids


# ---- a. restore throughput -------------------------------------------------------------------


PURE_RAW = "raw GET, pure-Python reply parser"
PURE_FETCH = "RedisTier.fetch, pure-Python reply parser"
SIDE_NAMES = {
    "plain": ("raw GET (redis-py pipeline)", "RedisTier.fetch (STRLEN+GETRANGE, verify, decode)",
              "match on an empty pool (fetch + promote into the pool)"),
    "sealed": ("raw GET of the sealed records",
               "RedisTier.fetch with secret (STRLEN+GETRANGE, open, verify, decode)",
               "match on an empty pool, with secret"),
}  # fmt: skip
RAW, FETCH, MATCH = SIDE_NAMES["plain"]
SEALED_RAW, SEALED_FETCH, SEALED_MATCH = SIDE_NAMES["sealed"]
# the restore report's checks, in order: parser ratios, throughputs (`THROUGHPUTS`), then ratios
PARSER_RATIOS = (
    Ratio("fetch time, hiredis / pure-Python reply parser", FETCH, PURE_FETCH, target=0.6),
    Ratio("raw GET time, hiredis / pure-Python reply parser", RAW, PURE_RAW),
    Ratio("pure-Python parser: fetch / raw GET throughput", PURE_RAW, PURE_FETCH),
)
THROUGHPUTS = (
    ("raw GET throughput", RAW),
    ("RedisTier.fetch throughput", FETCH),
    ("fetch + promote throughput", MATCH),
    ("sealed: raw GET throughput", SEALED_RAW),
    ("sealed: RedisTier.fetch throughput", SEALED_FETCH),
    ("sealed: fetch + promote throughput", SEALED_MATCH),
)
RESTORE_RATIOS = (
    Ratio("fetch / raw GET throughput", RAW, FETCH, 0.6, True),
    Ratio("fetch / raw GET throughput, median of per-round ratios", RAW, FETCH, paired=True),
    Ratio("sealed fetch / raw GET of the sealed records", SEALED_RAW, SEALED_FETCH, 0.6, True),
    Ratio("sealed fetch / raw GET of the sealed records, median of per-round ratios",
          SEALED_RAW, SEALED_FETCH, paired=True),
    Ratio("sealed fetch / fetch without secret (tokens/s)", FETCH, SEALED_FETCH, 0.9, True),
    Ratio("sealed fetch / fetch without secret, median of per-round ratios",
          FETCH, SEALED_FETCH, paired=True),
    Ratio("fetch + promote / raw GET throughput", RAW, MATCH),
    Ratio("sealed fetch + promote / fetch + promote without secret", MATCH, SEALED_MATCH),
)  # fmt: skip


@dataclass(slots=True)
class Side:
    """One tier holding the restore benchmark's KV: plain or sealed, each under its own keys."""

    tier: RedisTier
    trie: KVCacheTrie
    ns_key: str
    keys: list[str]
    nbytes: int  # bytes of its records, what one run reads


@dataclass(slots=True)
class Restore:
    """What every restore variant reads: the ids, their random KV (one for both sides) and the raw clients."""

    url: str
    tier_kwargs: dict
    shape: tuple[int, int, int]
    tokens: int
    ids: np.ndarray
    source: fixtures.KVSource
    raw: redis.Redis
    raw_pure: redis.Redis

    def side(self, secret: bytes | None) -> Side:
        """Write the KV through a tier with this secret (write-through, flushed) and find its records."""
        tier = RedisTier(self.url, **self.tier_kwargs, secret=secret)
        trie = fixtures.layout_trie(*self.shape, self.tokens, spill=tier)
        ns_key, c = trie.namespace.key, self.tier_kwargs["chunk_tokens"]
        trie.insert(self.ids[: self.tokens], self.source.cache(self.tokens))
        tier.flush()
        written = tier.stats()["redis_written_chunks"]
        assert written == self.tokens // c, f"write-through stored {written} of {self.tokens // c} chunks"
        keys = [tier.key(ns_key, h) for h in tier.codec.chunk_hashes(ns_key, self.ids[: self.tokens], c)]
        return Side(tier, trie, ns_key, keys, sum(len(v) for v in self.raw.mget(keys)))

    def raw_get(self, keys: list[str], client: redis.Redis) -> Callable[[], None]:
        def go() -> None:
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            assert all(v is not None for v in pipe.execute())

        return go

    def fetch(self, tier: RedisTier, ns_key: str) -> Callable[[], None]:
        def go() -> None:
            got = tier.fetch(ns_key, self.ids, 0, self.tokens)
            assert got is not None and got.length == self.tokens, got

        return go

    def promote(self, trie: KVCacheTrie) -> Callable[[], None]:
        def go() -> None:
            with trie.match(self.ids) as hit:
                assert hit.length == self.tokens, hit

        return go


def bench_restore(
    opts: BenchOptions, url: str, tier_kwargs: dict, tokens: int, layers: int, heads: int, head_dim: int,
    repeats: int,
) -> Report:  # fmt: skip
    """Plain and sealed tiers hold the same KV under their own keys; a third plain tier reads with
    redis-py's pure-Python reply parser instead of hiredis; all eight variants interleave."""
    from redis._parsers import _RESP2Parser
    from redis.utils import HIREDIS_AVAILABLE

    c = tier_kwargs["chunk_tokens"]
    tokens = tokens // c * c
    if tokens == 0:
        raise UserError(f"--restore-tokens must be at least one chunk ({c} tokens)")
    if not HIREDIS_AVAILABLE:
        raise UserError(
            "the restore benchmark compares hiredis with the pure-Python parser: pip install hiredis"
        )
    pure = {"parser_class": _RESP2Parser}
    ids = np.asarray(random_ids(np.random.default_rng(3), 32_000, tokens + 1))
    raw, raw_pure = redis.Redis.from_url(url), redis.Redis.from_url(url, **pure)
    source = fixtures.KVSource(layers, heads, head_dim, tokens)
    bench = Restore(url, tier_kwargs, (layers, heads, head_dim), tokens, ids, source, raw, raw_pure)
    sides = {"plain": bench.side(None), "sealed": bench.side(BENCH_SECRET)}
    # the same records as the plain side (same namespace), read through a client without hiredis
    pure_tier = RedisTier(url, **tier_kwargs, client_options=pure)
    pure_trie = fixtures.layout_trie(layers, heads, head_dim, tokens, spill=pure_tier)
    plain = sides["plain"]
    assert pure_trie.namespace.key == plain.ns_key
    variants = [
        Variant(PURE_RAW, bench.raw_get(plain.keys, raw_pure)),
        Variant(PURE_FETCH, bench.fetch(pure_tier, plain.ns_key)),
    ]
    for form, side in sides.items():
        raw_name, fetch_name, match_name = SIDE_NAMES[form]
        variants += [
            Variant(raw_name, bench.raw_get(side.keys, raw)),
            Variant(fetch_name, bench.fetch(side.tier, side.ns_key)),
            Variant(match_name, bench.promote(side.trie), setup=lambda trie=side.trie: trie.evict(tokens)),
        ]
    samples = measure(variants, repeats, opts, "redis restore")
    stats = {form: side.tier.stats() for form, side in sides.items()}
    for trie in (*(side.trie for side in sides.values()), pure_trie):
        trie.close()
    raw.close()
    raw_pure.close()
    nbytes = {form: side.nbytes for form, side in sides.items()}
    return restore_report(opts, url, tier_kwargs, bench.shape, tokens, nbytes, samples, stats)


def restore_report(
    opts: BenchOptions, url: str, tier_kwargs: dict, shape: tuple[int, int, int], tokens: int,
    nbytes: dict[str, int], samples: dict[str, list[float]], stats: dict[str, dict],
) -> Report:  # fmt: skip
    layers, heads, head_dim = shape
    c = tier_kwargs["chunk_tokens"]
    params = {
        "tokens": tokens,
        "chunks": tokens // c,
        "chunk_tokens": c,
        "layout": f"{layers} layers x {heads} KV heads x head_dim {head_dim} fp32",
        "MB_per_run": round(nbytes["plain"] / MB, 1),
        "sealed_MB_per_run": round(nbytes["sealed"] / MB, 1),
        "redis": "private redis-server, TCP 127.0.0.1" if not tier_kwargs.get("ttl_s") else url,
        "clock": opts.clock,
    }
    title = "Restore throughput from Redis vs raw GET, without and with a secret"
    report = Report("redis-restore", title, params, samples, baseline=RAW)
    form_of = {name: form for form, triple in SIDE_NAMES.items() for name in triple}
    form_of |= {PURE_RAW: "plain", PURE_FETCH: "plain"}
    throughputs = [
        Check(metric, nbytes[form_of[name]] / report.median(name) / 1e9, "GB/s")
        for metric, name in THROUGHPUTS
    ]
    ratios = [r.check(report) for r in RESTORE_RATIOS]
    report.checks = [*(r.check(report) for r in PARSER_RATIOS), *throughputs, *ratios]
    report.notes = restore_notes(tokens, c, nbytes, stats)
    return report


def restore_notes(tokens: int, c: int, nbytes: dict[str, int], stats: dict[str, dict]) -> list[str]:
    return [
        f"{tokens // c} chunks of {c} tokens written by write-through (`KVCacheTrie.insert` of random KV, then "
        f"`flush`) twice, the same KV through a tier without and a tier with a secret (their keys differ); "
        f"{nbytes['plain'] / MB:.2f} MB of plain records per run ({nbytes['plain'] / tokens:,.0f} B per token, "
        f"KV + framing), {nbytes['sealed'] / MB:.2f} MB sealed ({nbytes['sealed'] / tokens:,.0f} B per token)",
        "raw GET = one redis-py pipeline of GETs of the same keys returning bytes (no parsing); fetch = what a "
        "device miss runs: chain hashes, a pipelined STRLEN (each record's size against its bounds), a pipelined "
        "GETRANGE bounded by those sizes, per chunk msgpack unpack, "
        "namespace/token/shape/xxh3 checks, one copy of each layer's slice into that layer's preallocated "
        "tensor for the whole run, finiteness check (`torch.aminmax` per layer slice), `.to(device)` (CPU here)",
        "with secret: keyed BLAKE2b chain hashes and keys, and per chunk streaming AES-256-GCM decryption of "
        "each layer's slice straight into place (authenticated with the key and namespace) in place of the "
        "xxh3 checksum and the copy; the other steps are the same. 'with secret / without' compares restored "
        "tokens per second (same tokens, same KV)",
        "'match on an empty pool' adds promotion into the device pool (one scatter per layer); the pool is "
        "emptied by an untimed `evict` before each run",
        f"redis-py {redis.__version__}; every side parses replies with hiredis (kvblocks installs "
        "`redis[hiredis]`) except the two 'pure-Python reply parser' variants, which read the plain records "
        "through clients made with `parser_class=_RESP2Parser`; "
        + "; ".join(
            f"{form} tier counters after the runs: {st['redis_hit_chunks']} chunks hit, "
            f"{st['redis_verify_failures']} verify failures, {st['redis_errors']} errors"
            for form, st in stats.items()
        ),
    ]


# ---- b. time to first token in process B ------------------------------------------------------


def bench_ttft(
    opts: BenchOptions, model, tokenizer, model_name: str | None, url: str, tier_kwargs: dict, prefix: int,
    question: int, repeats: int,
) -> Report:  # fmt: skip
    """Process A (this one) serves one request and writes its prefix through to Redis; process B
    (a fresh interpreter) is timed. Only ids and the URL cross the process boundary."""
    from kvblocks.generate.generator import CachedGenerator

    rng = np.random.default_rng(4)
    vocab = model.config.vocab_size
    system = random_ids(rng, vocab, prefix)
    asked = random_ids(rng, vocab, question)
    earlier = random_ids(rng, vocab, question, avoid=asked[0])
    tier = RedisTier(url, **tier_kwargs)
    cache_a = KVCacheTrie.for_model(model, capacity_tokens=2 * (prefix + question), spill=tier)
    CachedGenerator(model, tokenizer, cache_a).generate(system + earlier, max_new_tokens=1)
    cache_a.close()
    written = tier.stats()["redis_written_chunks"]
    c = tier_kwargs["chunk_tokens"]
    spec = {
        "model": model_name,
        "url": url,
        "tier": tier_kwargs,
        "system": system,
        "asked": asked,
        "other": random_ids(rng, vocab, question, avoid=asked[0]),
        "expect_redis": prefix // c * c,
        "repeats": repeats,
        "opts": {
            "threads": opts.threads,
            "warmup": opts.warmup,
            "clock": opts.clock,
            "progress": opts.progress,
        },
    }
    result = run_process_b(spec)
    redis_name, device_name, none_name = result["names"]
    params = {"model": fixtures.model_name(model), "prefix_tokens": prefix, "question_tokens": question}
    params |= {"chunk_tokens": c, "from_redis": result["redis_hit"], "clock": opts.clock}
    title = "Time to first token of process B: Redis hit vs device hit vs no cache"
    report = Report("redis-ttft", title, params, result["samples"], baseline=device_name)
    redis_s, device_s = report.median(redis_name), report.median(device_name)
    report.checks = [
        Ratio("Redis hit / device hit", redis_name, device_name).check(report),
        Ratio("no cache / Redis hit (speed-up)", none_name, redis_name).check(report),
        Ratio("no cache / device hit (speed-up)", none_name, device_name).check(report),
        Check("(Redis hit - device hit) / Redis hit", (redis_s - device_s) / redis_s),
    ]
    report.notes = ttft_notes(prefix, question, c, written, result)
    return report


def run_process_b(spec: dict) -> dict:
    """Run `process_b` in a fresh interpreter: the spec and the result cross as JSON files."""
    with tempfile.TemporaryDirectory(prefix="kvblocks-bench-procb-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        done = subprocess.run([sys.executable, "-c", _PROCESS_B, str(spec_path), str(out_path)], check=False)
        if done.returncode != 0:
            raise RuntimeError(f"process B exited with {done.returncode} (its stderr is above)")
        return json.loads(out_path.read_text())


def ttft_notes(prefix: int, question: int, c: int, written: int, result: dict) -> list[str]:
    same = "the same" if len(set(result["first_tokens"].values())) == 1 else "NOT the same"
    return [
        f"process A (the bench process) served one request of the {prefix}-token prefix + another question and "
        f"wrote {written} chunks through to Redis; process B is a separate Python process "
        "with its own model load, its own tries and its own Redis connection; only token ids and the URL pass "
        "between them",
        f"Redis hit: B's spill trie is emptied (untimed `evict`) before each run, so `match` finds nothing on "
        f"the device, fetches {result['redis_hit']} tokens ({result['redis_hit'] // c} whole chunks; the chunk "
        f"holding token {prefix} also covers question tokens, so the last {prefix % c} prefix tokens are "
        "prefilled with the question), verifies and promotes them, then prefills the rest",
        f"device hit: B's second trie (no spill tier) holds the {prefix}-token prefix from an earlier request "
        f"(hit {result['device_hit']} tokens); no cache: prefill of all {prefix + question} tokens",
        "each run = what CachedGenerator does before its first token: `match`, `to_hf_cache`, prefill of the "
        f"uncached suffix (logits of the last position only), greedy choice; the first token was {same} in "
        "all three variants",
        "B's tier counters: " + ", ".join(f"{k} {v:,}" for k, v in result["tier_stats"].items()),
    ]


def process_b(spec: dict) -> dict:
    """The timed side of the TTFT benchmark, run in its own interpreter (see `bench_ttft`)."""
    from kvblocks.adapters import hf
    from kvblocks.generate.generator import CachedGenerator
    from kvblocks.generate.sampling import SamplingParams, choose

    opts = BenchOptions(**spec["opts"], plots=False)
    set_threads(opts.threads)
    model, tokenizer = fixtures.load_model(spec["model"])
    system, asked = spec["system"], spec["asked"]
    prompt = system + asked
    capacity = 4 * len(prompt)
    device = KVCacheTrie.for_model(model, capacity_tokens=capacity)
    gen = CachedGenerator(model, tokenizer, device)
    gen.generate(system + spec["other"], max_new_tokens=1)
    tier = RedisTier(spec["url"], **spec["tier"])
    spilled = KVCacheTrie.for_model(model, capacity_tokens=capacity, spill=tier)
    runner, greedy = gen.runner, SamplingParams()
    hits: dict[str, int] = {}
    first: dict[str, int] = {}

    def ttft(name: str, cache: KVCacheTrie | None):
        def go() -> None:
            if cache is None:
                first[name] = choose(runner.forward(prompt, hf.empty_cache(model.config))[-1], greedy, None)
                return
            with cache.match(prompt) as hit:
                hits[name] = hit.length
                logits = runner.forward(prompt[hit.length :], hit.to_hf_cache())[-1]
                first[name] = choose(logits, greedy, None)

        return go

    names = ("Redis hit, empty pool (process B)", "device hit (process B)", "no cache (process B)")
    variants = [
        Variant(names[0], ttft(names[0], spilled), setup=lambda: spilled.evict(capacity)),
        Variant(names[1], ttft(names[1], device)),
        Variant(names[2], ttft(names[2], None)),
    ]
    samples = measure(variants, spec["repeats"], opts, "ttft in process B")
    assert hits[names[0]] == spec["expect_redis"], (hits, spec["expect_redis"])
    assert hits[names[1]] == len(system), hits
    stats = tier.stats()
    spilled.close()
    keep = ("redis_lookups", "redis_hit_chunks", "redis_read_bytes", "redis_verify_failures", "redis_errors")
    result = {"names": names, "samples": samples, "redis_hit": hits[names[0]], "device_hit": hits[names[1]]}
    return result | {"first_tokens": first, "tier_stats": {k: stats[k] for k in keep}}


# ---- c. decode latency while spilling --------------------------------------------------------


SPILL_ON, SPILL_OFF = "spill on (write-through RedisTier)", "spill off (no tier)"


@dataclass(slots=True)
class Decode:
    """The decode benchmark's workload, and what its variants record beside the harness' run times."""

    model: object
    tokenizer: object
    rng: np.random.Generator
    system: list[int]  # the cached prefix before each run's fresh question
    source: fixtures.KVSource  # random KV of the earlier request spilled during each run
    spill: int
    tokens: int
    gaps: dict[str, list[float]] = field(default_factory=dict)  # every gap between two tokens
    per_run: dict[str, list[float]] = field(default_factory=dict)  # each run's mean gap
    flush_waits: list[float] = field(default_factory=list)

    def ids(self, n: int) -> list[int]:
        return random_ids(self.rng, self.model.config.vocab_size, n)

    def earlier_request(self, cache: KVCacheTrie) -> None:
        """An earlier request finished: its prompt and output enter the trie (and, with the tier, the
        write-through queue, which the writer thread drains while a run decodes)."""
        cache.insert(self.ids(self.spill), self.source.cache(self.spill))

    def variant(self, name: str, cache: KVCacheTrie) -> Variant:
        from kvblocks.generate.generator import CachedGenerator

        gen = CachedGenerator(self.model, self.tokenizer, cache)
        gen.generate(self.system + self.ids(16), max_new_tokens=1)
        if cache.spill is not None:
            cache.spill.flush()
        self.gaps[name], self.per_run[name] = [], []

        def go() -> None:
            prompt = self.system + self.ids(16)
            stamps = [
                time.perf_counter() for _ in gen.stream(prompt, max_new_tokens=self.tokens, ignore_eos=True)
            ]
            # a piece per token, the first right after the prefill; the last gap includes the final insert
            steps = np.diff(stamps)[:-1]
            self.gaps[name] += steps.tolist()
            self.per_run[name].append(float(steps.mean()))

        def teardown() -> None:
            if cache.spill is not None:
                t0 = time.perf_counter()
                cache.spill.flush()
                self.flush_waits.append(time.perf_counter() - t0)

        return Variant(name, go, functools.partial(self.earlier_request, cache), teardown)

    def write_through_alone(self, cache: KVCacheTrie, tier: RedisTier, runs: int = 5) -> list[float]:
        """Seconds to insert an earlier request and drain its writes, with nothing decoding."""
        out = []
        for _ in range(runs):
            t0 = time.perf_counter()
            self.earlier_request(cache)
            tier.flush()
            out.append(time.perf_counter() - t0)
        return out


def bench_decode(
    opts: BenchOptions, model, tokenizer, url: str, tier_kwargs: dict, tokens: int, prefix: int, spill: int,
    repeats: int,
) -> Report:  # fmt: skip
    from kvblocks.adapters import hf

    if tokens < 3:
        raise UserError("--decode-tokens must be at least 3")
    rng = np.random.default_rng(5)
    system = random_ids(rng, model.config.vocab_size, prefix)
    specs = hf.describe_layers(model)
    source = fixtures.KVSource(len(specs), specs[0].heads, specs[0].head_dim, spill)
    bench = Decode(model, tokenizer, rng, system, source, spill, tokens)
    capacity = 4 * (len(system) + spill + tokens + 64)
    tier = RedisTier(url, **tier_kwargs)
    caches = {
        SPILL_ON: KVCacheTrie.for_model(model, capacity_tokens=capacity, spill=tier),
        SPILL_OFF: KVCacheTrie.for_model(model, capacity_tokens=capacity),
    }
    variants = [bench.variant(name, cache) for name, cache in caches.items()]
    before = tier.stats()
    measure(variants, repeats, opts, "decode while spilling")
    stats = tier.stats()
    alone = bench.write_through_alone(caches[SPILL_ON], tier)
    for cache in caches.values():
        cache.close()
    warm = len(bench.per_run[SPILL_ON]) - repeats
    samples = {name: runs[warm:] for name, runs in bench.per_run.items()}
    steps = {name: np.asarray(g[warm * (tokens - 2) :]) for name, g in bench.gaps.items()}
    context = f"{len(system) + 16}..{len(system) + 16 + tokens}"
    params = {"model": fixtures.model_name(model), "context_tokens": context, "tokens_per_run": tokens}
    params |= {"spilled_tokens_per_run": spill, "chunk_tokens": tier_kwargs["chunk_tokens"]}
    params["clock"] = "wall (token timestamps)"
    title = "Per-token decode latency with background spilling on vs off"
    report = Report("redis-decode", title, params, samples, baseline=SPILL_OFF)
    written_mb = (stats["redis_written_bytes"] - before["redis_written_bytes"]) / MB
    report.checks = decode_checks(report, steps, written_mb / len(bench.flush_waits), alone, spill, tokens)
    report.notes = decode_notes(bench, tier_kwargs["chunk_tokens"], steps, stats)
    return report


def decode_checks(
    report: Report, steps: dict[str, np.ndarray], mb_per_run: float, alone: list[float], spill: int,
    tokens: int,
) -> list[Check]:  # fmt: skip
    p99 = {name: float(np.percentile(gaps, 99)) for name, gaps in steps.items()}
    return [
        Ratio("spill on / off, per-token latency", SPILL_ON, SPILL_OFF, 1.05).check(report),
        Ratio("spill on / off, median of per-round ratios", SPILL_ON, SPILL_OFF, paired=True).check(report),
        Check("spill on / off, p99 per-token latency", p99[SPILL_ON] / p99[SPILL_OFF]),
        Check("spilled per run", mb_per_run, "MB"),
        Check(f"write-through of {spill} tokens alone (insert + drain)", 1e3 * np.median(alone), "ms"),
        Check(
            "write-through alone / decode time of one run",
            np.median(alone) / (tokens * report.median(SPILL_ON)),
        ),
    ]


def decode_notes(bench: Decode, chunk: int, steps: dict[str, np.ndarray], stats: dict) -> list[str]:
    spill, tokens = bench.spill, bench.tokens
    return [
        f"samples are the mean gap between consecutive tokens of one `CachedGenerator.stream` run ({tokens} "
        f"tokens after a fresh 16-token question on a cached {len(bench.system)}-token prefix, ignore_eos; the "
        "last gap, which includes the insert into the trie, is left out); both tries hold the same prefix",
        f"before each run (untimed) an earlier request of {spill} tokens (random ids and KV) is "
        "inserted; with the tier, write-through queues its "
        f"{spill // chunk} chunks and the writer thread encodes and SETs them "
        f"while the run decodes: {spill / tokens:.0f}x more tokens spilled than decoded, "
        "an upper bound for a server whose requests each write their own prompt and output once",
        f"after each spill-on run the untimed teardown waits for the queue to drain: median wait "
        f"{fmt_seconds(float(np.median(bench.flush_waits)))} (0 = the writes finished inside the decode window); "
        f"tier: {stats['redis_written_chunks']} chunks written, {stats['redis_write_drops']} dropped, "
        f"{stats['redis_write_errors']} errors",
        f"pooled per-token gaps: spill on p99 {fmt_seconds(float(np.percentile(steps[SPILL_ON], 99)))}, "
        f"off p99 {fmt_seconds(float(np.percentile(steps[SPILL_OFF], 99)))}",
    ]


def process_b_main(spec_path: str, out_path: str) -> None:
    Path(out_path).write_text(json.dumps(process_b(json.loads(Path(spec_path).read_text()))))


_PROCESS_B = "import sys; from kvblocks.bench.redis import process_b_main; process_b_main(*sys.argv[1:])"
