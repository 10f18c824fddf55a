"""`kvblocks bench specdec`: speculative decoding against its predicted speed-up and against transformers.

Three workloads on the same target, each with the drafter that fits it:

- self: the target's first K layers (`truncated_model`) on open-ended chat prompts;
- lookup: n-gram prompt lookup on input-grounded prompts whose answer copies the input;
- trie: `TrieDrafter` on repeated requests (the trie holds the earlier answer);

plus `sweep`, which measures alpha and the cost ratio c for several K to choose the self-drafter,
and `trees`, draft trees against chains with the same drafter (`kvblocks.bench.specdec_trees`).

Per workload, in one interleaved run: kvblocks' `CachedGenerator` and `SpeculativeGenerator` on the
same prefix cache (greedy; their outputs must be identical), transformers' plain greedy `generate`
and its assisted generation with the same drafter. Decode speed = tokens emitted after the first
emission / time from the first emission to the last, so prefill and the first round are left out
of every variant alike. The step costs c and v of the predicted walltime factor
S = (1 - a^(g+1)) / ((1 - a)(g c + v)) are the medians of the forwards those same runs made.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvblocks.bench import fixtures
from kvblocks.bench.harness import (
    BenchOptions,
    Check,
    Option,
    Ratio,
    Report,
    Variant,
    add_suite,
    count,
    ints,
    measure,
    repeats_row,
)
from kvblocks.errors import UserError

BENCHMARKS = ("self", "lookup", "trie", "sweep", "trees")

_TEXT = (
    "The lighthouse stood on a rocky point at the edge of the bay. Every night the keeper climbed the "
    "spiral stairs, trimmed the wick and wound the clockwork that turned the great lens. Ships passing in "
    "the dark saw the beam sweep across the water every ten seconds and knew where the rocks were."
)
_TYPOS = {"lighthouse": "lighthose", "keeper": "keper", "water": "watter", "seconds": "secconds"}


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


OPEN_PROMPTS = [
    _user("Write a short story about a robot who learns to paint."),
    _user("Explain how photosynthesis works."),
    _user("What are the benefits of regular exercise?"),
]
GROUNDED_PROMPTS = [
    _user("Repeat the following text exactly, word for word:\n\n" + _TEXT),
    _user(
        "Fix the spelling mistakes in the following text and write out the corrected text:\n\n"
        + " ".join(_TYPOS.get(w, w) for w in _TEXT.split(" "))
    ),
    _user("Summarise the following text in two sentences:\n\n" + _TEXT),
]


OPTIONS = (
    *ints("", [
        repeats_row(3, "timed runs of each generation variant"),
        ("cost-repeats", 15,
         "timed runs of a point-mass drafter's proposal and of each forward in the sweep"),
        ("self-layers", 4, "layers of the self-drafter (see sweep)"),
        ("self-gamma", 1, "drafts per round, self"),
        ("lookup-gamma", 8, "drafts per round, lookup"),
        ("trie-gamma", 8, "drafts per round, trie"),
        ("self-tokens", 48, "new tokens per prompt, self"),
        ("lookup-tokens", 64, "new tokens per prompt, lookup"),
        ("trie-tokens", 48, "new tokens per prompt, trie"),
        ("prompts", 2, "prompts per run, self workload"),
        ("sweep-tokens", 32, "new tokens per prompt, sweep"),
        ("tree-gamma", 4, "trees: the default chain's drafts per round"),
        ("tree-depth", 16, "trees: the tree's depth"),
        ("tree-tokens", 32, "trees: the tree's node budget (cut per round to the most tokens a second)"),
        ("tree-width", 4, "trees: branches per node"),
        ("tree-max-tokens", 48, "trees: new tokens per request"),
    ]),
    Option("--sweep-layers", None, "2,4,8,16,24,29",
           "self-drafter layer counts the sweep measures (default 2,4,8,16,24,29)"),
    Option("--batched-others", count, 16,
           "trees: plain requests batched beside the workload's, 0 to skip (default 16)"),
    Option("--tree-chain-gammas", None, "8,16",
           "trees: more chain lengths to run beside the default (the fastest is reported)"),
    Option("--tree-workloads", None, "agents,retried,templated",
           "trees: the workloads to run (default agents,retried,templated)"),
)  # fmt: skip


def add_parser(suites: argparse._SubParsersAction) -> None:
    add_suite(
        suites,
        "specdec",
        run,
        help="speculative decoding: measured vs predicted speed-up, vs transformers' assisted generation",
        description="Speculative decoding on the target --model with three drafters, checked against targets.",
        model=True,
        dtype=True,
        only=BENCHMARKS,
        options=OPTIONS,
    )


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    selected = args.only or list(BENCHMARKS)
    workloads = {
        "self": Workload(
            "self", OPEN_PROMPTS[: args.prompts], args.self_tokens, args.self_gamma, args.self_layers
        ),
        "lookup": Workload("lookup", GROUNDED_PROMPTS, args.lookup_tokens, args.lookup_gamma),
        "trie": Workload("trie", OPEN_PROMPTS, args.trie_tokens, args.trie_gamma),
    }
    for w in workloads.values():
        if w.kind in selected and w.max_new_tokens < 2 * (w.gamma + 1):
            raise UserError(
                f"--{w.kind}-tokens ({w.max_new_tokens}) must be at least 2 x (gamma + 1) = {2 * (w.gamma + 1)}: "
                "the first round is left out of the decode rate"
            )
    dtype = fixtures.model_dtype(args, packed=False)  # a round is one segment: auto is float32, as in serve
    model, tokenizer = fixtures.load_model(args.model, dtype)
    layers = model.config.num_hidden_layers
    sweep = _layer_list(args.sweep_layers, layers) if "sweep" in selected else []
    if "self" in selected and not 0 < args.self_layers < layers:
        raise UserError(f"--self-layers must be in 1..{layers - 1}, got {args.self_layers}")
    reports: list[Report] = []
    for name, workload in workloads.items():
        if name in selected:
            reports += bench_workload(opts, model, tokenizer, workload, args.repeats, args.cost_repeats)
    if "sweep" in selected:
        reports.append(bench_sweep(opts, model, tokenizer, sweep, args.sweep_tokens, args.cost_repeats))
    if "trees" in selected:
        from kvblocks.bench.specdec_trees import bench_trees

        reports += bench_trees(opts, model, tokenizer, args)
    for report in reports:
        report.params["dtype"] = dtype
    return reports


def _layer_list(text: str, layers: int) -> list[int]:
    try:
        ks = sorted({int(k) for k in text.split(",") if k.strip()})
    except ValueError:
        ks = []
    if not ks or not all(0 < k < layers for k in ks):
        raise UserError(
            f"--sweep-layers must be comma-separated layer counts in 1..{layers - 1}, got '{text}'"
        )
    return ks


@dataclass(slots=True, frozen=True)
class Workload:
    kind: str  # "self", "lookup" or "trie": the drafter
    prompts: list[list[dict]]
    max_new_tokens: int
    gamma: int
    layers: int = 0  # self-drafter only

    @property
    def drafter_name(self) -> str:
        return {"self": f"self:{self.layers}", "lookup": "lookup:3", "trie": "trie"}[self.kind]


# ---- decode-rate bookkeeping -----------------------------------------------------------------


@dataclass(slots=True)
class DecodeLog:
    """Per timed run: tokens emitted after each request's first emission, and the time they took."""

    runs: list[tuple[int, float]] = field(default_factory=list)

    def begin(self) -> None:
        self.runs.append((0, 0.0))

    def add(self, tokens: int, seconds: float) -> None:
        n, s = self.runs[-1]
        self.runs[-1] = (n + tokens, s + seconds)

    def seconds_per_token(self, skip: int) -> list[float]:
        assert all(n > 0 for n, _ in self.runs[skip:]), "a run decoded no tokens after its first emission"
        return [s / n for n, s in self.runs[skip:]]

    def tokens(self, skip: int) -> int:
        return sum(n for n, _ in self.runs[skip:])


@dataclass(slots=True)
class RoundLog:
    """`on_round` observer: (drafts, accepted) of each round of the current request."""

    current: list[tuple[int, int]] = field(default_factory=list)

    def __call__(self, rnd) -> None:
        self.current.append((len(rnd.drafts), rnd.accepted))


class ForwardTimes:
    """Times the forwards a `ModelRunner` makes while `on`: seconds by the number of tokens fed.

    The step costs c and v come from the forwards of the timed runs themselves, so the load that
    a shared machine puts on the measured speed-up is in the predicted one too.
    """

    def __init__(self, runner) -> None:
        self.on = False
        self.by_width: dict[int, list[float]] = {}
        inner = runner.forward

        def forward(token_ids, past, keep: int = 1):
            t0 = time.perf_counter()
            out = inner(token_ids, past, keep)
            if self.on:
                self.by_width.setdefault(len(token_ids), []).append(time.perf_counter() - t0)
            return out

        runner.forward = forward


class EmissionStreamer:
    """A transformers streamer that timestamps each batch of new tokens (the first put is the prompt)."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.emissions: list[tuple[float, int]] = []

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.emissions.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass

    def tokens_and_seconds(self) -> tuple[int, float]:
        """Tokens after the first emission and the time from the first emission to the last."""
        (t_first, _), (t_last, _) = self.emissions[0], self.emissions[-1]
        return sum(n for _, n in self.emissions[1:]), t_last - t_first


# ---- one workload ----------------------------------------------------------------------------


CAPACITY = 16_384  # tokens of the workload's prefix cache (and the self-drafter's)


def variant_names(w: Workload) -> dict[str, str | None]:
    """The variants of one workload by role; transformers has no trie drafter (`hf_spec` is None)."""
    hf_spec = {
        "self": f"transformers assisted (self:{w.layers}, γ={w.gamma})",
        "lookup": f"transformers prompt lookup (γ={w.gamma})",
    }.get(w.kind)
    return {
        "base": "kvblocks CachedGenerator",
        "spec": f"kvblocks speculative ({w.drafter_name}, γ={w.gamma})",
        "hf": "transformers greedy generate",
        "hf_spec": hf_spec,
    }


def make_drafter(model, cache, w: Workload):
    """kvblocks' drafter for the workload, and the draft model when it is one."""
    from kvblocks.adapters.hf_trie import KVCacheTrie
    from kvblocks.specdec import ModelDrafter, PromptLookupDrafter, TrieDrafter, truncated_model

    if w.kind == "self":
        draft_model = truncated_model(model, w.layers)
        return ModelDrafter(
            draft_model, KVCacheTrie.for_model(draft_model, capacity_tokens=CAPACITY)
        ), draft_model
    if w.kind == "lookup":
        return PromptLookupDrafter(max_ngram=3), None
    return TrieDrafter(cache), None


def hf_assisted_kwargs(model, w: Workload) -> dict:
    """transformers' `generate` keywords for the same drafter, as far as it has one."""
    from kvblocks.specdec import truncated_model

    if w.kind == "lookup":
        return {"prompt_lookup_num_tokens": w.gamma, "max_matching_ngram_size": 3}
    if w.kind != "self":
        return {}
    assistant = truncated_model(model, w.layers)
    # the assistant reads its settings from its own generation config: give it one of its own
    assistant.generation_config = copy.deepcopy(model.generation_config)
    assistant.generation_config.num_assistant_tokens = w.gamma
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    return {"assistant_model": assistant}


@dataclass(slots=True)
class Lanes:
    """One workload's generators and reference outputs, and what their timed runs record."""

    opts: BenchOptions
    model: object
    w: Workload
    base: object  # CachedGenerator
    spec: object  # SpeculativeGenerator, reporting its rounds to `rounds`
    rounds: RoundLog
    prompt_ids: list[list[int]]
    reference: list[list[int]]  # CachedGenerator's output for each prompt, from an untimed earlier run
    base_times: ForwardTimes
    spec_times: ForwardTimes
    draft_times: ForwardTimes | None  # a model drafter's forwards
    stats: object  # SpecStats over the timed runs
    observed: list[list[tuple[int, int]]] = field(default_factory=list)
    hf_same: list[bool] = field(default_factory=list)

    def kv_baseline(self, log: DecodeLog) -> Callable[[], None]:
        def go() -> None:
            log.begin()
            self.base_times.on = len(log.runs) > self.opts.warmup
            for ids, ref in zip(self.prompt_ids, self.reference):
                r = self.base.generate(ids, max_new_tokens=self.w.max_new_tokens)
                assert r.token_ids == ref, "CachedGenerator output changed between runs"
                log.add(len(r.token_ids) - 1, r.total_s - r.ttft_s)

        return go

    def kv_spec(self, log: DecodeLog) -> Callable[[], None]:
        def go() -> None:
            log.begin()
            timed = self.spec_times.on = len(log.runs) > self.opts.warmup
            if self.draft_times is not None:
                self.draft_times.on = timed
            for ids, ref in zip(self.prompt_ids, self.reference):
                self.rounds.current = []
                r = self.spec.generate(ids, max_new_tokens=self.w.max_new_tokens)
                assert r.token_ids == ref, "speculative output differs from CachedGenerator's"
                first = self.rounds.current[0][1] + 1
                log.add(len(r.token_ids) - first, r.total_s - r.ttft_s)
                if timed:
                    _merge(self.stats, r.spec)
                    self.observed.append(self.rounds.current[1:])

        return go

    def hf_generate(self, log: DecodeLog, kwargs: dict, check: bool) -> Callable[[], None]:
        import torch

        settings = {"do_sample": False, "max_new_tokens": self.w.max_new_tokens}

        def go() -> None:
            log.begin()
            for ids, ref in zip(self.prompt_ids, self.reference):
                streamer = EmissionStreamer()
                input_ids = torch.tensor([ids])
                mask = torch.ones_like(input_ids)
                with torch.inference_mode():
                    out = self.model.generate(
                        input_ids, attention_mask=mask, **settings, streamer=streamer, **kwargs
                    )
                log.add(*streamer.tokens_and_seconds())
                if check:
                    self.hf_same.append(out[0, len(ids) :].tolist() == ref)

        return go

    def stop_timing(self) -> None:
        self.base_times.on = self.spec_times.on = False
        if self.draft_times is not None:
            self.draft_times.on = False


def bench_workload(
    opts: BenchOptions, model, tokenizer, w: Workload, repeats: int, cost_repeats: int
) -> list[Report]:
    from kvblocks.adapters.hf_trie import KVCacheTrie
    from kvblocks.generate.generator import CachedGenerator
    from kvblocks.specdec import SpecStats, SpeculativeGenerator

    cache = KVCacheTrie.for_model(model, capacity_tokens=CAPACITY)
    base = CachedGenerator(model, tokenizer, cache)
    drafter, draft_model = make_drafter(model, cache, w)
    rounds = RoundLog()
    spec = SpeculativeGenerator(model, tokenizer, cache, drafter, gamma=w.gamma, on_round=rounds)
    prompt_ids = [base.encode(p) for p in w.prompts]
    # An earlier request per prompt: the prompt is cached (and, for the trie drafter, its answer).
    reference = [base.generate(ids, max_new_tokens=w.max_new_tokens).token_ids for ids in prompt_ids]
    draft_times = ForwardTimes(drafter.runner) if draft_model is not None else None
    lanes = Lanes(opts, model, w, base, spec, rounds, prompt_ids, reference, ForwardTimes(base.runner),
                  ForwardTimes(spec.runner), draft_times, SpecStats(w.gamma))  # fmt: skip
    assisted = hf_assisted_kwargs(model, w)
    makers = {
        "base": lanes.kv_baseline,
        "spec": lanes.kv_spec,
        "hf": lambda log: lanes.hf_generate(log, {}, check=True),
        "hf_spec": lambda log: lanes.hf_generate(log, assisted, check=False),
    }
    names = variant_names(w)
    logs = {key: DecodeLog() for key, name in names.items() if name is not None}
    variants = [Variant(names[key], makers[key](log)) for key, log in logs.items()]
    measure(variants, repeats, opts, f"specdec {w.kind}")
    samples = {names[k]: log.seconds_per_token(opts.warmup) for k, log in logs.items()}
    lanes.stop_timing()
    if draft_times is not None:
        draft_samples = {f"drafter forward ({w.drafter_name}), 1 token": draft_times.by_width[1]}
    else:
        draft_samples = propose_times(opts, w, drafter, prompt_ids[0] + reference[0], cost_repeats)
    draft_cost = float(np.median(next(iter(draft_samples.values()))))
    target = {1: lanes.base_times.by_width[1]} | {k: t for k, t in lanes.spec_times.by_width.items() if k > 1}
    costs = StepCosts(
        {k: float(np.median(t)) for k, t in target.items()}, draft_cost, w.gamma, draft_model is None
    )
    params = {"model": fixtures.model_name(model), "drafter": w.drafter_name, "gamma": w.gamma}
    params |= {"prompts": len(prompt_ids), "max_new_tokens": w.max_new_tokens}
    params["decoded_tokens_per_run"] = logs["base"].tokens(opts.warmup) // repeats
    title = f"Speculative decoding, {w.drafter_name} drafter"
    speed = Report(f"specdec-{w.kind}", title, params, samples, baseline=names["base"])
    speed.checks = speed_checks(speed, w, names, lanes, costs)
    speed.notes = speed_notes(w, lanes)
    return [speed, cost_report(w, costs, target, draft_samples)]


def speed_checks(speed: Report, w: Workload, names: dict, lanes: Lanes, costs: StepCosts) -> list[Check]:
    a, c, v = lanes.stats.alpha, costs.c, costs.v(w.gamma)
    predicted = predicted_speedup(a, w.gamma, c, v)
    measured = speed.ratio(names["base"], names["spec"])
    modelled = costs.observed_speedup(lanes.observed)
    checks = [
        Check("alpha (MLE)", a),
        Check("tokens per target call", lanes.stats.tokens_per_call),
        Check("draft efficiency", lanes.stats.draft_efficiency),
        Check("c = drafter cost / target step", c),
        Check(f"v = {w.gamma + 1}-token verify / 1-token step", v),
        Check("predicted speed-up S", predicted),
        Check("measured speed-up (decode tokens/s vs CachedGenerator)", measured),
        Check("measured / predicted", measured / predicted, target=0.9, higher_is_better=True),
        Check("speed-up the step costs give for the observed rounds", modelled),
        Check("measured / observed-rounds model", measured / modelled),
    ]
    if names["hf_spec"] is not None:
        metric = f"kvblocks / {names['hf_spec'].split(' (')[0]} decode speed"
        checks.append(Ratio(metric, names["hf_spec"], names["spec"], 1.0, True).check(speed))
    metric = "transformers greedy / kvblocks CachedGenerator decode speed"
    return [*checks, Ratio(metric, names["base"], names["hf"]).check(speed)]


def speed_notes(w: Workload, lanes: Lanes) -> list[str]:
    stats, observed = lanes.stats, lanes.observed
    empty = sum(1 for run in observed for d, _ in run if d == 0)
    total = sum(len(run) for run in observed)
    return [
        "samples are seconds per decoded token of one run over all prompts: tokens emitted after each request's "
        "first emission / time from the first emission to the last (kvblocks: `total_s - ttft_s` of the result, "
        "the first round's tokens left out; transformers: a streamer's timestamps), so prefill and the first "
        "round are out of every variant; rates are compared as ratios of medians",
        f"greedy; kvblocks' speculative output was asserted identical to CachedGenerator's on every run; "
        f"transformers' greedy output equal to kvblocks': {_yes_share(lanes.hf_same)}",
        f"alpha = sum(accepted) / (sum(accepted) + rounds with a rejection) over the timed runs "
        f"({stats.rounds} rounds, {stats.drafted} drafted, {stats.accepted} accepted); "
        f"{empty} of {total} rounds after the first had no draft",
        f"predicted S = (1 - a^(g+1)) / ((1 - a)(g c + v)) with g = {w.gamma}; the observed-rounds model "
        "replaces the i.i.d. acceptance by the rounds that happened: sum(tokens) / sum(drafting cost + "
        "verify cost of that round's 1 + drafts tokens); the step costs are the medians of the forwards the "
        "timed runs made (1 token: CachedGenerator's decode steps; k tokens: the speculative verify steps), "
        "listed in the costs report",
        "kvblocks runs with its prefix cache (prompts resident from an earlier request, prefill = 1 token); "
        "transformers has none and prefills every prompt, which the decode rate leaves out (assisted generation "
        "on a prefilled cache is silently wrong: docs/CACHE.md, 'transformers facts')",
        *_hf_notes(w),
    ]


def _merge(total, one) -> None:
    for name in ("rounds", "drafted", "accepted", "rejected_rounds", "emitted"):
        setattr(total, name, getattr(total, name) + getattr(one, name))


def _yes_share(flags: list[bool]) -> str:
    if not flags:
        return "not checked"
    return "yes, every prompt" if all(flags) else f"{sum(flags)} of {len(flags)} requests"


def _hf_notes(w: Workload) -> list[str]:
    if w.kind == "self":
        return [
            f"transformers assisted generation gets the same drafter (its own `truncated_model(model, {w.layers})`) "
            f"and the same fixed {w.gamma} drafts per round: `num_assistant_tokens={w.gamma}`, schedule "
            "'constant', `assistant_confidence_threshold=0` (its default 0.4 would stop drafting early)"
        ]
    if w.kind == "lookup":
        return [
            f"transformers prompt lookup: `prompt_lookup_num_tokens={w.gamma}`, `max_matching_ngram_size=3` "
            "(kvblocks: `PromptLookupDrafter(max_ngram=3)`); transformers takes the first earlier match, "
            "kvblocks the latest"
        ]
    return ["transformers has no drafter that reads earlier answers; its plain greedy decode is shown"]


def predicted_speedup(a: float, g: int, c: float, v: float) -> float:
    """Leviathan et al.'s walltime factor; expected tokens per call tends to g + 1 as a -> 1."""
    tokens = g + 1 if a >= 1.0 else (1 - a ** (g + 1)) / (1 - a)
    return tokens / (g * c + v)


# ---- step costs ------------------------------------------------------------------------------


@dataclass(slots=True)
class StepCosts:
    """Median seconds of target forwards by tokens fed, and of drafting: per drafted token for a
    model drafter, per proposal for a point-mass one (`per_round`)."""

    target: dict[int, float]
    draft: float
    gamma: int
    per_round: bool

    @property
    def c(self) -> float:
        return self.draft / (self.gamma if self.per_round else 1) / self.target[1]

    def v(self, drafts: int) -> float:
        """A verify of `drafts` drafts (drafts + 1 tokens) over a 1-token step; NaN if none ran."""
        return self.target.get(drafts + 1, float("nan")) / self.target[1]

    def observed_speedup(self, observed: list[list[tuple[int, int]]]) -> float:
        """Target steps per token of plain decoding over the step-cost sum of the rounds that ran."""
        tokens = cost = 0.0
        for run in observed:
            for drafted, accepted in run:
                tokens += accepted + 1
                cost += (self.gamma if self.per_round else drafted) * self.c + self.v(drafted)
        return tokens / cost if cost else 0.0


def propose_times(opts: BenchOptions, w: Workload, drafter, context: list[int], repeats: int) -> dict:
    """A point-mass drafter's proposal time on a prompt and half its answer (microseconds, no model)."""
    from kvblocks.generate.sampling import SamplingParams

    session = drafter.start(context, None)
    half = context[: len(context) - w.max_new_tokens // 2]
    name = f"drafter propose ({w.drafter_name}, γ={w.gamma})"
    variant = Variant(name, lambda: session.propose(half, w.gamma, SamplingParams(), None))
    return measure([variant], repeats, opts, f"propose {w.kind}")


def cost_report(w: Workload, costs: StepCosts, target: dict[int, list[float]], draft: dict) -> Report:
    names = {
        k: f"target forward, {k} token{'s' * (k > 1)}"
        + (" (CachedGenerator decode)" if k == 1 else " (verify)")
        for k in sorted(target)
    }
    samples = {names[k]: target[k] for k in names} | draft
    title = f"Step costs, {w.drafter_name} drafter"
    report = Report(f"specdec-{w.kind}-costs", title, {"gamma": w.gamma}, samples, baseline=names[1])
    report.checks = [
        Check(f"v({k - 1}) = {k}-token forward / 1-token", costs.v(k - 1)) for k in names if k > 1
    ]
    report.checks.append(Check("c = drafter cost per drafted token / 1-token target forward", costs.c))
    report.notes = [
        "every target forward of the timed runs, by tokens fed: 1 token = CachedGenerator's decode steps, "
        "k > 1 = the speculative verify steps (1 + drafts tokens, logits of every position); the context is "
        "each request's prompt and answer so far",
        "a point-mass drafter's c is its proposal time (measured apart, on a prompt and half its answer) / "
        "gamma / target step"
        if costs.per_round
        else "the model drafter's 1-token forwards during the timed speculative runs (its LM head included: "
        "the tied 49152 x 576 embedding for SmolLM2)",
    ]
    return report


# ---- choosing K: the self-drafter sweep ------------------------------------------------------


def sweep_alpha(
    generator, k: int, prompts: list[list[int]], reference: list[list[int]], tokens: int
) -> float:
    """The acceptance rate of the K-layer self-drafter `generator` drafts with (gamma = 1, greedy)."""
    accepted = rejected = 0
    for ids, ref in zip(prompts, reference):
        r = generator.generate(ids, max_new_tokens=tokens)
        assert r.token_ids == ref, f"self:{k} output differs from CachedGenerator's"
        accepted += r.spec.accepted
        rejected += r.spec.rejected_rounds
    return accepted / (accepted + rejected) if accepted + rejected else 0.0


def add_sweep_row(report: Report, k: int, alpha: float, c: float, v: dict[int, float]) -> None:
    """A K-layer self-drafter's alpha, c and the speed-up they predict at its best gamma."""
    predicted = {g: predicted_speedup(alpha, g, c, v[g]) for g in v}
    best = max(predicted, key=predicted.get)
    report.checks += [
        Check(f"self:{k} alpha", alpha),
        Check(f"self:{k} c", c),
        Check(f"self:{k} predicted S at its best γ ({best})", predicted[best]),
    ]
    report.notes.append(
        f"self:{k}: alpha {alpha:.3f}, c {c:.3f}, S(γ=1) {predicted[1]:.3f}, S(γ=2) {predicted[2]:.3f}, "
        f"S(γ=4) {predicted[4]:.3f}"
    )


def bench_sweep(
    opts: BenchOptions, model, tokenizer, layer_counts: list[int], tokens: int, repeats: int
) -> Report:
    """alpha and c for each K (gamma = 1, greedy) and the S they predict for gamma = 1, 2, 4."""
    from kvblocks.adapters import hf
    from kvblocks.adapters.hf_trie import KVCacheTrie
    from kvblocks.generate.generator import CachedGenerator, ModelRunner
    from kvblocks.specdec import ModelDrafter, SpeculativeGenerator, truncated_model

    cache = KVCacheTrie.for_model(model, capacity_tokens=8192)
    base = CachedGenerator(model, tokenizer, cache)
    prompts = [base.encode(p) for p in OPEN_PROMPTS[:2]]
    reference = [base.generate(ids, max_new_tokens=tokens).token_ids for ids in prompts]
    drafts = {k: truncated_model(model, k) for k in layer_counts}
    alphas: dict[int, float] = {}
    for k, draft in drafts.items():
        gen = SpeculativeGenerator(model, tokenizer, cache, ModelDrafter(draft), gamma=1)
        alphas[k] = sweep_alpha(gen, k, prompts, reference, tokens)
    context = prompts[0] + reference[0]
    n = len(context) - 1
    runners = {0: ModelRunner(model)} | {k: ModelRunner(d) for k, d in drafts.items()}
    verify = ModelRunner(model, packed="all")  # a SpeculativeGenerator's (its default; one copy per model)
    pasts = {k: hf.empty_cache(r.model.config) for k, r in runners.items()}
    for k, r in runners.items():
        r.forward(context[:-1], pasts[k])

    def step(k: int, width: int) -> Variant:
        # a plain decode step on the target's own runner; wider forwards on the runner a
        # SpeculativeGenerator verifies with (its linear layers on packed weights)
        runner, past = (verify if k == 0 and width > 1 else runners[k]), pasts[k]
        label = "target" if k == 0 else f"self:{k}"
        return Variant(
            f"{label} forward, {width} token{'s' * (width > 1)}",
            lambda: runner.forward(context[-1:] * width, past, keep=width),
            teardown=lambda: hf.crop(past, n),
        )

    variants = [step(0, width) for width in (1, 2, 3, 5)] + [step(k, 1) for k in layer_counts]
    samples = measure(variants, repeats, opts, "self-drafter sweep")
    title = "Self-drafter sweep: alpha, c and predicted S per layer count K"
    params = {"prompts": len(prompts), "tokens_per_prompt": tokens, "context_tokens": n, "gamma_for_alpha": 1}
    report = Report("specdec-sweep", title, params, samples, baseline=variants[0].name)
    t1 = report.median(variants[0].name)
    v = {g: report.median(variants[i].name) / t1 for i, g in ((1, 1), (2, 2), (3, 4))}
    for i, k in enumerate(layer_counts):
        add_sweep_row(report, k, alphas[k], report.median(variants[4 + i].name) / t1, v)
    report.notes += [
        f"v(1) {v[1]:.3f}, v(2) {v[2]:.3f}, v(4) {v[4]:.3f} (target forwards of 2, 3, 5 tokens over 1 token)",
        f"alpha from greedy speculative runs with gamma = 1 ({len(prompts)} open-ended prompts x {tokens} tokens, "
        "outputs asserted identical to CachedGenerator's); c = K-layer forward / full forward, 1 token",
    ]
    return report
