"""`kvblocks bench gpu`: kvblocks on one GPU, with a randomly initialised model of a real shape.

No weights can be downloaded on a lent GPU machine, so the model is a Llama of the chosen shape
(`--shape llama-1b` or `llama-8b`; `tiny` to try the suite on a CPU) with random weights in
`--dtype` (bfloat16 by default). One process runs, by default, every benchmark once:

- gather: reading a 4,000-token prefix out of the pool (one `index_select` over the stacked layers,
  and one per layer, over shuffled slots as in a fragmented pool) against one device-to-device copy of
  the same bytes.
- ttft: a prompt of `--cached` cached + `--new` new tokens through `BatchEngine`, submit to first
  token, against the ideal: the bare model's forward of the new tokens over a cache that already
  holds the prefix. On CUDA the engine replays its forwards from CUDA graphs (its default), and
  runs again without them.
- agents: `--agents` agents x 2 turns sharing a `--system-tokens` system prompt, each turn's prompts
  sent as one wave, through kvblocks' packed engine (on a GPU also without CUDA graphs) and
  through transformers' continuous batching (`generate_batch`, paged, block sharing on):
  requests/s, TTFT p50/p99, peak device memory.
- invariance: greedy tokens of requests run alone against the same requests in a busy batch, in
  `--dtype`, with and without `--batch-invariant`: requests bit-identical, greedy flips and the
  top-2 margin where each flip happened.

Timings on CUDA end with a synchronize (engines) or are CUDA events (gather, copy).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import time
import traceback

import numpy as np
import torch

from kvblocks.bench.harness import BenchOptions, Check, Option, Report, add_suite, ints
from kvblocks.bench.packed import EngineCall, random_ids

BENCHMARKS = ("gather", "ttft", "agents", "invariance")
GATHER_ALL = "pool gather, all layers in one call"
_LLAMA3 = dict(num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=8192, vocab_size=128256)
SHAPES = {
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, max_position_embeddings=8192,
    ),
    "llama-1b": dict(
        _LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        head_dim=64, tie_word_embeddings=True,
    ),
    "llama-8b": dict(
        _LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    ),
}  # fmt: skip
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


OPTIONS = (
    Option("--device", None, None, "torch device (default: cuda when present, else cpu)"),
    Option("--shape", None, "llama-1b", "model shape (default llama-1b)", choices=tuple(SHAPES)),
    Option("--dtype", None, "bfloat16", "model dtype (default bfloat16)", choices=tuple(DTYPES)),
    *ints("", [
        ("runs", 20, "gather, ttft: timed runs per variant"),
        ("cached", 4000, "gather, ttft: cached prefix tokens"),
        ("new", 64, "ttft: new tokens after the prefix"),
        ("agents", 64, "agents: concurrent agents (2 turns each)"),
        ("system-tokens", 2000, "agents: shared system prompt"),
        ("user-tokens", 64, "agents: new user tokens per turn"),
        ("reply", 32, "agents, invariance: greedy tokens per request"),
        ("batch-tokens", 2048, "kvblocks engines: max tokens per packed forward"),
        ("alone", 8, "invariance: requests compared alone and in a busy batch"),
        ("busy", 24, "invariance: other requests in the busy batch"),
    ]),
)  # fmt: skip


def add_parser(suites: argparse._SubParsersAction) -> None:
    add_suite(
        suites,
        "gpu",
        run,
        help="kvblocks on one GPU: pool gather, TTFT, agent traffic vs transformers' batching, invariance",
        description="kvblocks on one GPU with a random-weight Llama of a real shape (no download).",
        only=BENCHMARKS,
        options=OPTIONS,
    )


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = random_model(args.shape, DTYPES[args.dtype], device)
    suites = {"gather": gather, "ttft": ttft, "agents": agents, "invariance": invariance}
    reports = [_guarded(suites[name], name, model, args, opts) for name in args.only or BENCHMARKS]
    for r in reports:
        r.params |= {"device": device_name(device), "shape": args.shape, "dtype": args.dtype}
    return reports


def _guarded(benchmark, name: str, model, args: argparse.Namespace, opts: BenchOptions) -> Report:
    """Run one benchmark; one that raises becomes a report saying so (traceback on stderr), so that
    a single device run still returns the others' results."""
    try:
        return benchmark(model, args, opts)
    except Exception as exc:
        traceback.print_exc()
        report = Report(f"gpu-{name}", f"{name}: failed", {})
        report.notes = [f"{type(exc).__name__}: {exc}"]
        report.checks = [Check(f"{name} ran", 0.0, target=1.0, higher_is_better=True)]
        return report
    finally:
        sync(next(model.parameters()).device)


def random_model(shape: str, dtype: torch.dtype, device: torch.device):
    """A Llama of `shape` with random weights, built on `device` in `dtype`, in eval mode."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_seconds(fn, device: torch.device) -> float:
    """One run of `fn` timed on the device: CUDA events around it, or the wall clock on a CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / 1e3


def _engine(
    model,
    capacity: int,
    batch: int,
    batch_tokens: int,
    invariant: bool = False,
    attention: str | None = None,
    graphs: bool | None = None,
):
    """A started `BatchEngine` over a fresh trie of `capacity` tokens (ids in, no tokenizer)."""
    from kvblocks import CachedGenerator, KVCacheTrie
    from kvblocks.engine.batch import BatchEngine
    from kvblocks.generate.text import IdTokenizer

    trie = KVCacheTrie.for_model(model, capacity_tokens=capacity)
    generator = CachedGenerator(model, IdTokenizer(), trie)
    sizes = {"max_active": 4 * batch, "max_batch_size": batch, "max_batch_tokens": batch_tokens}
    engine = BatchEngine(generator, **sizes, invariant=invariant, attention=attention, cuda_graphs=graphs)
    return engine.start()


def graph_stats(engine) -> dict:
    """The engine's CUDA-graph counters (`GraphedForwards.stats`), {} where it replays none."""
    return engine.graph_stats() or {}


# ---- gather ------------------------------------------------------------------------------------


def gather(model, args: argparse.Namespace, opts: BenchOptions) -> Report:
    from kvblocks.adapters import hf
    from kvblocks.cache.layout import KVLayout
    from kvblocks.cache.pool import KVPool

    device = next(model.parameters()).device
    layout = KVLayout(next(model.parameters()).dtype, tuple(hf.describe_layers(model)))
    pool = KVPool(layout, 4 * args.cached, device)
    for t in pool.layers:
        if t is not None:
            t.normal_()  # never time reads of uninitialised or zero memory
    slots = np.random.default_rng(0).permutation(pool.capacity)[: args.cached].astype(np.int32)
    index = pool.index(slots)
    layers = [i for i, t in enumerate(pool.layers) if t is not None]
    nbytes = args.cached * pool.slot_bytes
    source = torch.randn(nbytes // 2, dtype=torch.float16, device=device)
    target = torch.empty_like(source)

    def per_layer() -> None:  # what re-attaching a prefix runs on a CPU or where layers differ in shape
        for layer in layers:
            pool.gather(layer, index)

    variants = {
        "device-to-device copy": lambda: target.copy_(source),
        GATHER_ALL: lambda: pool.gather_all(index, fused=True),  # one select over the stacked layers
        "pool gather, one call per layer": per_layer,
    }
    for fn in variants.values():  # warm-up
        fn()
    sync(device)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.runs):
        for name, fn in variants.items():
            samples[name].append(device_seconds(fn, device))
    title = f"Pool gather of {args.cached} tokens against a device-to-device copy of the same bytes"
    params = {"tokens": args.cached, "bytes": nbytes, "layers": len(layers), "runs": args.runs}
    report = Report("gpu-gather", title, params, samples, baseline="device-to-device copy")
    bandwidth = {name: 2 * nbytes / report.median(name) / 1e9 for name in variants}
    copy = bandwidth["device-to-device copy"]
    how = "one index_select over the stacked layers' flat view" if pool.stacked else "one call per layer"
    report.checks = [
        Check("gather GB/s (read + write)", bandwidth[GATHER_ALL], "GB/s"),
        Check("copy GB/s (read + write)", copy, "GB/s"),
        Check("gather / copy bandwidth", bandwidth[GATHER_ALL] / copy, "", 0.5, True),
        Check("one call per layer / copy bandwidth", bandwidth["pool gather, one call per layer"] / copy, ""),
    ]
    report.notes = [
        f"pool gather, all layers: {how} (what re-attaching a prefix runs off the CPU), over shuffled "
        "slots of a pool 4x the prefix; one call per layer: what runs on a CPU; copy: one copy_ of a buffer "
        "of the same total bytes; CUDA events; bandwidth counts bytes read plus written"
    ]
    return report


# ---- TTFT --------------------------------------------------------------------------------------


def ttft(model, args: argparse.Namespace, opts: BenchOptions) -> Report:
    from kvblocks.adapters import hf

    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    rng = np.random.default_rng(3)
    prefix = random_ids(rng, vocab, args.cached)
    capacity = 2 * (args.cached + args.new * (args.runs + 4))
    engine = _engine(model, capacity, 16, args.batch_tokens)
    eager = _engine(model, capacity, 16, args.batch_tokens, graphs=False) if device.type == "cuda" else None
    with torch.inference_mode():
        ready = hf.empty_cache(model.config)
        model(input_ids=torch.tensor([prefix], device=device), past_key_values=ready, use_cache=True)

    @torch.inference_mode()
    def ideal(new: list[int]) -> float:
        t0 = time.perf_counter()
        ids = torch.tensor([new], device=device)
        logits = model(input_ids=ids, past_key_values=ready, use_cache=True, logits_to_keep=1).logits
        int(logits[0, -1].argmax())  # the first token on the host, as an engine hands it out
        took = time.perf_counter() - t0
        hf.crop(ready, args.cached)  # back to the prefix alone (nothing copied)
        return took

    def through(e):  # an engine's TTFT: a streamed reply's first piece (of two tokens)
        def first(new: list[int]) -> float:
            call = EngineCall(e, prefix + new, 2)
            call.wait()
            return call.first - call.sent

        return first

    variants = {IDEAL: ideal, "BatchEngine": through(engine)}
    if eager is not None:
        variants[NO_GRAPHS] = through(eager)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    phases = _Phases(engine, device)
    try:
        for e in (engine, eager):
            if e is not None:
                EngineCall(e, prefix, 1).wait()  # the prefix is cached
        for r in range(-2, args.runs):  # two untimed rounds first
            for name, fn in variants.items():
                new = random_ids(rng, vocab, args.new)
                sync(device)
                phases.clear()
                took = fn(new)
                sync(device)
                if r >= 0:
                    samples[name].append(took)
                    phases.keep(name == "BatchEngine", took)
    finally:
        engine.stop()
        if eager is not None:
            eager.stop()
    title = f"TTFT with {args.cached} cached + {args.new} new tokens against the ideal"
    params = {"cached": args.cached, "new": args.new, "runs": args.runs}
    report = Report("gpu-ttft", title, params, samples, baseline=IDEAL)
    cached_vs_ideal = report.ratio("BatchEngine", IDEAL)
    report.checks = [Check("TTFT cached / ideal", cached_vs_ideal, "", 1.05)]
    report.checks += [Check(f"BatchEngine {name}, median", ms, "ms") for name, ms in phases.medians().items()]
    if eager is not None:
        report.checks.append(Check(f"TTFT {NO_GRAPHS} / ideal", report.ratio(NO_GRAPHS, IDEAL), ""))
    report.params["cuda_graphs"] = graph_stats(engine)
    report.notes = [
        "BatchEngine: submit to the first piece reaching the request's callback (ids, max_tokens 2, so the "
        "reply streams), its packed forward reading the prefix from the pool (on CUDA replayed from a CUDA "
        f"graph; '{NO_GRAPHS}': launched kernel by kernel); ideal: the bare "
        "model's forward of the new tokens over a DynamicCache holding the prefix, argmax to the host "
        "(cropped back untimed); host clock, the device synchronized before each run; phases: the first "
        "admission and the first forward after submission"
    ]
    return report


IDEAL = "ideal (prefill the new tokens only)"
NO_GRAPHS = "BatchEngine, no CUDA graphs"


class _Phases:
    """Where a `BatchEngine` request's time goes, on the engine's thread: admission (prepare, trie
    match, slots) and the packed forward (timed to a synchronize), by wrapping those two calls of one
    engine; the rest of a request's TTFT is postprocessing (sampling, commit, emit) and the hand-offs
    between threads."""

    NAMES = ("admit", "forward")

    def __init__(self, engine, device: torch.device) -> None:
        self.device = device
        self.current: dict[str, float] = {}
        self.kept: list[dict[str, float]] = []
        engine._admit = self._timed("admit", engine._admit)
        engine.runner.run = self._timed("forward", engine.runner.run, synchronize=True)

    def _timed(self, name: str, call, synchronize: bool = False):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                if synchronize:
                    sync(self.device)
                if name not in self.current:  # the first call after submission: the first token's
                    self.current[name] = time.perf_counter() - t0

        return timed

    def clear(self) -> None:
        self.current = {}

    def keep(self, yes: bool, total: float) -> None:
        if yes:
            phases = {name: self.current.get(name, 0.0) for name in self.NAMES}
            self.kept.append(phases | {"postprocess and hand-offs": total - sum(phases.values())})

    def medians(self) -> dict[str, float]:
        names = self.kept[0] if self.kept else ()
        return {name: 1e3 * float(np.median([k[name] for k in self.kept])) for name in names}


# ---- agent traffic -----------------------------------------------------------------------------


def agents(model, args: argparse.Namespace, opts: BenchOptions) -> Report:
    import transformers

    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    rng = np.random.default_rng(11)
    system = random_ids(rng, vocab, args.system_tokens)
    turn1 = [system + random_ids(rng, vocab, args.user_tokens) for _ in range(args.agents)]
    later = [random_ids(rng, vocab, args.user_tokens) for _ in range(args.agents)]
    warm = [random_ids(rng, vocab, 64) for _ in range(4)]

    def waves(generate) -> tuple[float, list[float], int]:
        """Both turns through `generate(prompts) -> (ttfts, replies)`: total seconds, TTFTs, peak bytes."""
        generate(warm)  # untimed: kernels, graphs and allocator warmed on unrelated prompts
        sync(device)
        base = _reset_peak(device)
        t0 = time.perf_counter()
        ttfts, replies = generate(turn1)
        turn2 = [p + r + u for p, r, u in zip(turn1, replies, later)]
        more, _ = generate(turn2)
        sync(device)
        return time.perf_counter() - t0, ttfts + more, _peak(device) - base

    capacity = 2 * (args.system_tokens + args.agents * 2 * (args.user_tokens + args.reply) + 512)
    runs = {}
    variants = [("kvblocks BatchEngine", False, None)]
    if device.type == "cpu":  # invariant mode is refused off the CPU, where it does not hold
        variants.append(("kvblocks BatchEngine --batch-invariant", True, None))
    else:  # kernels launched one by one (before CUDA graphs)
        variants.append(("kvblocks BatchEngine, no CUDA graphs", False, False))
    graphs = {}
    for name, invariant, graphed in variants:
        engine = _engine(model, capacity, args.agents, args.batch_tokens, invariant, graphs=graphed)
        try:
            runs[name] = waves(lambda prompts, e=engine: _kvblocks_wave(e, prompts, args.reply))
            graphs[name] = graph_stats(engine)
        finally:
            engine.stop()
    with _transformers_batching(model):
        runs[AGENTS_BASELINE] = waves(_transformers_waves(model, args.reply))
    title = f"{args.agents} agents x 2 turns sharing a {args.system_tokens}-token system prompt (TTFT per request)"
    params = {"agents": args.agents, "system_tokens": args.system_tokens, "user_tokens": args.user_tokens}
    params |= {
        "reply": args.reply,
        "kvblocks_pool_tokens": capacity,
        "cuda_graphs": graphs["kvblocks BatchEngine"],
    }
    samples = {name: run[1] for name, run in runs.items()}
    report = Report("gpu-agents", title, params, samples, baseline=AGENTS_BASELINE)
    report.checks = agents_checks(runs, 2 * args.agents)
    report.notes = [
        "each turn's requests are sent as one wave (turn 2 = turn 1 + its greedy reply + new user tokens); "
        "TTFT from the wave's submission to the request's first token; requests/s = all requests over both "
        "waves' wall time; peak memory: torch.cuda.max_memory_allocated above the level before the waves "
        "(kvblocks' pool is allocated before, transformers' paged cache inside, sized by transformers)",
        f"transformers {transformers.__version__}: model.generate_batch(record_timestamps=True, block "
        "sharing on), one warm-up call on unrelated prompts first",
    ]
    return report


AGENTS_BASELINE = "transformers continuous batching"


def agents_checks(runs: dict[str, tuple[float, list[float], int]], requests: int) -> list[Check]:
    """Requests/s and TTFT of each kvblocks engine against transformers' batching, then p99 and memory."""
    rps = {name: requests / run[0] for name, run in runs.items()}
    p50 = {name: float(np.median(run[1])) for name, run in runs.items()}
    checks = [Check(f"{name} requests/s", rps[name], "req/s") for name in runs]
    for name in runs:
        if name != AGENTS_BASELINE:
            short = name.removeprefix("kvblocks BatchEngine").strip(" ,") or "default"
            vs = f"kvblocks ({short}) / transformers CB"
            checks += [
                Check(f"requests/s {vs}", rps[name] / rps[AGENTS_BASELINE], "", 2.0, True),
                Check(f"TTFT p50 {vs}", p50[name] / p50[AGENTS_BASELINE], "", 0.5),
            ]
    checks += [Check(f"{name} TTFT p99", float(np.percentile(run[1], 99)), "s") for name, run in runs.items()]
    return checks + [
        Check(f"{name} peak memory above weights", run[2] / 2**30, "GiB") for name, run in runs.items()
    ]


def _kvblocks_wave(engine, prompts: list[list[int]], reply: int) -> tuple[list[float], list[list[int]]]:
    calls = [EngineCall(engine, p, reply) for p in prompts]
    return [c.wait() for c in calls], [c.tokens for c in calls]


@contextlib.contextmanager
def _transformers_batching(model):
    """The model on plain sdpa inside (transformers' batching refuses kvblocks' dispatcher); after,
    transformers' kept manager is destroyed and the model is back on the implementation it had
    (transformers switches it to its paged variant and leaves it there)."""
    before = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
        if destroy is not None:
            destroy()
        model.set_attn_implementation(before)


def _transformers_waves(model, reply: int):
    """`generate(prompts) -> (ttfts, replies)` through transformers' continuous batching, with the
    keyword arguments the installed version takes (its API moved between 5.17 and 5.24)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=reply, do_sample=False, eos_token_id=-1, pad_token_id=0)
    kwargs = _batching_kwargs(model, config)

    def generate(prompts: list[list[int]]) -> tuple[list[float], list[list[int]]]:
        outputs = model.generate_batch(inputs=prompts, generation_config=config, **kwargs)
        by_prompt = {tuple(o.prompt_ids): o for o in outputs.values()}
        ordered = [by_prompt[tuple(p)] for p in prompts]
        errors = [o.error for o in ordered if o.error is not None]
        if errors:
            raise RuntimeError(f"transformers' continuous batching failed a request: {errors[0]}")
        return [_ttft(o) for o in ordered], [list(o.generated_tokens) for o in ordered]

    return generate


def _ttft(output) -> float:
    """Seconds from a request's creation to its first token (NaN where this transformers records no
    token timestamps)."""
    stamps = getattr(output, "timestamps", None)
    return stamps[0] - output.created_time if stamps else float("nan")


def _batching_kwargs(model, config) -> dict:
    """Timestamps, one kept manager, block sharing on and no switch to a flash kernel that would need a
    download, however the installed transformers spells them (a `ContinuousBatchingConfig`, or fields of the generation config)."""
    accepted = inspect.signature(model.generate_batch).parameters
    # one manager for the warm-up and both waves: its cache, blocks and graphs are not rebuilt per wave
    wanted = {"record_timestamps": True, "progress_bar": False, "persistent_manager": True}
    kwargs = {name: value for name, value in wanted.items() if name in accepted}
    settings = {"allow_block_sharing": True, "auto_switch_to_flash": False}
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        for name, value in settings.items():
            setattr(config, name, value)
        return kwargs
    if "continuous_batching_config" in accepted:
        fields = inspect.signature(ContinuousBatchingConfig).parameters
        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
            **{name: value for name, value in settings.items() if name in fields}
        )
    return kwargs


def _reset_peak(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


# ---- batch invariance --------------------------------------------------------------------------


def invariance(model, args: argparse.Namespace, opts: BenchOptions) -> Report:
    from kvblocks.engine.attention.probes import probe_row_invariance

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    vocab = model.config.vocab_size
    rng = np.random.default_rng(17)
    prompts = [random_ids(rng, vocab, int(rng.integers(100, 400))) for _ in range(args.alone)]
    others = [random_ids(rng, vocab, int(rng.integers(100, 400))) for _ in range(args.busy)]
    batch = args.alone + args.busy
    kind = str(dtype).removeprefix("torch.")
    title = f"Batch invariance in {kind}: {args.alone} requests alone vs in a batch of {batch}"
    report = Report("gpu-invariance", title, {"requests": args.alone, "batch": batch, "reply": args.reply})
    row_invariant = probe_row_invariance(device, dtype, model.config.hidden_size)
    report.notes = [
        f"probe_row_invariance({device.type}, {dtype}) = {row_invariant}",
        "the pool cleared before each lone request and before the batch; flips: first differing step and "
        "the lone run's top-2 log-probability margin there",
    ]
    for mode, invariant in (("default", False), ("--batch-invariant", True)):
        try:
            engine = _engine(model, 2 * 400 * (batch + 1), batch, args.batch_tokens, invariant)
        except NotImplementedError as exc:  # refused where the probe fails
            report.notes.append(f"{mode}: refused: {exc}")
            continue
        try:
            identical, flips = _alone_and_batched(engine, prompts, others, args.reply)
        finally:
            engine.stop()
        report.checks += [
            Check(f"requests bit-identical alone and batched ({mode})", identical, f"of {args.alone}"),
            Check(f"requests whose greedy tokens flip ({mode})", len(flips), f"of {args.alone}"),
        ]
        report.notes.append(f"{mode} flips: {flips}")
    return report


def _alone_and_batched(
    engine, prompts: list[list[int]], others: list[list[int]], reply: int
) -> tuple[int, list]:
    """Greedy replies of `prompts` one at a time, then together with `others`: how many are
    bit-identical (tokens and log-probabilities), and each flip's step and lone top-2 margin."""
    alone = []
    for p in prompts:
        engine.cache.clear()
        alone.append(EngineCall(engine, p, reply, logprobs=2))
        alone[-1].wait()
    engine.cache.clear()
    together = [EngineCall(engine, p, reply, logprobs=2) for p in prompts + others][: len(prompts)]
    for c in together:
        c.wait()
    identical = sum(
        a.tokens == b.tokens and [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]
        for a, b in zip(alone, together)
    )
    flips = []
    for a, b in zip(alone, together):
        step = next((k for k, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
        if step is not None:
            top = a.logprobs[step].top
            flips.append({"step": step, "margin": round(top[0][1] - top[1][1], 6)})
    return identical, flips
