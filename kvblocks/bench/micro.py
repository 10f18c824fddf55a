"""`kvblocks bench micro`: the core costs against their targets.

- gather: re-attach bandwidth (pool gather of fragmented slots) as a ratio to `clone()` of the
  same bytes;
- trie: `match` and `insert` latency for a 4k-token prompt with 1M tokens resident;
- memory: bookkeeping bytes per cached token beyond the KV itself (same trie, tracemalloc);
- ttft: time to first token on the real model with a cached system prompt, against the ideal
  (the bare model on a prebuilt cache) and against no cache;
- fingerprint: `model_fingerprint` of the real model (config + every parameter and buffer, xxh3-128),
  the namespace every cache computes once at start, right after a load and with warm weights.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

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
    ints,
    measure,
    prefixed,
    progress,
    repeats_row,
)
from kvblocks.cache.layout import KVLayout
from kvblocks.cache.pool import KVPool
from kvblocks.cache.radix import SLOT_DTYPE, TOKEN_DTYPE
from kvblocks.errors import UserError

BENCHMARKS = ("gather", "trie", "ttft", "fingerprint")
GB = 1e9


OPTIONS = (
    Group("gather (re-attach bandwidth; the layout defaults to SmolLM2's)", ints("gather", [
        ("tokens", 1024, "tokens gathered per run"),
        ("capacity", 8192, "pool capacity in tokens"),
        *SMOLLM2_KV_SHAPE,
        repeats_row(60),
    ])),
    Group("trie (match/insert latency and metadata bytes)", (
        *ints("trie", [
            ("resident", 1_000_000, "resident tokens"),
            ("prompt", 4096, "prompt tokens per op"),
            ("new", 128, "uncached tail of the mostly-hit prompt"),
            ("layers", 1, "layers of the tiny KV layout"),
            ("head-dim", 4, "head dim of the tiny layout"),
            repeats_row(40),
        ]),
        Option("--trie-fill", float, 3.0,
               "tokens inserted before measuring, as a multiple of --trie-resident "
               "(default 3: steady state)"),
    )),
    Group("ttft (time to first token on the --model)", ints("ttft", [
        ("cached", 1000, "cached system prompt tokens"),
        ("question", 30, "uncached question tokens"),
        repeats_row(15, "timed runs of kvblocks and ideal"),
        ("nocache-repeats", 5, "timed runs of kvblocks and no cache, the slow full prefill"),
    ])),
    Group("fingerprint (model_fingerprint of the --model above)", ints("fingerprint", [repeats_row(7)])),
)  # fmt: skip


def add_parser(suites: argparse._SubParsersAction) -> None:
    add_suite(
        suites,
        "micro",
        run,
        help="core costs vs targets: gather bandwidth, trie latency and memory, time to first token, "
        "model fingerprint",
        description="Core micro-benchmarks of kvblocks, each checked against its target ('--only trie' "
        "includes memory).",
        model=True,
        only=BENCHMARKS,
        options=OPTIONS,
    )


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    selected = args.only or list(BENCHMARKS)
    reports: list[Report] = []
    if "gather" in selected:
        reports.append(bench_gather(opts, **prefixed(args, "gather")))
    if "trie" in selected:
        reports += bench_trie(opts, **prefixed(args, "trie"))
    if "ttft" in selected or "fingerprint" in selected:
        model, tokenizer = fixtures.load_model(args.model)
    if "ttft" in selected:
        reports.append(bench_ttft(opts, model, tokenizer, **prefixed(args, "ttft")))
    if "fingerprint" in selected:
        reports.append(bench_fingerprint(opts, model, args.model, **prefixed(args, "fingerprint")))
    return reports


# ---- a. gather bandwidth -------------------------------------------------------------------


def fragment(pool: KVPool, rng: np.random.Generator, rounds: int) -> None:
    """Churn the pool the way a trie does: inserts of varied length, LRU-ish whole and tail evictions."""
    live: list[np.ndarray] = []
    top = max(2, min(512, pool.capacity // 4))
    for _ in range(rounds):
        size = int(rng.integers(min(16, top - 1), top))
        while pool.num_free < size:
            victim = live.pop(int(rng.integers(len(live))))
            if len(victim) > 32 and rng.random() < 0.3:
                cut = int(rng.integers(1, len(victim)))
                pool.release(victim[cut:])
                live.append(victim[:cut])
            else:
                pool.release(victim)
        live.append(pool.alloc(size))
    for chunk in live:
        pool.release(chunk)


def slot_runs(slots: np.ndarray) -> int:
    """How many maximal runs of consecutive slot numbers `slots` is made of."""
    return int(np.count_nonzero(np.diff(slots) != 1)) + 1 if len(slots) else 0


CLONE, GATHER = "clone (contiguous)", "gather (fragmented slots)"
GATHER_CONTIGUOUS = "gather (contiguous slots)"


def bench_gather(
    opts: BenchOptions, tokens: int, capacity: int, layers: int, heads: int, head_dim: int, repeats: int
) -> Report:
    if tokens > capacity:
        raise UserError(f"--gather-tokens ({tokens}) must not exceed --gather-capacity ({capacity})")
    shapes = [(heads, head_dim)] * layers
    pool = KVPool(KVLayout.from_shapes(torch.float32, shapes), capacity, "cpu")
    everything = pool.index(np.arange(capacity))
    for layer in range(layers):
        pool.scatter(layer, everything, *(torch.randn(capacity, heads, head_dim) for _ in "kv"))
    fragment(pool, np.random.default_rng(0), rounds=4 * capacity // 264)
    slots = pool.alloc(tokens)
    sources = [torch.randn(tokens, 2, heads, head_dim) for _ in range(layers)]
    sink: list[torch.Tensor] = []

    def gather(slot_ids: np.ndarray):
        def go() -> None:
            index = pool.index(slot_ids)
            sink[:] = [pool.gather(layer, index) for layer in range(layers)]

        return go

    def clone() -> None:
        sink[:] = [s.clone() for s in sources]

    contiguous = np.arange(tokens, dtype=slots.dtype)
    variants = [Variant(CLONE, clone), Variant(GATHER, gather(slots))]
    variants.append(Variant(GATHER_CONTIGUOUS, gather(contiguous)))
    samples = measure(variants, repeats, opts, "gather")
    nbytes = tokens * pool.token_bytes
    params = {"tokens": tokens, "capacity": capacity, "layers": layers, "heads": heads, "head_dim": head_dim}
    params |= {"dtype": "float32", "MB_per_run": round(nbytes / 1e6, 1)}
    report = Report("micro-gather", "Re-attach gather bandwidth", params, samples, baseline=CLONE)
    bw = {name: nbytes / report.median(name) / GB for name in samples}
    report.checks = [
        Check("clone bandwidth", bw[CLONE], "GB/s"),
        Check("gather bandwidth, fragmented slots", bw[GATHER], "GB/s"),
        Check("gather bandwidth, contiguous slots", bw[GATHER_CONTIGUOUS], "GB/s"),
        Ratio("gather / clone bandwidth (fragmented)", CLONE, GATHER, 0.7, True).check(report),
    ]
    runs = slot_runs(slots)
    report.notes = [
        f"fragmented slots: {runs} runs of consecutive slots, {tokens / runs:.1f} tokens per run on average, "
        "after churning the pool with inserts of 16-511 tokens and whole/tail evictions",
        "bandwidth = bytes of KV delivered per second (every layer's [tokens, 2, H, D]); "
        "each gather run includes building the slot index, as `Hit.to_hf_cache` does",
    ]
    return report


# ---- b./c. trie latency and metadata bytes -------------------------------------------------


def chat_histories(
    rng: np.random.Generator, vocab: int, max_len: int, systems: int = 32
) -> Iterator[np.ndarray]:
    """Endless token histories shaped like chat/agent traffic, one per finished request.

    Conversations start from a few popular system prompts (200-2000 tokens, Zipf-like popularity)
    and grow turn by turn (about 3 turns on average, user 16-255 + reply 32-511 tokens each); a
    quarter of them branch off an earlier conversation at a random point (an edit, a regenerated
    reply, an agent retrying a tool call).
    """
    prompts = [rng.integers(0, vocab, int(rng.integers(200, 2000)), dtype=np.int32) for _ in range(systems)]
    popularity = 1.0 / np.arange(1, systems + 1)
    popularity /= popularity.sum()
    finished: list[np.ndarray] = []
    while True:
        if finished and rng.random() < 0.25:
            base = finished[int(rng.integers(len(finished)))]
            history = base[: int(rng.integers(len(base) // 2, len(base)))]
        else:
            history = prompts[int(rng.choice(systems, p=popularity))]
        for _ in range(min(int(rng.geometric(0.35)), 12)):
            turn = rng.integers(0, vocab, int(rng.integers(16, 256) + rng.integers(32, 512)), dtype=np.int32)
            if len(history) + len(turn) > max_len:
                break
            history = np.concatenate([history, turn])
            yield history
        finished = [*finished[-63:], history]


def metadata_bytes(snapshot: tracemalloc.Snapshot) -> dict[str, int]:
    """Live bytes allocated from kvblocks' own modules (the benchmark excluded), per file."""
    package = Path(__file__).resolve().parents[1]
    roots = (str(package), str(package.parent / "adapters"))
    bench = str(package / "bench")
    out: dict[str, int] = {}
    for stat in snapshot.statistics("filename"):
        name = stat.traceback[0].filename
        if name.startswith(roots) and not name.startswith(bench):
            out[Path(name).name] = out.get(Path(name).name, 0) + stat.size
    return out


@dataclass(slots=True)
class TrieBench:
    """A full, evicting trie of chat traffic, and the random ids and KV the timed operations feed it."""

    trie: KVCacheTrie
    source: fixtures.KVSource
    rng: np.random.Generator
    vocab: int
    probe: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # a resident history
    branch: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def fill(self, traffic: Iterator[np.ndarray], target: int, prompt: int, show: bool) -> int:
        """Insert chat histories until `target` tokens went in, then a probe of at least `prompt` tokens."""
        inserted = 0
        with progress(target, "fill trie", show) as bar:
            while inserted < target:
                ids = next(traffic)
                stored = self.trie.insert(ids, self.source.cache(len(ids)))
                inserted += stored
                bar.update(stored)
        probe = next(traffic)
        while len(probe) < prompt:
            self.trie.insert(probe, self.source.cache(len(probe)))
            probe = np.concatenate([probe, self.rng.integers(0, self.vocab, 400, dtype=np.int32)])
        self.trie.insert(probe, self.source.cache(len(probe)))
        self.probe = probe
        return inserted

    def fresh(self, n: int, after: int | None = None) -> np.ndarray:
        """Random ids; with `after`, the first differs from `after` and from every earlier branch."""
        ids = self.rng.integers(0, self.vocab, n, dtype=np.int32)
        if after is not None:
            ids[0] = (after + next(self.branch)) % self.vocab
        return ids

    def branch_off(self, cut: int, new: int) -> np.ndarray:
        """The probe's first `cut` tokens, then `new` tokens never seen after them."""
        return np.concatenate([self.probe[:cut], self.fresh(new, int(self.probe[cut]))])

    def insert(self, name: str, make_ids: Callable[[], np.ndarray], stores: int, room: bool) -> Variant:
        """Untimed: fresh ids and their cache (and room in the pool when `room`); timed: the insert."""
        pending: list[tuple[np.ndarray, object]] = []

        def setup() -> None:
            ids = make_ids()
            if room:
                self.trie.evict(stores)
            pending.append((ids, self.source.cache(len(ids))))

        def go() -> None:
            ids, past = pending.pop()
            stored = self.trie.insert(ids, past)
            assert stored == stores, (name, stored, stores)

        return Variant(name, go, setup)


def bench_trie(
    opts: BenchOptions, resident: int, prompt: int, new: int, layers: int, head_dim: int, repeats: int,
    fill: float = 3.0,
) -> list[Report]:  # fmt: skip
    if new >= prompt:
        raise UserError(f"--trie-new ({new}) must be smaller than --trie-prompt ({prompt})")
    if fill < 1.0:
        raise UserError(f"--trie-fill must be >= 1 so the pool is full and evicting, got {fill}")
    rng = np.random.default_rng(1)
    vocab, max_len = 32_000, max(8192, 2 * prompt)
    source = fixtures.KVSource(layers, 1, head_dim, max_len)
    gc.collect()
    tracemalloc.start()
    bench = TrieBench(fixtures.layout_trie(layers, 1, head_dim, resident), source, rng, vocab)
    trie = bench.trie
    inserted = bench.fill(chat_histories(rng, vocab, max_len), int(resident * fill), prompt, opts.progress)
    gc.collect()
    snapshot = tracemalloc.take_snapshot()
    tracemalloc.stop()
    before = trie.stats()
    memory = memory_report(metadata_bytes(snapshot), before, layers, head_dim)
    cut = prompt - new
    hit_prompt = bench.branch_off(cut, new)
    with trie.match(hit_prompt) as hit:
        assert hit.length == cut, (hit.length, cut)
    variants = [
        Variant(f"match+release ({cut} of {prompt} hit)", lambda: trie.match(hit_prompt).release()),
        bench.insert(f"insert fully new ({prompt})", lambda: bench.fresh(prompt), prompt, room=True),
        bench.insert(
            f"insert mostly shared ({new} new of {prompt})", lambda: bench.branch_off(cut, new), new, True
        ),
        bench.insert(f"insert fully new, evicting {prompt}", lambda: bench.fresh(prompt), prompt, room=False),
    ]
    samples = measure(variants, repeats, opts, "trie ops")
    after = trie.stats()
    params = {"resident_tokens": before["resident_tokens"], "capacity_tokens": before["capacity_tokens"]}
    params |= {"prompt_tokens": prompt, "layout": f"{layers} layer x 1 head x head_dim {head_dim} fp32"}
    latency = Report("micro-trie", "Trie match/insert latency", params, samples)
    latency.checks = [Check(f"{name}, median", latency.median(name) * 1e3, "ms", 1.0) for name in samples]
    latency.checks += [
        Check(f"{name}, p99", float(np.percentile(runs, 99)) * 1e3, "ms") for name, runs in samples.items()
    ]
    latency.notes = [
        f"tiny KV layout ({layers} layer, 1 KV head, head_dim {head_dim}: {trie.token_bytes} B of KV per token) so "
        f"{resident:,} resident tokens fit in memory; match/insert cost does not depend on the KV size except "
        "for the scatter of new tokens",
        f"filled with {inserted:,} tokens of chat traffic (32 system prompts, multi-turn, 25% branches) into a "
        f"pool of {resident:,} tokens, so it is full and evicting: {before['nodes']:,} nodes before the runs, "
        f"{after['nodes']:,} after ({after['resident_tokens']:,} resident)",
        "'insert fully new' / 'mostly shared' get room made by an untimed `evict` first; "
        "the 'evicting' variant pays for LRU eviction inside `insert`",
    ]
    return [latency, memory]


def memory_report(by_file: dict[str, int], stats: dict[str, int], layers: int, head_dim: int) -> Report:
    resident = stats["resident_tokens"]
    total = sum(by_file.values())
    params = {
        "resident_tokens": resident,
        "capacity_tokens": stats["capacity_tokens"],
        "nodes": stats["nodes"],
    }
    params["layout"] = f"{layers} layer x 1 head x head_dim {head_dim} fp32"
    report = Report("micro-memory", "Metadata bytes per cached token", params)
    report.checks = [Check("bookkeeping bytes per resident token", total / resident, "B", 16.0)]
    big = {name: size for name, size in by_file.items() if size / resident >= 0.01}
    report.checks += [
        Check(f"of which allocated in {name}", size / resident, "B")
        for name, size in sorted(big.items(), key=lambda kv: -kv[1])
    ]
    if len(big) < len(by_file):
        report.checks.append(
            Check("of which elsewhere in kvblocks", (total - sum(big.values())) / resident, "B")
        )
    report.notes = [
        "tracemalloc over the fill of the trie of the latency benchmark (same trie): live Python and numpy "
        "allocations made by kvblocks code (tree nodes, child dicts, token and slot arrays, the pool's free "
        "list, any other bookkeeping the trie keeps), divided by resident tokens; the KV tensors themselves "
        "(torch allocator) are not counted",
        f"{total:,} bytes for {resident:,} tokens in {stats['nodes']:,} nodes",
    ]
    nodes = stats["nodes"]
    ids_per_token = np.dtype(TOKEN_DTYPE).itemsize + np.dtype(SLOT_DTYPE).itemsize
    if nodes and "radix.py" in by_file:
        per_node = (by_file["radix.py"] - ids_per_token * resident) / nodes
        report.notes.append(
            f"the tree costs {ids_per_token} B per token (token and slot ids) + about {per_node:,.0f} B per node "
            f"(here {resident / nodes:,.0f} tokens per node, so {per_node * nodes / resident:.2f} B per token)"
        )
    return report


# ---- d. time to first token ----------------------------------------------------------------


TTFT_IDEAL, TTFT_KV = "ideal (bare model, prebuilt cache)", "kvblocks (match, to_hf_cache, prefill)"
TTFT_NONE, TTFT_KV_BESIDE = "no cache (full prefill)", "kvblocks, measured beside no cache"
TTFT_TARGETS = (
    Ratio("kvblocks / ideal", TTFT_KV, TTFT_IDEAL, 1.10),
    Ratio("kvblocks / ideal, median of per-round ratios", TTFT_KV, TTFT_IDEAL, paired=True),
    Ratio("no cache / kvblocks (speed-up)", TTFT_NONE, TTFT_KV_BESIDE),
)


def bench_ttft(
    opts: BenchOptions, model, tokenizer, cached: int, question: int, repeats: int, nocache_repeats: int
) -> Report:
    from kvblocks.adapters import hf
    from kvblocks.generate.generator import CachedGenerator
    from kvblocks.generate.sampling import SamplingParams, choose

    rng = np.random.default_rng(2)
    vocab = model.config.vocab_size
    low = min(256, vocab // 2)  # skip the low ids, where tokenizers keep their special tokens
    system = rng.integers(low, vocab, cached).tolist()
    asked = rng.integers(low, vocab, question).tolist()
    earlier = [low + (asked[0] + 1 - low) % (vocab - low), *asked[1:]]
    prompt = system + asked
    cache = KVCacheTrie.for_model(model, capacity_tokens=2 * (cached + question))
    gen = CachedGenerator(model, tokenizer, cache)
    gen.generate(system + earlier, max_new_tokens=1)  # an earlier request cached the system prompt
    runner, greedy = gen.runner, SamplingParams()
    ideal_past = hf.empty_cache(model.config)
    runner.forward(system, ideal_past)

    def with_kvblocks() -> None:
        with cache.match(prompt) as hit:
            assert hit.length == cached, (hit.length, cached)
            choose(runner.forward(prompt[hit.length :], hit.to_hf_cache())[-1], greedy, None)

    def ideal() -> None:
        choose(runner.forward(asked, ideal_past)[-1], greedy, None)

    def no_cache() -> None:
        choose(runner.forward(prompt, hf.empty_cache(model.config))[-1], greedy, None)

    ideal_variant = Variant(TTFT_IDEAL, ideal, teardown=lambda: hf.crop(ideal_past, cached))
    samples = measure([ideal_variant, Variant(TTFT_KV, with_kvblocks)], repeats, opts, "ttft vs ideal")
    beside = [Variant(TTFT_KV_BESIDE, with_kvblocks), Variant(TTFT_NONE, no_cache)]
    samples |= measure(beside, nocache_repeats, opts, "ttft vs no cache")
    params = {**fixtures.model_params(model), "cached_tokens": cached, "question_tokens": question}
    title = "Time to first token with a cached system prompt"
    report = Report("micro-ttft", title, params | {"clock": opts.clock}, samples, baseline=TTFT_IDEAL)
    report.checks = [r.check(report) for r in TTFT_TARGETS]
    report.notes = [
        f"random fixed-seed token ids; an earlier request (through `CachedGenerator`) cached the {cached}-token "
        "system prompt with another question, so every kvblocks run hits exactly the system prompt",
        "kvblocks = the steps `CachedGenerator` takes before its first token: `match`, `to_hf_cache` (one gather "
        "per layer), prefill of the question, greedy choice; ideal = the same `ModelRunner.forward` "
        "(logits_to_keep=1) on a DynamicCache already holding the system prompt, cropped back after each run "
        "(untimed); no cache = prefill of all tokens",
        "kvblocks is compared with the ideal in one interleaved run and with no cache in another (fewer runs: "
        "a full prefill is slow), so the target ratio comes from a process that, like a server full of hits, "
        "only re-attaches; the gather's cost depends on the allocator (fresh pages fault in), see BENCHMARKS.md",
    ]
    return report


# ---- e. model fingerprint ------------------------------------------------------------------


FP_COLD, FP_WARM = "model_fingerprint right after a load", "model_fingerprint, weights warm"
FP_BARE = "bare xxh3-128 of the same tensors' bytes"


def bench_fingerprint(opts: BenchOptions, model, model_name: str | None, repeats: int) -> Report:
    """`model_fingerprint` as every `KVCacheTrie.for_model` pays it once: right after a load (the
    weights' pages not yet touched by this process) and again with warm weights; beside it, bare
    xxh3-128 over the same tensors' bytes, the floor any full-weight hash pays."""
    import xxhash

    from kvblocks.cache.namespace import model_fingerprint

    tensors = [t.detach() for _, t in [*model.named_parameters(), *model.named_buffers()]]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    fresh: list = []
    seen: set[str] = set()

    def load() -> None:
        fresh[:] = [fixtures.load_model(model_name)[0]]

    def after_load() -> None:
        seen.add(model_fingerprint(fresh[0]))

    def warm() -> None:
        seen.add(model_fingerprint(model))

    def bare() -> None:
        h = xxhash.xxh3_128()
        for t in tensors:
            h.update(t.reshape(-1).view(torch.uint8).numpy())

    variants = [Variant(FP_COLD, after_load, setup=load, teardown=fresh.clear), Variant(FP_WARM, warm)]
    variants.append(Variant(FP_BARE, bare))
    samples = measure(variants, repeats, opts, "fingerprint")
    assert len(seen) == 1, f"model_fingerprint is not deterministic: {sorted(seen)}"
    params = {**fixtures.model_params(model), "tensors": len(tensors), "MB_hashed": round(nbytes / 1e6, 1)}
    title = "Model fingerprint (namespace) time"
    report = Report("micro-fingerprint", title, params | {"clock": opts.clock}, samples, baseline=FP_BARE)
    report.checks = [
        Check(f"{FP_COLD}, median", report.median(FP_COLD), "s", 0.5),
        Check(f"{FP_WARM}, median", report.median(FP_WARM), "s", 0.5),
        Check(f"{FP_WARM}, p99", float(np.percentile(samples[FP_WARM], 99)), "s"),
        Check("fingerprint hash throughput, weights warm", nbytes / report.median(FP_WARM) / GB, "GB/s"),
        Ratio("model_fingerprint / bare xxh3-128, weights warm", FP_WARM, FP_BARE).check(report),
    ]
    report.notes = [
        f"`kvblocks.cache.namespace.model_fingerprint`: the config (JSON) and every parameter and buffer ({len(tensors)} "
        f"tensors, {nbytes / 1e6:,.1f} MB) with its name, dtype and shape, streamed through xxh3-128; the "
        f"result was the same in every run ({next(iter(seen))})",
        "'right after a load': the model is loaded again (untimed setup, `kvblocks.models.load`, as "
        "`kvblocks serve` does) and fingerprinted once, before anything else reads its weights; 'weights "
        "warm': the same model every time; bare = xxh3-128 `update` over the same tensors' bytes, nothing else",
    ]
    return report
