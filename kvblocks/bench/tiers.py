"""`kvblocks bench tiers`: the spill tiers side by side (issue 44).

- ttft: time to first token of a 4k-token prefix restored from each tier (host memory, local disk,
  a real Redis started by the bench) into an empty device pool, against a device hit and against
  recomputing it, in one interleaved run on one thread;
- read: `DiskTier.get` of that prefix's records against reading the same files with plain
  sequential I/O (open, read, close: what `cat` does), from the page cache and cold (each file's
  pages dropped with `posix_fadvise(DONTNEED)` before every run), and what a write costs with
  and without fsync;
- hitrate: a workload whose working set is 10x the device pool, with the pool alone, with the
  pool and the disk tier, and with an unbounded pool;
- restart: time from a fresh process's cache (a new DiskTier over a directory that already holds
  the records, plus `--restart-files` others) to its first token from the disk.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvblocks.bench import fixtures
from kvblocks.bench.harness import (
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
)
from kvblocks.bench.redis import random_ids
from kvblocks.errors import UserError
from kvblocks.launch.redis_server import RedisServer
from kvblocks.launch.service import ServiceError
from kvblocks.spill.disk import DiskTier

BENCHMARKS = ("ttft", "read", "hitrate", "restart")
MB = 1e6
RECOMPUTE, DEVICE = "recompute (no cache)", "device hit"
TIER_HIT = "{} hit, empty pool"
DISK_GET, PLAIN_READ = "DiskTier.get", "plain sequential reads (open, read, close), bytes kept"
CAT = "plain sequential reads, each file's bytes dropped (cat)"
COLD = ", pages dropped"

OPTIONS = (
    Option("--chunk-tokens", positive_int, 64, "tokens per spill record (default 64)"),
    Group("ttft (a prefix restored from each tier vs recomputed)", ints("ttft", [
        ("prefix", 4096, "prefix tokens restored or recomputed"),
        ("question", 32, "uncached question tokens after the prefix"),
        repeats_row(3),
    ])),
    Group("read (DiskTier.get vs plain reads of the same files)", ints("read", [
        ("tokens", 4096, "tokens whose records one run reads"),
        repeats_row(20),
    ])),
    Group("hitrate (a working set 10x the device pool)", ints("hitrate", [
        ("prefixes", 40, "distinct prefixes in the working set"),
        ("prefix", 512, "tokens per prefix"),
        ("question", 64, "fresh tokens after the prefix in each request"),
        ("requests", 400, "requests, each a random prefix and a fresh question"),
        ("ratio", 10, "working set / device pool"),
    ])),
    Group("restart (a fresh cache over a directory that holds the prefix)", ints("restart", [
        ("prefix", 1024, "prefix tokens the first process wrote and the restarted one asks for"),
        ("files", 2000, "other records in the directory, rescanned at start"),
        repeats_row(5),
    ])),
)  # fmt: skip


def add_parser(suites: argparse._SubParsersAction) -> None:
    add_suite(
        suites,
        "tiers",
        run,
        help="spill tiers side by side: TTFT from each tier, disk reads, hit rate, restart",
        description="Benchmarks of the spill tiers (host memory, local disk, Redis) against recomputation "
        "and the device pool, each checked against its target.",
        model=True,
        only=BENCHMARKS,
        options=OPTIONS,
    )


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    selected = args.only or list(BENCHMARKS)
    c = int(args.chunk_tokens)
    reports: list[Report] = []
    with tempfile.TemporaryDirectory(prefix="kvblocks-bench-tiers-", dir=_bench_dir()) as tmp:
        workdir = Path(tmp)
        if {"ttft", "read", "restart"} & set(selected):
            model, tokenizer = fixtures.load_model(args.model)
        if "ttft" in selected:
            reports.append(bench_ttft(opts, model, tokenizer, workdir, c, **prefixed(args, "ttft")))
        if "read" in selected:
            shape = layer_shape(model)
            reports.append(bench_read(opts, workdir / "read", shape, c, **prefixed(args, "read")))
        if "hitrate" in selected:
            reports.append(bench_hitrate(workdir / "hitrate", c, **prefixed(args, "hitrate")))
        if "restart" in selected:
            restart = prefixed(args, "restart")
            reports.append(bench_restart(opts, model, tokenizer, workdir / "restart", c, **restart))
    return reports


def _bench_dir() -> str | None:
    """Where the disk tier's files go: $KVBLOCKS_BENCH_DIR (put it on the disk to measure), else /tmp."""
    return os.environ.get("KVBLOCKS_BENCH_DIR") or None


def layer_shape(model) -> tuple[int, int, int]:
    from kvblocks.adapters import hf

    specs = hf.describe_layers(model)
    return len(specs), specs[0].heads, specs[0].head_dim


# ---- a. time to first token from each tier -----------------------------------------------------


def bench_ttft(
    opts: BenchOptions, model, tokenizer, workdir: Path, c: int, prefix: int, question: int, repeats: int
) -> Report:
    """One trie per tier, each with only that tier below an empty pool, all holding the prefix; a
    device trie holding it in the pool; recomputation. Every run ends at the first greedy token."""
    from kvblocks.adapters import hf
    from kvblocks.adapters.hf_trie import KVCacheTrie
    from kvblocks.generate.generator import CachedGenerator
    from kvblocks.generate.sampling import SamplingParams, choose
    from kvblocks.spill.host import HostTier
    from kvblocks.spill.redis_tier import redis_store
    from kvblocks.spill.stack import TierStack

    rng = np.random.default_rng(44)
    vocab = model.config.vocab_size
    system = random_ids(rng, vocab, prefix)
    prompt = system + random_ids(rng, vocab, question)
    capacity = 2 * len(prompt) + c
    gen_kv = KVCacheTrie.for_model(model, capacity_tokens=capacity)
    runner, greedy = CachedGenerator(model, tokenizer, gen_kv).runner, SamplingParams()
    try:
        server = RedisServer(workdir / "redis").start()
    except ServiceError as exc:
        raise UserError(str(exc)) from exc
    with server:
        tiers = {
            "host memory": HostTier(64 << 30),
            "disk": DiskTier(workdir / "disk", 64 << 30, read_budget_s=30.0),
            "Redis": redis_store(server.url, ttl_s=3600.0, timeout_s=30.0, fetch_timeout_s=30.0),
        }
        # The prefix is computed once, in the device trie; each tier's trie gets a copy of its KV
        # (inserted, so written through to its tier), as if it had served the prefix itself.
        CachedGenerator(model, tokenizer, gen_kv).generate(
            system + random_ids(rng, vocab, 8), max_new_tokens=1
        )
        tries = {}
        for label, tier in tiers.items():
            trie = KVCacheTrie.for_model(
                model, capacity_tokens=capacity, spill=TierStack([tier], chunk_tokens=c)
            )
            with gen_kv.match([*system, 0]) as hit:
                assert hit.length == len(system), hit.length
                trie.insert(system, hit.to_hf_cache())
            trie.spill.flush()
            tries[TIER_HIT.format(label)] = trie
        hits: dict[str, int] = {}
        first: dict[str, int] = {}

        def ttft(name: str, cache) -> Callable[[], None]:
            def go() -> None:
                if cache is None:
                    first[name] = choose(
                        runner.forward(prompt, hf.empty_cache(model.config))[-1], greedy, None
                    )
                    return
                with cache.match(prompt) as hit:
                    hits[name] = hit.length
                    first[name] = choose(
                        runner.forward(prompt[hit.length :], hit.to_hf_cache())[-1], greedy, None
                    )

            return go

        variants = [Variant(RECOMPUTE, ttft(RECOMPUTE, None)), Variant(DEVICE, ttft(DEVICE, gen_kv))]
        variants += [
            Variant(name, ttft(name, trie), setup=lambda trie=trie: trie.evict(capacity))
            for name, trie in tries.items()
        ]
        samples = measure(variants, repeats, opts, "ttft per tier")
        stats = {name: trie.spill.stats() for name, trie in tries.items()}
        for trie in (*tries.values(), gen_kv):
            trie.close()
    expect = prefix // c * c
    missed = {name: n for name, n in hits.items() if name != DEVICE and n != expect}
    if missed:
        raise RuntimeError(f"a tier restored fewer tokens than the {expect} it holds: {missed}")
    params = fixtures.model_params(model) | {"prefix_tokens": prefix, "question_tokens": question}
    params |= {"chunk_tokens": c, "restored_tokens": expect, "clock": opts.clock}
    report = Report("tiers-ttft", "Time to first token: a prefix restored from each tier vs recomputed",
                    params, samples, baseline=RECOMPUTE)  # fmt: skip
    disk = TIER_HIT.format("disk")
    report.checks = [
        Ratio("disk hit / recompute, TTFT", disk, RECOMPUTE, 0.3).check(report),
        *(
            Ratio(f"{name} / recompute, TTFT", name, RECOMPUTE).check(report)
            for name in tries
            if name != disk
        ),
        Ratio("device hit / recompute, TTFT", DEVICE, RECOMPUTE).check(report),
        Ratio("disk hit / device hit, TTFT", disk, DEVICE).check(report),
    ]
    same = "the same" if len(set(first.values())) == 1 else "NOT the same"
    report.notes = [
        f"the {prefix}-token prefix is computed once (in the device trie) and its KV inserted into each "
        f"tier's trie, which writes it through to its one tier ({expect // c} records of {c} tokens); that "
        "trie is emptied (untimed `evict`) before each run, so `match` restores all "
        f"{expect} tokens from that tier (read, open or verify the record, promote into the pool) and the "
        f"rest ({len(prompt) - expect} tokens) is prefilled",
        f"device hit: the prefix is resident in the pool; recompute: prefill of all {len(prompt)} tokens; "
        f"a run ends at the first greedy token, which was {same} in every variant",
        "host memory is a tier of its own here (on a CPU server it is off by default: the pool is host "
        "memory already); Redis is a private redis-server on 127.0.0.1 TCP started by the bench, read with "
        "a 30 s reply timeout (the server's is 0.25 s: on a loaded machine 4k tokens of records can take "
        "longer, and the bench measures the read, not the budget), and the disk tier with a 30 s read "
        "budget for the same reason (the server's is 0.5 s); the disk "
        f"tier's files are under {_bench_dir() or tempfile.gettempdir()} (set KVBLOCKS_BENCH_DIR to place them)",
        "tier counters: "
        + "; ".join(
            f"{name}: "
            + ", ".join(f"{k} {v:,}" for k, v in s.items() if k.endswith(("hit_chunks", "verify_failures")))
            for name, s in stats.items()
        ),
    ]
    return report


# ---- b. disk reads vs plain sequential reads ----------------------------------------------------


def bench_read(
    opts: BenchOptions, root: Path, shape: tuple[int, int, int], c: int, tokens: int, repeats: int
) -> Report:
    """Records the size a sealed fp32 chunk of this layout takes, read through the tier and as files."""
    layers, heads, head_dim = shape
    record = c * layers * 2 * heads * head_dim * 4 + 4 * c + 64  # KV, sealed token ids, framing
    n = max(1, tokens // c)
    rng = np.random.default_rng(7)
    keys = [f"kvblocks:bench:{i:06d}" for i in range(n)]
    values = [rng.bytes(record) for _ in range(n)]
    write_s = {}
    for fsync in (False, True):
        tier = DiskTier(root / f"fsync-{fsync}", 64 << 30, fsync=fsync)
        t0 = time.perf_counter()
        for key, value in zip(keys, values):
            tier.put([(key, value)])
        write_s[fsync] = time.perf_counter() - t0
    # the read budget (0.5 s, the server's) would cut a cold run on a loaded machine: the bench
    # measures the read, not the budget
    tier = DiskTier(root / "fsync-False", 64 << 30, read_budget_s=60.0)
    paths = [tier.path(k) for k in keys]  # the tier's own files, read as a plain reader would
    limits = [record] * n

    def get() -> None:
        got = tier.get(keys, limits)
        assert all(v is not None and len(v) == record for v in got)

    def plain() -> None:
        kept = []
        for path in paths:
            with open(path, "rb") as f:
                kept.append(f.read())

    def cat() -> None:
        for path in paths:
            with open(path, "rb") as f:
                f.read()

    def drop() -> None:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

    variants = [
        Variant(DISK_GET, get),
        Variant(PLAIN_READ, plain),
        Variant(CAT, cat),
        Variant(DISK_GET + COLD, get, setup=drop),
        Variant(PLAIN_READ + COLD, plain, setup=drop),
    ]
    samples = measure(variants, repeats, opts, "disk reads")
    nbytes = sum(p.stat().st_size for p in paths)
    params = {"layout": f"{layers} layers x {heads} KV heads x head_dim {head_dim} fp32", "records": n}
    params |= {"record_bytes": record, "MB_per_run": round(nbytes / MB, 1), "clock": opts.clock}
    report = Report("tiers-read", "Disk tier reads vs plain sequential reads of the same files", params,
                    samples, baseline=PLAIN_READ)  # fmt: skip
    report.checks = [
        Ratio("DiskTier.get / plain reads, throughput", PLAIN_READ, DISK_GET, 0.7, True).check(report),
        Ratio(
            "cold: DiskTier.get / plain reads, throughput", PLAIN_READ + COLD, DISK_GET + COLD, 0.7, True
        ).check(report),
        Ratio("DiskTier.get / cat-like reads, throughput", CAT, DISK_GET, higher_is_better=True).check(
            report
        ),
        Check("DiskTier.get throughput", nbytes / report.median(DISK_GET) / 1e9, "GB/s"),
        Check("cold: DiskTier.get throughput", nbytes / report.median(DISK_GET + COLD) / 1e9, "GB/s"),
        Check("write per record, no fsync", 1e3 * write_s[False] / n, "ms"),
        Check("write per record, fsync", 1e3 * write_s[True] / n, "ms"),
        Check("fsync / no fsync, write time", write_s[True] / write_s[False]),
    ]
    report.notes = [
        f"{n} records of {record:,} bytes (a sealed fp32 chunk of {c} tokens of this layout), random bytes; "
        "DiskTier.get opens every file of the run and asks for its read-ahead (WILLNEED), then reads each "
        "file's frame and key, checks them and reads the value into the bytes it returns (the value's "
        "checksum or seal is the codec's, outside this timing; recency is kept in memory, the mtimes "
        "written at most every 10 s); plain = open, read to the end, close, the same files in the "
        "same order, keeping every file's bytes as the tier hands back every record of the run; cat = the "
        "same reads dropping each file's bytes before the next (its buffer is reused, so its pages are never "
        "faulted in afresh: most of the gap to it is the kernel zeroing the run's fresh memory, which any "
        "reader that keeps the bytes pays)",
        "cold: before every run (untimed) each file's pages are dropped from the page cache with "
        "posix_fadvise(DONTNEED), so both read from the device",
        "writes: one `put` per record into an empty directory (temporary file, write, rename), timed once "
        "each without and with fsync before the rename",
    ]
    return report


# ---- c. hit rate with a working set 10x the pool ------------------------------------------------


def bench_hitrate(
    root: Path, c: int, prefixes: int, prefix: int, question: int, requests: int, ratio: int
) -> Report:
    """Requests draw a prefix at random and add a fresh question; the hit rate is cached prompt tokens
    over prompt tokens, counted after every prefix was seen once. A tiny layout (1 layer, 1 head) keeps
    it about the policy, not the model."""
    from kvblocks.spill.stack import TierStack

    rng = np.random.default_rng(11)
    heads = [rng.integers(1000, 30000, prefix) for _ in range(prefixes)]
    stream = [*range(prefixes), *rng.integers(0, prefixes, requests)]  # every prefix once, then counted
    asked = [rng.integers(1000, 30000, question) for _ in stream]
    working = prefixes * (prefix + question)
    pool = max(c, working // ratio)
    source = fixtures.KVSource(1, 1, 8, prefix + question)

    def hit_rate(capacity: int, spill=None) -> tuple[float, dict]:
        trie = fixtures.layout_trie(1, 1, 8, capacity, spill=spill)
        hit = total = 0
        for n, (i, question_ids) in enumerate(zip(stream, asked)):
            ids = np.concatenate([heads[i], question_ids])
            with trie.match(ids) as h:
                found = h.length
            trie.insert(ids, source.cache(len(ids)))
            if spill is not None:
                spill.flush()
            if n >= prefixes:
                hit, total = hit + found, total + len(ids)
        stats = spill.stats() if spill is not None else {}
        trie.close()
        return hit / total, stats

    device, _ = hit_rate(pool)
    disk, stats = hit_rate(pool, TierStack([DiskTier(root, 64 << 30)], chunk_tokens=c))
    unbounded, _ = hit_rate(2 * working)
    params = {
        "prefixes": prefixes,
        "prefix_tokens": prefix,
        "question_tokens": question,
        "requests": requests,
    }
    params |= {"working_set_tokens": working, "pool_tokens": pool, "chunk_tokens": c}
    report = Report("tiers-hitrate", f"Hit rate with a working set {ratio}x the device pool", params)
    report.checks = [
        Check("hit rate, pool alone", device),
        Check("hit rate, pool + disk tier", disk),
        Check("hit rate, unbounded pool", unbounded),
        Check("pool + disk / unbounded pool, hit rate", disk / unbounded, target=0.9, higher_is_better=True),
        Check("pool alone / unbounded pool, hit rate", device / unbounded),
    ]
    report.notes = [
        f"{prefixes} random prefixes of {prefix} tokens; each request is one of them (uniformly at random) "
        f"plus {question} fresh tokens, so a request can hit at most {prefix / (prefix + question):.3f} of "
        "its prompt; every prefix is requested once before counting starts",
        f"the pool holds {pool} tokens ({working / pool:.0f}x less than the working set); the disk tier is "
        f"larger than the working set and written through (the writer drained after each request); a hit "
        f"from disk restores whole chunks of {c} tokens, so up to {c - 1} tokens of a prefix are recomputed",
        "disk tier counters: "
        + ", ".join(f"{k} {v:,}" for k, v in stats.items() if k.startswith("disk_") and v),
    ]
    return report


# ---- d. time to the first warm hit after a restart -----------------------------------------------


def bench_restart(
    opts: BenchOptions, model, tokenizer, root: Path, c: int, prefix: int, files: int, repeats: int
) -> Report:
    """A cache's first token after a restart: a new DiskTier (its start rescans the directory), a new
    stack and trie, and the first request's match from the disk and prefill of its question."""
    from kvblocks.adapters import hf
    from kvblocks.adapters.hf_trie import KVCacheTrie
    from kvblocks.generate.generator import CachedGenerator
    from kvblocks.generate.sampling import SamplingParams, choose
    from kvblocks.spill.stack import TierStack

    rng = np.random.default_rng(12)
    vocab = model.config.vocab_size
    system = random_ids(rng, vocab, prefix)
    prompt = system + random_ids(rng, vocab, 32)
    capacity = 2 * len(prompt) + c
    first = KVCacheTrie.for_model(
        model, capacity_tokens=capacity, spill=TierStack([DiskTier(root, 64 << 30)], chunk_tokens=c)
    )
    gen = CachedGenerator(model, tokenizer, first)
    gen.generate(system + random_ids(rng, vocab, 8), max_new_tokens=1)
    first.close()
    other = DiskTier(root, 64 << 30)
    for i in range(files):
        other.put([(f"kvblocks:restart-bench:{i}", rng.bytes(4096))])
    runner, greedy = gen.runner, SamplingParams()
    hits: list[int] = []

    def restart_and_ask() -> None:
        trie = KVCacheTrie.for_model(
            model,
            capacity_tokens=capacity,
            spill=TierStack([DiskTier(root, 64 << 30, read_budget_s=30.0)], chunk_tokens=c),
        )
        with trie.match(prompt) as hit:
            hits.append(hit.length)
            choose(runner.forward(prompt[hit.length :], hit.to_hf_cache())[-1], greedy, None)
        trie.close()

    def recompute() -> None:
        choose(runner.forward(prompt, hf.empty_cache(model.config))[-1], greedy, None)

    samples = measure(
        [Variant("restart: new cache + first warm hit", restart_and_ask), Variant(RECOMPUTE, recompute)],
        repeats,
        opts,
        "restart",
    )
    assert set(hits) == {len(system) // c * c}, hits
    start = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        DiskTier(root, 64 << 30)
        start.append(time.perf_counter() - t0)
    params = fixtures.model_params(model) | {"prefix_tokens": len(system), "other_files": files}
    report = Report("tiers-restart", "Time to the first warm hit after a restart", params, samples,
                    baseline=RECOMPUTE)  # fmt: skip
    report.checks = [
        Check("restart to first token from disk", report.median("restart: new cache + first warm hit"), "s"),
        Check(f"DiskTier start (rescan of {files + len(system) // c} files)", float(np.median(start)), "s"),
        Ratio("restart + first warm hit / recompute", "restart: new cache + first warm hit", RECOMPUTE).check(
            report
        ),
    ]
    report.notes = [
        f"a process wrote a {len(system)}-token prefix through to a disk tier and closed; {files} other "
        "records of 4 KB share the directory; each run builds a new DiskTier (which lists and stats the "
        "directory; a 30 s read budget, as in ttft), stack and trie (the model stays loaded: its load time is the same with or without the "
        "tier) and asks the prefix plus 32 new tokens, up to the first greedy token",
        f"DiskTier start alone: median {fmt_seconds(float(np.median(start)))} over {repeats} starts",
    ]
    return report
