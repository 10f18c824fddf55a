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
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from kvblocks.bench import fixtures
from kvblocks.bench.harness import (
    SMOLLM2_KV_SHAPE,
    BenchOptions,
    Check,
    Report,
    Variant,
    add_suite,
    int_options,
    measure,
    progress,
)
from kvblocks.cache.layout import KVLayout, LayerSpec
from kvblocks.cache.pool import KVPool
from kvblocks.cache.radix import SLOT_DTYPE, TOKEN_DTYPE
from kvblocks.errors import UserError

BENCHMARKS = ("gather", "trie", "ttft", "fingerprint")
GB = 1e9


def add_parser(suites: argparse._SubParsersAction) -> None:
    p = add_suite(
        suites,
        "micro",
        run,
        help="core costs vs targets: gather bandwidth, trie latency and memory, time to first token, "
        "model fingerprint",
        description="Core micro-benchmarks of kvblocks, each checked against its target ('--only trie' "
        "includes memory).",
        model=True,
        only=BENCHMARKS,
    )
    g = p.add_argument_group("gather (re-attach bandwidth; the layout defaults to SmolLM2's)")
    int_options(
        g,
        "gather",
        [
            ("tokens", 1024, "tokens gathered per run"),
            ("capacity", 8192, "pool capacity in tokens"),
            *SMOLLM2_KV_SHAPE,
            ("repeats", 60, "timed runs per variant"),
        ],
    )
    t = p.add_argument_group("trie (match/insert latency and metadata bytes)")
    int_options(
        t,
        "trie",
        [
            ("resident", 1_000_000, "resident tokens"),
            ("prompt", 4096, "prompt tokens per op"),
            ("new", 128, "uncached tail of the mostly-hit prompt"),
            ("layers", 1, "layers of the tiny KV layout"),
            ("head-dim", 4, "head dim of the tiny layout"),
            ("repeats", 40, "timed runs per variant"),
        ],
    )
    t.add_argument(
        "--trie-fill",
        type=float,
        default=3.0,
        help="tokens inserted before measuring, as a multiple of --trie-resident (default 3: steady state)",
    )
    m = p.add_argument_group("ttft (time to first token on the --model)")
    int_options(
        m,
        "ttft",
        [
            ("cached", 1000, "cached system prompt tokens"),
            ("question", 30, "uncached question tokens"),
            ("repeats", 15, "timed runs of kvblocks and ideal"),
            ("nocache-repeats", 5, "timed runs of kvblocks and no cache, the slow full prefill"),
        ],
    )
    f = p.add_argument_group("fingerprint (model_fingerprint of the --model above)")
    int_options(f, "fingerprint", [("repeats", 7, "timed runs per variant")])


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    selected = args.only or list(BENCHMARKS)
    reports: list[Report] = []
    if "gather" in selected:
        shape = (args.gather_heads, args.gather_head_dim)
        reports.append(
            bench_gather(
                opts,
                args.gather_tokens,
                args.gather_capacity,
                [shape] * args.gather_layers,
                args.gather_repeats,
            )
        )
    if "trie" in selected:
        reports += bench_trie(
            opts,
            args.trie_resident,
            args.trie_prompt,
            args.trie_new,
            args.trie_layers,
            args.trie_head_dim,
            args.trie_repeats,
            args.trie_fill,
        )
    if "ttft" in selected or "fingerprint" in selected:
        model, tokenizer = fixtures.load_model(args.model)
    if "ttft" in selected:
        reports.append(
            bench_ttft(
                opts,
                model,
                tokenizer,
                args.ttft_cached,
                args.ttft_question,
                args.ttft_repeats,
                args.ttft_nocache_repeats,
            )
        )
    if "fingerprint" in selected:
        reports.append(bench_fingerprint(opts, model, args.model, args.fingerprint_repeats))
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


def bench_gather(
    opts: BenchOptions, tokens: int, capacity: int, shapes: list[tuple[int, int]], repeats: int
) -> Report:
    if tokens > capacity:
        raise UserError(f"--gather-tokens ({tokens}) must not exceed --gather-capacity ({capacity})")
    rng = np.random.default_rng(0)
    pool = KVPool(KVLayout.from_shapes(torch.float32, shapes), capacity, "cpu")
    everything = pool.index(np.arange(capacity))
    for layer, (heads, dim) in enumerate(shapes):
        pool.scatter(layer, everything, torch.randn(capacity, heads, dim), torch.randn(capacity, heads, dim))
    fragment(pool, rng, rounds=4 * capacity // 264)
    slots = pool.alloc(tokens)
    contiguous = np.arange(tokens, dtype=slots.dtype)
    sources = [torch.randn(tokens, 2, heads, dim) for heads, dim in shapes]
    nbytes = tokens * pool.token_bytes
    sink: list[torch.Tensor] = []

    def gather(slot_ids: np.ndarray):
        def go() -> None:
            index = pool.index(slot_ids)
            sink[:] = [pool.gather(layer, index) for layer in range(len(shapes))]

        return go

    def clone() -> None:
        sink[:] = [s.clone() for s in sources]

    variants = [
        Variant("clone (contiguous)", clone),
        Variant("gather (fragmented slots)", gather(slots)),
        Variant("gather (contiguous slots)", gather(contiguous)),
    ]
    samples = measure(variants, repeats, opts, "gather")
    report = Report(
        "micro-gather",
        "Re-attach gather bandwidth",
        {
            "tokens": tokens,
            "capacity": capacity,
            "layers": len(shapes),
            "heads": shapes[0][0],
            "head_dim": shapes[0][1],
            "dtype": "float32",
            "MB_per_run": round(nbytes / 1e6, 1),
        },
        samples,
        baseline="clone (contiguous)",
    )
    bw = {name: nbytes / report.median(name) / GB for name in samples}
    report.checks = [
        Check("clone bandwidth", bw["clone (contiguous)"], "GB/s"),
        Check("gather bandwidth, fragmented slots", bw["gather (fragmented slots)"], "GB/s"),
        Check("gather bandwidth, contiguous slots", bw["gather (contiguous slots)"], "GB/s"),
        Check(
            "gather / clone bandwidth (fragmented)",
            report.ratio("clone (contiguous)", "gather (fragmented slots)"),
            target=0.7,
            higher_is_better=True,
        ),
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


class KVSource:
    """Random KV for up to `max_len` positions, handed out as transformers caches for `insert`."""

    def __init__(self, layers: int, heads: int, head_dim: int, max_len: int) -> None:
        self.kv = [
            (torch.randn(1, heads, max_len, head_dim), torch.randn(1, heads, max_len, head_dim))
            for _ in range(layers)
        ]

    def cache(self, length: int):
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=[(k[:, :, :length], v[:, :, :length]) for k, v in self.kv])


def tiny_trie(capacity: int, layers: int, head_dim: int):
    """A KVCacheTrie over a tiny 1-head layout (no model), so a million tokens fit in a few MB of KV."""
    from transformers import LlamaConfig

    from kvblocks.adapters.hf_trie import KVCacheTrie
    from kvblocks.cache.namespace import Namespace

    config = LlamaConfig(
        hidden_size=head_dim,
        head_dim=head_dim,
        num_hidden_layers=layers,
        num_attention_heads=1,
        num_key_value_heads=1,
        intermediate_size=4 * head_dim,
    )
    specs = [LayerSpec("full", 1, head_dim)] * layers
    ns = Namespace("bench-tiny", "float32")
    return KVCacheTrie(config, specs, ns, capacity_tokens=capacity, dtype=torch.float32, device="cpu")


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


def bench_trie(
    opts: BenchOptions,
    resident: int,
    prompt: int,
    new: int,
    layers: int,
    head_dim: int,
    repeats: int,
    fill: float = 3.0,
) -> list[Report]:
    if new >= prompt:
        raise UserError(f"--trie-new ({new}) must be smaller than --trie-prompt ({prompt})")
    if fill < 1.0:
        raise UserError(f"--trie-fill must be >= 1 so the pool is full and evicting, got {fill}")
    rng = np.random.default_rng(1)
    vocab, max_len = 32_000, max(8192, 2 * prompt)
    source = KVSource(layers, 1, head_dim, max_len)

    gc.collect()
    tracemalloc.start()
    trie = tiny_trie(resident, layers, head_dim)
    traffic = chat_histories(rng, vocab, max_len)
    inserted, target = 0, int(resident * fill)
    with progress(target, "fill trie", opts.progress) as bar:
        while inserted < target:
            ids = next(traffic)
            stored = trie.insert(ids, source.cache(len(ids)))
            inserted += stored
            bar.update(stored)
    probe = next(traffic)
    while len(probe) < prompt:
        trie.insert(probe, source.cache(len(probe)))
        probe = np.concatenate([probe, rng.integers(0, vocab, 400, dtype=np.int32)])
    trie.insert(probe, source.cache(len(probe)))
    gc.collect()
    snapshot = tracemalloc.take_snapshot()
    tracemalloc.stop()
    before = trie.stats()
    memory = memory_report(metadata_bytes(snapshot), before, layers, head_dim)

    cut = prompt - new

    branch = itertools.count(1)

    def fresh(n: int, after: int | None = None) -> np.ndarray:
        """Random ids; with `after`, the first differs from `after` and from every earlier branch."""
        ids = rng.integers(0, vocab, n, dtype=np.int32)
        if after is not None:
            ids[0] = (after + next(branch)) % vocab
        return ids

    hit_prompt = np.concatenate([probe[:cut], fresh(new, int(probe[cut]))])
    pending: dict[str, tuple[np.ndarray, object]] = {}

    with trie.match(hit_prompt) as hit:
        assert hit.length == cut, (hit.length, cut)

    def do_match() -> None:
        trie.match(hit_prompt).release()

    def prepare(name: str, make_ids, stores: int, room: bool):
        """Untimed: fresh ids and their cache (and room in the pool when `room`); timed: the insert."""

        def setup() -> None:
            ids = make_ids()
            if room:
                trie.evict(stores)
            pending[name] = (ids, source.cache(len(ids)))

        def go() -> None:
            ids, past = pending.pop(name)
            stored = trie.insert(ids, past)
            assert stored == stores, (name, stored, stores)

        return setup, go

    new_setup, new_run = prepare("new", lambda: fresh(prompt), prompt, room=True)
    shared_setup, shared_run = prepare(
        "shared", lambda: np.concatenate([probe[:cut], fresh(new, int(probe[cut]))]), new, room=True
    )
    evict_setup, evict_run = prepare("evict", lambda: fresh(prompt), prompt, room=False)
    variants = [
        Variant(f"match+release ({cut} of {prompt} hit)", do_match),
        Variant(f"insert fully new ({prompt})", new_run, new_setup),
        Variant(f"insert mostly shared ({new} new of {prompt})", shared_run, shared_setup),
        Variant(f"insert fully new, evicting {prompt}", evict_run, evict_setup),
    ]
    samples = measure(variants, repeats, opts, "trie ops")
    after = trie.stats()
    latency = Report(
        "micro-trie",
        "Trie match/insert latency",
        {
            "resident_tokens": before["resident_tokens"],
            "capacity_tokens": before["capacity_tokens"],
            "prompt_tokens": prompt,
            "layout": f"{layers} layer x 1 head x head_dim {head_dim} fp32",
        },
        samples,
    )
    ms = 1e3
    latency.checks = [Check(f"{name}, median", latency.median(name) * ms, "ms", 1.0) for name in samples]
    latency.checks += [
        Check(f"{name}, p99", float(np.percentile(samples[name], 99)) * ms, "ms") for name in samples
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
    report = Report(
        "micro-memory",
        "Metadata bytes per cached token",
        {
            "resident_tokens": resident,
            "capacity_tokens": stats["capacity_tokens"],
            "nodes": stats["nodes"],
            "layout": f"{layers} layer x 1 head x head_dim {head_dim} fp32",
        },
    )
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


def bench_ttft(
    opts: BenchOptions, model, tokenizer, cached: int, question: int, repeats: int, nocache_repeats: int
) -> Report:
    from kvblocks.adapters import hf
    from kvblocks.adapters.hf_trie import KVCacheTrie
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

    ideal_name, kv_name = "ideal (bare model, prebuilt cache)", "kvblocks (match, to_hf_cache, prefill)"
    none_name, kv_beside = "no cache (full prefill)", "kvblocks, measured beside no cache"
    samples = measure(
        [
            Variant(ideal_name, ideal, teardown=lambda: hf.crop(ideal_past, cached)),
            Variant(kv_name, with_kvblocks),
        ],
        repeats,
        opts,
        "ttft vs ideal",
    )
    samples |= measure(
        [Variant(kv_beside, with_kvblocks), Variant(none_name, no_cache)],
        nocache_repeats,
        opts,
        "ttft vs no cache",
    )
    name = getattr(model.config, "name_or_path", "") or model.config.model_type
    report = Report(
        "micro-ttft",
        "Time to first token with a cached system prompt",
        {
            "model": name,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "cached_tokens": cached,
            "question_tokens": question,
            "clock": opts.clock,
        },
        samples,
        baseline=ideal_name,
    )
    report.checks = [
        Check("kvblocks / ideal", report.ratio(kv_name, ideal_name), "", 1.10),
        Check("kvblocks / ideal, median of per-round ratios", report.paired_ratio(kv_name, ideal_name)),
        Check("no cache / kvblocks (speed-up)", report.ratio(none_name, kv_beside)),
    ]
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

    cold_name = "model_fingerprint right after a load"
    warm_name = "model_fingerprint, weights warm"
    bare_name = "bare xxh3-128 of the same tensors' bytes"
    samples = measure(
        [
            Variant(cold_name, after_load, setup=load, teardown=fresh.clear),
            Variant(warm_name, warm),
            Variant(bare_name, bare),
        ],
        repeats,
        opts,
        "fingerprint",
    )
    assert len(seen) == 1, f"model_fingerprint is not deterministic: {sorted(seen)}"
    name = getattr(model.config, "name_or_path", "") or model.config.model_type
    report = Report(
        "micro-fingerprint",
        "Model fingerprint (namespace) time",
        {
            "model": name,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "tensors": len(tensors),
            "MB_hashed": round(nbytes / 1e6, 1),
            "clock": opts.clock,
        },
        samples,
        baseline=bare_name,
    )
    report.checks = [
        Check(f"{cold_name}, median", report.median(cold_name), "s", 0.5),
        Check(f"{warm_name}, median", report.median(warm_name), "s", 0.5),
        Check(f"{warm_name}, p99", float(np.percentile(samples[warm_name], 99)), "s"),
        Check("fingerprint hash throughput, weights warm", nbytes / report.median(warm_name) / GB, "GB/s"),
        Check("model_fingerprint / bare xxh3-128, weights warm", report.ratio(warm_name, bare_name)),
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
