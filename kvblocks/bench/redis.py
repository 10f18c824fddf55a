"""`kvblocks bench redis`: the Redis spill tier against its targets.

- restore: `RedisTier.fetch` of N chunks (pipelined EXISTS and GET, verify, decode, to device)
  as a throughput ratio to a raw pipelined redis-py GET of the same keys, without and with a
  secret (sealed records), side by side in one run;
- ttft: time to first token in "process B", a second process with its own copy of the model and
  an empty pool that finds a 1,000-token prefix process A (this one) wrote to Redis, against no
  cache and against a device hit;
- decode: per-token decode latency while the tier spills in the background, against no tier.

The suite starts a private redis-server unless `--redis URL` names a running one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kvblocks.bench import fixtures
from kvblocks.bench.harness import (
    SMOLLM2_KV_SHAPE,
    BenchOptions,
    Check,
    Report,
    Variant,
    add_suite,
    fmt_seconds,
    int_options,
    measure,
    positive_int,
    set_threads,
)
from kvblocks.errors import UserError

BENCHMARKS = ("restore", "ttft", "decode")
MB = 1e6
# The restore benchmark's sealed tier: a fixed bench-only secret (>= 16 bytes), never a deployment's.
BENCH_SECRET = b"kvblocks-bench-restore-secret-0001"


def add_parser(suites: argparse._SubParsersAction) -> None:
    p = add_suite(
        suites,
        "redis",
        run,
        help="Redis spill tier: restore throughput, time to first token from Redis, decode while spilling",
        description="Benchmarks of the Redis spill tier (RedisTier), each checked against its target.",
        model=True,
        only=BENCHMARKS,
    )
    p.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help="use this running Redis (keys get a unique prefix and a 1 h TTL) instead of a private redis-server",
    )
    p.add_argument(
        "--chunk-tokens", type=positive_int, default=64, help="tokens per Redis chunk (default 64)"
    )
    r = p.add_argument_group("restore (fetch throughput vs raw GET; the layout defaults to SmolLM2's)")
    int_options(
        r,
        "restore",
        [
            ("tokens", 1024, "tokens fetched per run"),
            *SMOLLM2_KV_SHAPE,
            ("repeats", 60, "timed runs per variant"),
        ],
    )
    t = p.add_argument_group("ttft (process B restoring a shared prefix from Redis)")
    int_options(
        t,
        "ttft",
        [
            ("prefix", 1000, "shared prefix tokens"),
            ("question", 30, "uncached question tokens"),
            ("repeats", 8, "timed runs per variant"),
        ],
    )
    d = p.add_argument_group("decode (per-token latency with background spilling)")
    int_options(
        d,
        "decode",
        [
            ("tokens", 32, "tokens generated per run"),
            ("prefix", 1000, "cached prefix before each question"),
            ("spill", 512, "tokens of an earlier request spilled in the background during each run"),
            ("repeats", 10, "timed runs per variant"),
        ],
    )


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    selected = args.only or list(BENCHMARKS)
    reports: list[Report] = []
    with (
        tempfile.TemporaryDirectory(prefix="kvblocks-bench-redis-") as tmp,
        redis_url(args.redis, Path(tmp)) as (
            url,
            tier_kwargs,
        ),
    ):
        tier_kwargs["chunk_tokens"] = args.chunk_tokens
        if "restore" in selected:
            reports.append(
                bench_restore(
                    opts,
                    url,
                    tier_kwargs,
                    args.restore_tokens,
                    (args.restore_layers, args.restore_heads, args.restore_head_dim),
                    args.restore_repeats,
                )
            )
        if "ttft" in selected or "decode" in selected:
            model, tokenizer = fixtures.load_model(args.model)
            if "ttft" in selected:
                reports.append(
                    bench_ttft(
                        opts,
                        model,
                        tokenizer,
                        args.model,
                        url,
                        tier_kwargs,
                        args.ttft_prefix,
                        args.ttft_question,
                        args.ttft_repeats,
                    )
                )
            if "decode" in selected:
                reports.append(
                    bench_decode(
                        opts,
                        model,
                        tokenizer,
                        url,
                        tier_kwargs,
                        args.decode_prefix,
                        args.decode_tokens,
                        args.decode_spill,
                        args.decode_repeats,
                    )
                )
    return reports


@contextmanager
def redis_url(external: str | None, workdir: Path) -> Iterator[tuple[str, dict]]:
    """(URL, RedisTier keywords): a private server, or a running one with a unique key prefix and TTL."""
    if external:
        yield external, {"key_prefix": f"kvblocks-bench-{uuid.uuid4().hex[:8]}", "ttl_s": 3600.0}
        return
    try:
        server = fixtures.RedisServer(workdir / "redis").start()
    except fixtures.ServiceError as exc:
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


def layout_trie(layers: int, heads: int, head_dim: int, capacity: int, spill=None):
    """A KVCacheTrie with a model's KV layout but no model (random KV is inserted by hand)."""
    import torch
    from transformers import LlamaConfig

    from kvblocks.adapters.hf_trie import KVCacheTrie
    from kvblocks.cache.layout import LayerSpec
    from kvblocks.cache.namespace import Namespace

    config = LlamaConfig(
        hidden_size=heads * head_dim,
        head_dim=head_dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=4 * heads * head_dim,
    )
    specs = [LayerSpec("full", heads, head_dim)] * layers
    ns = Namespace("bench-layout", "float32")
    return KVCacheTrie(
        config, specs, ns, capacity_tokens=capacity, dtype=torch.float32, device="cpu", spill=spill
    )


# ---- a. restore throughput -------------------------------------------------------------------


def bench_restore(
    opts: BenchOptions, url: str, tier_kwargs: dict, tokens: int, shape: tuple[int, int, int], repeats: int
) -> Report:
    """Plain and sealed tiers hold the same KV under their own keys; a third plain tier reads with
    redis-py's pure-Python reply parser instead of hiredis; all eight variants interleave."""
    import redis
    from redis._parsers import _RESP2Parser
    from redis.utils import HIREDIS_AVAILABLE

    from kvblocks.bench.micro import KVSource
    from kvblocks.spill.redis_tier import RedisTier

    layers, heads, head_dim = shape
    c = tier_kwargs["chunk_tokens"]
    tokens = tokens // c * c
    if tokens == 0:
        raise UserError(f"--restore-tokens must be at least one chunk ({c} tokens)")
    rng = np.random.default_rng(3)
    ids = np.asarray(random_ids(rng, 32_000, tokens + 1))
    source = KVSource(layers, heads, head_dim, tokens)
    if not HIREDIS_AVAILABLE:
        raise UserError(
            "the restore benchmark compares hiredis with the pure-Python parser: pip install hiredis"
        )
    pure = {"parser_class": _RESP2Parser}
    raw = redis.Redis.from_url(url)
    raw_pure = redis.Redis.from_url(url, **pure)
    sides = {}
    for form, secret in (("plain", None), ("sealed", BENCH_SECRET)):
        tier = RedisTier(url, **tier_kwargs, secret=secret)
        trie = layout_trie(layers, heads, head_dim, tokens, spill=tier)
        ns_key = trie.namespace.key
        trie.insert(ids[:tokens], source.cache(tokens))
        tier.flush()
        written = tier.stats()["redis_written_chunks"]
        assert written == tokens // c, f"{form}: write-through stored {written} of {tokens // c} chunks"
        keys = [tier.key(ns_key, h) for h in tier.codec.chunk_hashes(ns_key, ids[:tokens], c)]
        nbytes = sum(len(v) for v in raw.mget(keys))
        sides[form] = (tier, trie, ns_key, keys, nbytes)

    # the same records as the plain side (same namespace), read through a client without hiredis
    pure_tier = RedisTier(url, **tier_kwargs, client_options=pure)
    pure_trie = layout_trie(layers, heads, head_dim, tokens, spill=pure_tier)
    plain_ns, plain_keys = sides["plain"][2], sides["plain"][3]
    assert pure_trie.namespace.key == plain_ns

    def raw_get(keys: list[str], client=raw):
        def go() -> None:
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            values = pipe.execute()
            assert all(v is not None for v in values)

        return go

    def fetch(tier, ns_key: str):
        def go() -> None:
            got = tier.fetch(ns_key, ids, 0, tokens)
            assert got is not None and got.length == tokens, got

        return go

    def promote(trie):
        def go() -> None:
            with trie.match(ids) as hit:
                assert hit.length == tokens, hit

        return go

    names = {
        "plain": (
            "raw GET (redis-py pipeline)",
            "RedisTier.fetch (EXISTS+GET, verify, decode)",
            "match on an empty pool (fetch + promote into the pool)",
        ),
        "sealed": (
            "raw GET of the sealed records",
            "RedisTier.fetch with secret (EXISTS+GET, open, verify, decode)",
            "match on an empty pool, with secret",
        ),
    }
    pure_raw_name = "raw GET, pure-Python reply parser"
    pure_fetch_name = "RedisTier.fetch, pure-Python reply parser"
    variants = [
        Variant(pure_raw_name, raw_get(plain_keys, raw_pure)),
        Variant(pure_fetch_name, fetch(pure_tier, plain_ns)),
    ]
    for form, (tier, trie, ns_key, keys, _) in sides.items():
        raw_name, fetch_name, match_name = names[form]
        variants += [
            Variant(raw_name, raw_get(keys)),
            Variant(fetch_name, fetch(tier, ns_key)),
            Variant(match_name, promote(trie), setup=lambda trie=trie: trie.evict(tokens)),
        ]
    samples = measure(variants, repeats, opts, "redis restore")
    stats = {form: side[0].stats() for form, side in sides.items()}
    for _, trie, *_ in sides.values():
        trie.close()
    pure_trie.close()
    raw.close()
    raw_pure.close()
    nbytes = {form: side[4] for form, side in sides.items()}
    (raw_name, fetch_name, match_name), (sraw_name, sfetch_name, smatch_name) = names.values()
    report = Report(
        "redis-restore",
        "Restore throughput from Redis vs raw GET, without and with a secret",
        {
            "tokens": tokens,
            "chunks": tokens // c,
            "chunk_tokens": c,
            "layout": f"{layers} layers x {heads} KV heads x head_dim {head_dim} fp32",
            "MB_per_run": round(nbytes["plain"] / MB, 1),
            "sealed_MB_per_run": round(nbytes["sealed"] / MB, 1),
            "redis": "private redis-server, TCP 127.0.0.1" if not tier_kwargs.get("ttl_s") else url,
            "clock": opts.clock,
        },
        samples,
        baseline=raw_name,
    )
    form_of = {name: form for form, triple in names.items() for name in triple}
    pures = (pure_raw_name, pure_fetch_name)
    bw = {name: nbytes[form_of[name]] / report.median(name) / 1e9 for name in samples if name in form_of}
    bw[pure_raw_name], bw[pure_fetch_name] = (nbytes["plain"] / report.median(n) / 1e9 for n in pures)
    report.checks = [
        Check(
            "fetch time, hiredis / pure-Python reply parser",
            report.ratio(fetch_name, pure_fetch_name),
            target=0.6,
        ),
        Check("raw GET time, hiredis / pure-Python reply parser", report.ratio(raw_name, pure_raw_name)),
        Check("pure-Python parser: fetch / raw GET throughput", report.ratio(pure_raw_name, pure_fetch_name)),
        Check("raw GET throughput", bw[raw_name], "GB/s"),
        Check("RedisTier.fetch throughput", bw[fetch_name], "GB/s"),
        Check("fetch + promote throughput", bw[match_name], "GB/s"),
        Check("sealed: raw GET throughput", bw[sraw_name], "GB/s"),
        Check("sealed: RedisTier.fetch throughput", bw[sfetch_name], "GB/s"),
        Check("sealed: fetch + promote throughput", bw[smatch_name], "GB/s"),
        Check(
            "fetch / raw GET throughput",
            report.ratio(raw_name, fetch_name),
            target=0.6,
            higher_is_better=True,
        ),
        Check(
            "fetch / raw GET throughput, median of per-round ratios",
            report.paired_ratio(raw_name, fetch_name),
        ),
        Check(
            "sealed fetch / raw GET of the sealed records",
            report.ratio(sraw_name, sfetch_name),
            target=0.6,
            higher_is_better=True,
        ),
        Check(
            "sealed fetch / raw GET of the sealed records, median of per-round ratios",
            report.paired_ratio(sraw_name, sfetch_name),
        ),
        Check(
            "sealed fetch / fetch without secret (tokens/s)",
            report.ratio(fetch_name, sfetch_name),
            target=0.9,
            higher_is_better=True,
        ),
        Check(
            "sealed fetch / fetch without secret, median of per-round ratios",
            report.paired_ratio(fetch_name, sfetch_name),
        ),
        Check("fetch + promote / raw GET throughput", report.ratio(raw_name, match_name)),
        Check(
            "sealed fetch + promote / fetch + promote without secret", report.ratio(match_name, smatch_name)
        ),
    ]
    report.notes = [
        f"{tokens // c} chunks of {c} tokens written by write-through (`KVCacheTrie.insert` of random KV, then "
        f"`flush`) twice, the same KV through a tier without and a tier with a secret (their keys differ); "
        f"{nbytes['plain'] / MB:.2f} MB of plain records per run ({nbytes['plain'] / tokens:,.0f} B per token, "
        f"KV + framing), {nbytes['sealed'] / MB:.2f} MB sealed ({nbytes['sealed'] / tokens:,.0f} B per token)",
        "raw GET = one redis-py pipeline of GETs of the same keys returning bytes (no parsing); fetch = what a "
        "device miss runs: chain hashes, a pipelined EXISTS, a pipelined GET, per chunk msgpack unpack, "
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
    return report


# ---- b. time to first token in process B ------------------------------------------------------


def bench_ttft(
    opts: BenchOptions,
    model,
    tokenizer,
    model_name: str | None,
    url: str,
    tier_kwargs: dict,
    prefix: int,
    question: int,
    repeats: int,
) -> Report:
    """Process A (this one) serves one request and writes its prefix through to Redis; process B
    (a fresh interpreter) is timed. Only ids and the URL cross the process boundary."""
    from kvblocks.adapters.hf_trie import KVCacheTrie
    from kvblocks.generate.generator import CachedGenerator
    from kvblocks.spill.redis_tier import RedisTier

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
    with tempfile.TemporaryDirectory(prefix="kvblocks-bench-procb-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        done = subprocess.run([sys.executable, "-c", _PROCESS_B, str(spec_path), str(out_path)], check=False)
        if done.returncode != 0:
            raise RuntimeError(f"process B exited with {done.returncode} (its stderr is above)")
        result = json.loads(out_path.read_text())
    samples = result["samples"]
    redis_name, device_name, none_name = result["names"]
    name = getattr(model.config, "name_or_path", "") or model.config.model_type
    report = Report(
        "redis-ttft",
        "Time to first token of process B: Redis hit vs device hit vs no cache",
        {
            "model": name,
            "prefix_tokens": prefix,
            "question_tokens": question,
            "chunk_tokens": c,
            "from_redis": result["redis_hit"],
            "clock": opts.clock,
        },
        samples,
        baseline=device_name,
    )
    report.checks = [
        Check("Redis hit / device hit", report.ratio(redis_name, device_name)),
        Check("no cache / Redis hit (speed-up)", report.ratio(none_name, redis_name)),
        Check("no cache / device hit (speed-up)", report.ratio(none_name, device_name)),
        Check(
            "(Redis hit - device hit) / Redis hit",
            (report.median(redis_name) - report.median(device_name)) / report.median(redis_name),
        ),
    ]
    same = "the same" if len(set(result["first_tokens"].values())) == 1 else "NOT the same"
    report.notes = [
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
    return report


def process_b(spec: dict) -> dict:
    """The timed side of the TTFT benchmark, run in its own interpreter (see `bench_ttft`)."""
    from kvblocks.adapters import hf
    from kvblocks.adapters.hf_trie import KVCacheTrie
    from kvblocks.generate.generator import CachedGenerator
    from kvblocks.generate.sampling import SamplingParams, choose
    from kvblocks.spill.redis_tier import RedisTier

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
    samples = measure(
        [
            Variant(names[0], ttft(names[0], spilled), setup=lambda: spilled.evict(capacity)),
            Variant(names[1], ttft(names[1], device)),
            Variant(names[2], ttft(names[2], None)),
        ],
        spec["repeats"],
        opts,
        "ttft in process B",
    )
    assert hits[names[0]] == spec["expect_redis"], (hits, spec["expect_redis"])
    assert hits[names[1]] == len(system), hits
    stats = tier.stats()
    spilled.close()
    keep = ("redis_lookups", "redis_hit_chunks", "redis_read_bytes", "redis_verify_failures", "redis_errors")
    return {
        "names": names,
        "samples": samples,
        "redis_hit": hits[names[0]],
        "device_hit": hits[names[1]],
        "first_tokens": first,
        "tier_stats": {k: stats[k] for k in keep},
    }


# ---- c. decode latency while spilling --------------------------------------------------------


def bench_decode(
    opts: BenchOptions,
    model,
    tokenizer,
    url: str,
    tier_kwargs: dict,
    prefix: int,
    new_tokens: int,
    spill_tokens: int,
    repeats: int,
) -> Report:
    from kvblocks.adapters import hf
    from kvblocks.adapters.hf_trie import KVCacheTrie
    from kvblocks.bench.micro import KVSource
    from kvblocks.generate.generator import CachedGenerator
    from kvblocks.spill.redis_tier import RedisTier

    if new_tokens < 3:
        raise UserError("--decode-tokens must be at least 3")
    rng = np.random.default_rng(5)
    vocab = model.config.vocab_size
    system = random_ids(rng, vocab, prefix)
    specs = hf.describe_layers(model)
    source = KVSource(len(specs), specs[0].heads, specs[0].head_dim, spill_tokens)
    capacity = 4 * (len(system) + spill_tokens + new_tokens + 64)
    tier = RedisTier(url, **tier_kwargs)
    caches = {
        "spill on (write-through RedisTier)": KVCacheTrie.for_model(
            model, capacity_tokens=capacity, spill=tier
        ),
        "spill off (no tier)": KVCacheTrie.for_model(model, capacity_tokens=capacity),
    }
    gaps: dict[str, list[float]] = {name: [] for name in caches}
    per_run: dict[str, list[float]] = {name: [] for name in caches}
    flush_waits: list[float] = []

    def variant(name: str, cache: KVCacheTrie) -> Variant:
        gen = CachedGenerator(model, tokenizer, cache)
        gen.generate(system + random_ids(rng, vocab, 16), max_new_tokens=1)
        if cache.spill is not None:
            cache.spill.flush()

        def setup() -> None:
            """An earlier request finished: its prompt and output enter the trie (and, with the tier, the
            write-through queue, which the writer thread drains while this run decodes)."""
            cache.insert(random_ids(rng, vocab, spill_tokens), source.cache(spill_tokens))

        def go() -> None:
            stamps = []
            for _ in gen.stream(
                system + random_ids(rng, vocab, 16), max_new_tokens=new_tokens, ignore_eos=True
            ):
                stamps.append(time.perf_counter())
            # a piece per token, the first right after the prefill; the last gap includes the final insert
            steps = np.diff(stamps)[:-1]
            gaps[name] += steps.tolist()
            per_run[name].append(float(steps.mean()))

        def teardown() -> None:
            if cache.spill is not None:
                t0 = time.perf_counter()
                cache.spill.flush()
                flush_waits.append(time.perf_counter() - t0)

        return Variant(name, go, setup, teardown)

    variants = [variant(name, cache) for name, cache in caches.items()]
    before = tier.stats()
    measure(variants, repeats, opts, "decode while spilling")
    stats = tier.stats()
    on, off = caches
    spill_alone = []
    for _ in range(5):
        t0 = time.perf_counter()
        caches[on].insert(random_ids(rng, vocab, spill_tokens), source.cache(spill_tokens))
        tier.flush()
        spill_alone.append(time.perf_counter() - t0)
    for cache in caches.values():
        cache.close()
    warm = len(per_run[on]) - repeats
    samples = {name: runs[warm:] for name, runs in per_run.items()}
    steps = {name: np.asarray(g[warm * (new_tokens - 2) :]) for name, g in gaps.items()}
    name = getattr(model.config, "name_or_path", "") or model.config.model_type
    report = Report(
        "redis-decode",
        "Per-token decode latency with background spilling on vs off",
        {
            "model": name,
            "context_tokens": f"{len(system) + 16}..{len(system) + 16 + new_tokens}",
            "tokens_per_run": new_tokens,
            "spilled_tokens_per_run": spill_tokens,
            "chunk_tokens": tier_kwargs["chunk_tokens"],
            "clock": "wall (token timestamps)",
        },
        samples,
        baseline=off,
    )
    mb_per_run = (stats["redis_written_bytes"] - before["redis_written_bytes"]) / MB / len(flush_waits)
    window = new_tokens * report.median(on)
    report.checks = [
        Check("spill on / off, per-token latency", report.ratio(on, off), "", 1.05),
        Check("spill on / off, median of per-round ratios", report.paired_ratio(on, off)),
        Check(
            "spill on / off, p99 per-token latency",
            float(np.percentile(steps[on], 99) / np.percentile(steps[off], 99)),
        ),
        Check("spilled per run", mb_per_run, "MB"),
        Check(
            f"write-through of {spill_tokens} tokens alone (insert + drain)",
            1e3 * np.median(spill_alone),
            "ms",
        ),
        Check("write-through alone / decode time of one run", np.median(spill_alone) / window),
    ]
    report.notes = [
        f"samples are the mean gap between consecutive tokens of one `CachedGenerator.stream` run ({new_tokens} "
        f"tokens after a fresh 16-token question on a cached {prefix}-token prefix, ignore_eos; the "
        "last gap, which includes the insert into the trie, is left out); both tries hold the same prefix",
        f"before each run (untimed) an earlier request of {spill_tokens} tokens (random ids and KV) is "
        "inserted; with the tier, write-through queues its "
        f"{spill_tokens // tier_kwargs['chunk_tokens']} chunks and the writer thread encodes and SETs them "
        f"while the run decodes: {spill_tokens / new_tokens:.0f}x more tokens spilled than decoded, "
        "an upper bound for a server whose requests each write their own prompt and output once",
        f"after each spill-on run the untimed teardown waits for the queue to drain: median wait "
        f"{fmt_seconds(float(np.median(flush_waits)))} (0 = the writes finished inside the decode window); "
        f"tier: {stats['redis_written_chunks']} chunks written, {stats['redis_write_drops']} dropped, "
        f"{stats['redis_write_errors']} errors",
        f"pooled per-token gaps: spill on p99 {fmt_seconds(float(np.percentile(steps[on], 99)))}, "
        f"off p99 {fmt_seconds(float(np.percentile(steps[off], 99)))}",
    ]
    return report


def process_b_main(spec_path: str, out_path: str) -> None:
    Path(out_path).write_text(json.dumps(process_b(json.loads(Path(spec_path).read_text()))))


_PROCESS_B = "import sys; from kvblocks.bench.redis import process_b_main; process_b_main(*sys.argv[1:])"
