"""`kvblocks bench hybrid`: prefix reuse on a recurrent/attention hybrid through state snapshots.

A random-weight hybrid shaped like a small LFM2 (short-convolution layers with attention every few
layers), Qwen3-Next (gated delta-net layers, full attention every fourth, MoE) or Bamba (Mamba2
layers, attention every fourth) runs the `shared-prompt` and `multi-turn` workloads
(`kvblocks.bench.workloads`) three ways, request by request in a rotated order: kvblocks on the
hybrid, the hybrid with no cache, and kvblocks on an attention-only llama of the same width, depth
and heads. Reported: the hybrid's hit rate against
the attention-only model's (a recurrent model can only resume where a snapshot was taken), TTFT
against no cache, the bytes a snapshot takes per cached token, and whether the cached replies
equal the uncached ones token for token.
"""

from __future__ import annotations

import argparse

from kvblocks.bench.harness import BenchOptions, Check, Option, Report, add_suite, ints, progress
from kvblocks.bench.workloads import make_workload, unbounded_ideal

SHAPES = ("lfm2", "qwen3_next", "bamba")


OPTIONS = (
    Option("--shape", None, "lfm2", "the hybrid's family (default lfm2)", choices=SHAPES),
    *ints("", [
        ("hidden", 512, "hidden size of both models"),
        ("layers", 12, "layers of both models"),
        ("vocab", 8192, "vocabulary"),
        ("snapshot-every", 256, "kvblocks' --snapshot-every"),
        ("groups", 2, "shared-prompt: system prompts"),
        ("prompts-per-group", 6, "shared-prompt: requests per system prompt"),
        ("system", 600, "system prompt tokens"),
        ("question", 32, "shared-prompt: question tokens"),
        ("conversations", 4, "multi-turn: conversations"),
        ("turns", 3, "multi-turn: turns per conversation"),
        ("user", 32, "multi-turn: user tokens per turn"),
        ("output", 16, "reply tokens"),
    ]),
    Option("--seed", int, 0, "seed of the weights and token ids (default 0)"),
)  # fmt: skip


def add_parser(suites: argparse._SubParsersAction) -> None:
    add_suite(
        suites,
        "hybrid",
        run,
        help="hit rate and TTFT on a recurrent/attention hybrid (state snapshots) vs an attention-only model",
        description="Shared-prompt and multi-turn traffic on a random-weight LFM2-, Qwen3-Next- or Bamba-shaped hybrid: "
        "kvblocks vs no cache, and its hit rate against an attention-only model of the same size.",
        only=("shared-prompt", "multi-turn"),
        options=OPTIONS,
    )


def build_models(shape: str, hidden: int, layers: int, vocab: int, seed: int):
    """(hybrid, attention-only llama of the same size), random weights, float32, eval mode."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    heads, kv_heads = max(hidden // 64, 1), max(hidden // 128, 1)
    common = dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        vocab_size=vocab, max_position_embeddings=8192, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )  # fmt: skip
    if shape == "lfm2":  # LFM2: short convolutions, attention at about one layer in three
        types = ["full_attention" if i % 3 == 2 else "conv" for i in range(layers)]
        fields = dict(
            common,
            intermediate_size=3 * hidden,
            block_auto_adjust_ff_dim=False,
            conv_L_cache=3,
            layer_types=types,
        )
    elif shape == "bamba":  # Bamba: Mamba2 layers (state 64, heads of 64), attention at one layer in four
        fields = dict(
            common, intermediate_size=3 * hidden, attn_layer_indices=[i for i in range(layers) if i % 4 == 3],
            mamba_n_heads=2 * hidden // 64, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64, mamba_expand=2,
        )  # fmt: skip
    else:  # Qwen3-Next: three gated delta-net layers, then full attention; MoE feed-forward
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
        fields = dict(
            common, head_dim=64, intermediate_size=3 * hidden, linear_conv_kernel_dim=4,
            linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=max(heads // 2, 1),
            linear_num_value_heads=heads, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=hidden // 2, shared_expert_intermediate_size=hidden, layer_types=types,
        )  # fmt: skip
    torch.manual_seed(seed)
    hybrid = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(shape, **fields), experts_implementation="eager"
    ).eval()
    torch.manual_seed(seed)
    attention = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("llama", **common, intermediate_size=3 * hidden), attn_implementation="sdpa"
    ).eval()
    return hybrid, attention


class _Lane:
    """One served variant: its generator, its conversations' histories and what each request got."""

    def __init__(self, name: str, model, cache) -> None:
        from kvblocks.generate.generator import CachedGenerator
        from kvblocks.generate.text import IdTokenizer

        self.name = name
        self.cache = cache
        self.generator = CachedGenerator(model, IdTokenizer(), cache)
        self.history: dict[int, list[int]] = {}
        self.prompt_tokens = self.cached_tokens = 0
        self.ttft: list[float] = []
        self.replies: list[list[int]] = []

    def serve(self, conversation: int, system: list[int], user: tuple[int, ...], output: int) -> None:
        prompt = [*self.history.get(conversation, system), *user]
        r = self.generator.generate(prompt, max_new_tokens=output, ignore_eos=True)
        self.history[conversation] = prompt + r.token_ids
        self.prompt_tokens += r.prompt_tokens
        self.cached_tokens += r.cached_tokens
        self.ttft.append(r.ttft_s)
        self.replies.append(r.token_ids)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    hybrid, attention = build_models(args.shape, args.hidden, args.layers, args.vocab, args.seed)
    chosen = args.only or ["shared-prompt", "multi-turn"]
    return [workload(kind, hybrid, attention, args, opts) for kind in chosen]


def make_lanes(hybrid, attention, w, every: int) -> list[_Lane]:
    """kvblocks on the hybrid, the hybrid uncached, kvblocks on the attention-only model; each served
    one untimed request first (allocator, kernels), which the caches then forget."""
    from kvblocks import KVCacheTrie

    # room for everything: this measures reuse, not eviction (up to 8 snapshots a request)
    capacity = 4 * (sum(w.prompt_lengths()) + len(w.turns) * w.max_new_tokens)
    probe = KVCacheTrie.for_model(hybrid, 1, snapshot_every=every)
    per_snapshot = probe.pool.slots_for(probe.state.nbytes)
    hybrid_cache = KVCacheTrie.for_model(
        hybrid, capacity + 8 * len(w.turns) * per_snapshot, snapshot_every=every
    )
    lanes = [
        _Lane("kvblocks, hybrid", hybrid, hybrid_cache),
        _Lane("no cache, hybrid", hybrid, None),
        _Lane("kvblocks, attention-only", attention, KVCacheTrie.for_model(attention, capacity)),
    ]
    for lane in lanes:
        lane.generator.generate([1, 2, 3], max_new_tokens=2, ignore_eos=True)
        if lane.cache is not None:
            lane.cache.clear()
    return lanes


def workload(kind: str, hybrid, attention, args: argparse.Namespace, opts: BenchOptions) -> Report:
    sizes = vars(args) | {"order": "arrival", "systems": 1}
    w = make_workload(kind, sizes, args.vocab)
    lanes = make_lanes(hybrid, attention, w, args.snapshot_every)
    before = lanes[0].cache.stats()  # the warm-up's counts, left out of the report
    with progress(len(w.turns) * len(lanes), f"hybrid {kind}", opts.progress) as bar:
        for i, turn in enumerate(w.turns):
            k = i % len(lanes)
            system = w.systems[w.system_of[turn.conversation]]
            for lane in [*lanes[k:], *lanes[:k]]:
                lane.serve(turn.conversation, system, turn.user, w.max_new_tokens)
                bar.update()
    params = {"workload": kind, "shape": args.shape, "hidden": args.hidden, "layers": args.layers}
    params |= {"vocab": args.vocab, "snapshot_every": args.snapshot_every, "requests": len(w.turns)}
    params |= {"system": args.system, "output": args.output}
    extra = (
        ("groups", "prompts_per_group", "question")
        if kind == "shared-prompt"
        else ("conversations", "turns", "user")
    )
    params |= {k: sizes[k] for k in extra}
    title = f"{args.shape}-shaped hybrid, {kind}: state snapshots vs no cache and vs an attention-only model"
    samples = {lane.name: lane.ttft for lane in lanes}
    report = Report(f"hybrid-{kind}", title, params, samples, baseline="no cache, hybrid")
    ideal = sum(unbounded_ideal(w)) / sum(w.prompt_lengths())
    report.checks, report.notes = hybrid_results(report, lanes, before, ideal, len(w.turns))
    for lane in lanes:
        if lane.cache is not None:
            lane.cache.close()
    return report


def hybrid_results(
    report: Report, lanes: list[_Lane], before: dict, ideal: float, requests: int
) -> tuple[list[Check], list[str]]:
    kv, none, attn = lanes
    stats = kv.cache.stats()
    same = sum(a == b for a, b in zip(kv.replies, none.replies))
    per_token = stats["snapshot_bytes"] / max(stats["resident_tokens"], 1)
    checks = [
        Check("hit rate, hybrid", kv.hit_rate),
        Check("hit rate, attention-only", attn.hit_rate),
        Check("hit rate hybrid / attention-only", kv.hit_rate / attn.hit_rate, "", 0.9, True),
        Check(
            "TTFT speed-up vs no cache (median)", report.ratio("no cache, hybrid", "kvblocks, hybrid"), "x"
        ),
        Check("snapshot bytes per cached token", per_token, "B"),
        Check("replies equal to no cache", same, f"of {requests}", requests, True),
    ]
    notes = [
        f"ideal hit rate (every computed token reusable) {ideal:.4f}; the attention-only model reaches "
        f"{attn.hit_rate / ideal:.3f} of it, the hybrid {kv.hit_rate / ideal:.3f}",
        f"snapshots: {stats['snapshots']} resident of {stats['snapshots_stored'] - before['snapshots_stored']} stored, "
        f"{stats['snapshot_bytes'] / stats['snapshots'] / 1024:,.1f} KiB each; the hybrid's attention KV takes "
        f"{kv.cache.token_bytes:,} B per token (the attention-only model's {attn.cache.token_bytes:,} B)",
        f"lookups cut short for want of a snapshot where the match ended: {stats['snapshot_misses']} of "
        f"{stats['queries'] - before['queries']} (each took a snapshot at its branch point for the next request); "
        f"evicted: {stats['evicted_tokens'] - before['evicted_tokens']} tokens, "
        f"{stats['snapshots_evicted'] - before['snapshots_evicted']} snapshots (the pool is sized to hold everything)",
        "requests run one at a time, the three lanes in a rotated order per request; TTFT is the generator's "
        "(prompt ids given, no tokenizer); float32, random weights",
    ]
    return checks, notes
