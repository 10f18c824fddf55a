"""`kvblocks bench shared-prompt | multi-turn | pressure`: chat workloads against the alternatives.

Each workload is a fixed list of requests (token ids, so the ideal hit rate is exact) served one
at a time by every compared server (`servers`): kvblocks, plain generation with no reuse,
transformers' deepcopy prompt-reuse recipe, transformers' continuous batching (one request at a
time, and all at once as `generate_batch` does), and the ideal (the bare model prefilling only
what an oracle knows is already computed). Servers are interleaved request by request with a
rotated order (the harness' `measure`), so background load hits them alike and request `i` of
every server is measured in the same round.

- shared-prompt: G groups x P prompts, a system prompt of S tokens per group and a question of
  Q tokens, shuffled; ideal hit rate S(P-1) / (P(S+Q));
- multi-turn: C conversations x T turns, every turn carries the whole history, replies included;
  ideal = history already computed / prompt tokens;
- pressure: shared-prompt with a cache that holds a fraction of the distinct system prompts;
  the ideal is the offline optimum for that capacity (Belady), the unbounded ideal is reported too.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import math
import textwrap
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from kvblocks.bench import fixtures
from kvblocks.bench.baselines import (
    BatchingConfig,
    BatchingManager,
    ContinuousBatching,
    DeepcopyRecipe,
    Ideal,
    Kvblocks,
    NoReuse,
    Request,
    Served,
    Server,
    generate_all_at_once,
    working_bytes,
)
from kvblocks.bench.harness import (
    CLOCKS,
    BenchOptions,
    Check,
    Group,
    Option,
    Report,
    Stats,
    Variant,
    add_suite,
    fmt_number,
    fmt_seconds,
    measure,
    positive_int,
)
from kvblocks.cache.eviction import DEFAULT_POLICY, POLICIES
from kvblocks.errors import UserError

OPTIONAL = ("no-reuse", "deepcopy", "cb", "cb-batch")
CB_BATCH = "transformers CB, all at once"
MB = 1e6


# ---- workloads ---------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Turn:
    """A request: the conversation it continues and the user tokens it appends to the history."""

    conversation: int
    user: tuple[int, ...]


@dataclass(slots=True)
class Workload:
    """Conversations start from a system prompt (`systems[system_of[c]]`); each turn's prompt is
    the conversation's history (previous prompt + the server's own reply) + the turn's user ids."""

    name: str
    systems: list[list[int]]
    system_of: list[int]
    turns: list[Turn]
    max_new_tokens: int
    vocab: int

    def system_len(self, conversation: int) -> int:
        return len(self.systems[self.system_of[conversation]])

    def prompt_lengths(self) -> list[int]:
        """Prompt lengths in arrival order (replies are always exactly `max_new_tokens` long)."""
        history: dict[int, int] = {}
        out = []
        for t in self.turns:
            n = history.get(t.conversation, self.system_len(t.conversation)) + len(t.user)
            out.append(n)
            history[t.conversation] = n + self.max_new_tokens
        return out

    def more_turns(self) -> list[bool]:
        last = {t.conversation: i for i, t in enumerate(self.turns)}
        return [last[t.conversation] > i for i, t in enumerate(self.turns)]

    def waves(self) -> list[list[int]]:
        """Request indices grouped by turn number: what can be submitted together."""
        seen: dict[int, int] = {}
        out: list[list[int]] = []
        for i, t in enumerate(self.turns):
            k = seen.get(t.conversation, 0)
            seen[t.conversation] = k + 1
            if k == len(out):
                out.append([])
            out[k].append(i)
        return out


def _first_id(vocab: int) -> int:
    """Skip the low ids, where tokenizers keep their special tokens."""
    return min(256, vocab // 2)


def _sequences(rng: np.random.Generator, vocab: int, count: int, length: int) -> list[list[int]]:
    """Random ids whose first tokens differ pairwise, so no two share even one leading token."""
    low = _first_id(vocab)
    if count > vocab - low:
        raise UserError(f"cannot make {count} distinct sequences from a vocabulary of {vocab}")
    firsts = rng.choice(np.arange(low, vocab), size=count, replace=False)
    rest = rng.integers(low, vocab, (count, length - 1))
    return [[int(f), *map(int, r)] for f, r in zip(firsts, rest)]


def shared_prompt(
    groups: int, per_group: int, system: int, question: int, output: int, vocab: int, seed: int = 0,
    order: str = "arrival", zipf: float = 0.0,
) -> Workload:  # fmt: skip
    """Requests arrive shuffled; `order="sorted"` sorts the prompts instead (descending, as
    transformers' `add_requests` does), so requests with one system prompt come back to back.
    With `zipf` > 0 the groups*per_group requests pick their system prompt with probability
    proportional to 1/rank**zipf instead of `per_group` each (skewed popularity)."""
    rng = np.random.default_rng(seed)
    systems = _sequences(rng, vocab, groups, system)
    questions = _sequences(rng, vocab, groups * per_group, question)
    order_ids = [int(i) for i in rng.permutation(groups * per_group)]
    system_of = [i // per_group for i in range(groups * per_group)]
    if zipf > 0:
        weights = 1.0 / np.arange(1, groups + 1) ** zipf
        system_of = [int(g) for g in rng.choice(groups, size=groups * per_group, p=weights / weights.sum())]
    if order == "sorted":
        order_ids.sort(key=lambda i: systems[system_of[i]] + questions[i], reverse=True)
    return Workload(
        "shared-prompt", systems, system_of, [Turn(i, tuple(questions[i])) for i in order_ids], output, vocab
    )


def multi_turn(
    conversations: int, turns: int, system: int, user: int, output: int, vocab: int, systems: int = 1,
    seed: int = 0,
) -> Workload:  # fmt: skip
    """Turns arrive in a random interleaving of the conversations, each conversation in order."""
    rng = np.random.default_rng(seed)
    prompts = _sequences(rng, vocab, systems, system)
    users = _sequences(rng, vocab, conversations * turns, user)
    left = [turns] * conversations
    arrivals: list[Turn] = []
    while any(left):
        c = int(rng.choice([k for k, n in enumerate(left) if n]))
        arrivals.append(Turn(c, tuple(users[c * turns + turns - left[c]])))
        left[c] -= 1
    system_of = [c % systems for c in range(conversations)]
    return Workload("multi-turn", prompts, system_of, arrivals, output, vocab)


# ---- ideal hit plans ---------------------------------------------------------------------------


def unbounded_ideal(w: Workload) -> list[int]:
    """Tokens of each prompt already computed by an earlier request (an unbounded cache).

    A conversation's history is computed up to its last reply token (which is sampled, never fed
    back); a system prompt counts once any request has computed it.
    """
    computed: dict[int, int] = {}
    seen: set[int] = set()
    hits = []
    for t, n in zip(w.turns, w.prompt_lengths()):
        g = w.system_of[t.conversation]
        h = computed.get(t.conversation, w.system_len(t.conversation) if g in seen else 0)
        hits.append(min(h, n - 1))
        computed[t.conversation] = n + w.max_new_tokens - 1
        seen.add(g)
    return hits


def offline_optimal(w: Workload, capacity: int) -> list[int]:
    """Hits of the best possible cache of `capacity` tokens that knows the future (one-turn
    conversations only: then only system prompts are ever reused).

    Belady's MIN with bypass, per token: after each request keep the system prompts whose next
    use is soonest, the last one kept partially (its leading tokens). Every token of a prompt is
    next used at the same time, so this is MIN on unit pages, which no policy beats, and what it
    keeps is always a prefix.
    """
    assert not any(w.more_turns()), "offline optimum is defined here for one-turn conversations"
    groups = [w.system_of[t.conversation] for t in w.turns]
    uses: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        uses.setdefault(g, []).append(i)

    def next_use(g: int, i: int) -> float:
        k = bisect.bisect_right(uses[g], i)
        return uses[g][k] if k < len(uses[g]) else math.inf

    kept: dict[int, int] = {}
    hits = []
    for i, (g, n) in enumerate(zip(groups, w.prompt_lengths())):
        hits.append(min(kept.get(g, 0), n - 1))
        kept[g] = len(w.systems[g])
        room, new = capacity, {}
        for x in sorted(kept, key=lambda x: next_use(x, i)):
            if next_use(x, i) == math.inf or room == 0:
                break
            new[x] = min(kept[x], room)
            room -= new[x]
        kept = new
    return hits


def lru_whole_prefixes(w: Workload, capacity: int) -> list[int]:
    """Hits of an LRU cache of whole system prompts in `capacity` tokens (a reference point)."""
    cache: OrderedDict[int, int] = OrderedDict()
    hits = []
    for t, n in zip(w.turns, w.prompt_lengths()):
        g = w.system_of[t.conversation]
        hits.append(min(cache.get(g, 0), n - 1))
        cache[g] = w.system_len(t.conversation)
        cache.move_to_end(g)
        while sum(cache.values()) > capacity:
            cache.popitem(last=False)
    return hits


def computed_tokens(w: Workload, hits: list[int]) -> int:
    """Tokens whose KV a server with these hits computes (and a cache would store)."""
    return sum(n + w.max_new_tokens - 1 - h for n, h in zip(w.prompt_lengths(), hits))


# ---- running -----------------------------------------------------------------------------------


class Transcript:
    """One server's view of the conversations: its own replies go into the next turn's prompt."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        self.history: dict[int, list[int]] = {}

    def prompt(self, turn: Turn) -> list[int]:
        c = turn.conversation
        return [*self.history.get(c, self.w.systems[self.w.system_of[c]]), *turn.user]

    def record(self, turn: Turn, sequence: list[int], more: bool) -> None:
        if more:
            self.history[turn.conversation] = sequence
        else:
            self.history.pop(turn.conversation, None)


@dataclass(slots=True)
class Lane:
    """One server walking through a workload, one request per measured round."""

    server: Server
    workload: Workload
    plan: list[int]
    clock: Callable[[], float]
    more: list[bool] = field(default_factory=list)
    transcript: Transcript | None = None
    ttft: list[float] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    request: Request | None = None
    served: Served | None = None

    def __post_init__(self) -> None:
        self.more = self.workload.more_turns()
        self.transcript = Transcript(self.workload)

    def setup(self) -> None:
        i = len(self.hits)
        turn = self.workload.turns[i]
        c = turn.conversation
        w = self.workload
        prompt = self.transcript.prompt(turn)
        self.request = Request(
            prompt, c, w.system_of[c], w.system_len(c), w.max_new_tokens, self.plan[i], self.more[i]
        )
        self.server.prepare(self.request)

    def run(self) -> None:
        self.served = self.server.serve(self.request, self.clock)

    def teardown(self) -> None:
        r, s = self.request, self.served
        assert r is not None and s is not None
        turn = self.workload.turns[len(self.hits)]
        self.transcript.record(turn, [*r.ids, *s.tokens], r.more_turns)
        self.server.finish(r)
        self.ttft.append(s.ttft_s)
        self.hits.append(s.hit)
        self.prompt_tokens.append(len(r.ids))
        self.outputs.append(s.tokens)
        self.held.append(self.server.held_bytes())
        self.requests.append(r)
        self.request = self.served = None

    def variant(self) -> Variant:
        return Variant(self.server.name, self.run, self.setup, self.teardown)

    def walk(self) -> None:
        """Serve every request, untimed (warm-up)."""
        for _ in self.workload.turns:
            self.setup()
            self.run()
            self.teardown()


def warm_up(servers: list[Server], rounds: int, w: Workload, clock: Callable[[], float]) -> None:
    """Untimed: each server serves a short miss and a hit `rounds` times, then forgets them.

    The warm-up requests are no longer than the workload's own, so they fit any cache it sizes.
    """
    system = min(64, min(len(s) for s in w.systems))
    question = min(8, min(len(t.user) for t in w.turns))
    warm = shared_prompt(1, 2, system, question, min(2, w.max_new_tokens), w.vocab, seed=12345)
    plan = unbounded_ideal(warm)
    for server in servers:
        for _ in range(rounds):
            server.reset()
            Lane(server, warm, plan, clock).walk()
        server.reset()


@dataclass(slots=True)
class Row:
    """One variant's results on one workload."""

    variant: str
    hit_rate: float
    hit_vs_ideal: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    end_to_end_s: float
    generated_tok_per_s: float
    peak_kv_bytes: int
    same_tokens_as_ideal: int
    requests: int
    ttft_s: list[float] = field(repr=False, default_factory=list)
    latency_s: list[float] = field(repr=False, default_factory=list)
    hits: list[int] = field(repr=False, default_factory=list)


def row_for(
    name: str, run: Lane | AllAtOnce, latency: list[float] | float, peak: int, ideal_rate: float,
    reference: list[list[int]],
) -> Row:  # fmt: skip
    st = Stats.of(run.ttft)
    total = float(sum(latency)) if isinstance(latency, list) else float(latency)
    rate = sum(run.hits) / sum(run.prompt_tokens)
    vs_ideal = rate / ideal_rate if ideal_rate else float("nan")
    same = sum(o == r for o, r in zip(run.outputs, reference))
    return Row(
        name, rate, vs_ideal, st.mean, st.median, st.p99, total, sum(len(o) for o in run.outputs) / total,
        peak, same, len(run.outputs), list(run.ttft), list(latency) if isinstance(latency, list) else [],
        list(run.hits),
    )  # fmt: skip


def peak_bytes(lane: Lane, token_bytes: int) -> int:
    """Largest (KV kept between requests + the request's own cache); CB's paged cache holds both."""
    if isinstance(lane.server, ContinuousBatching):
        return max(lane.held)
    return max(h + working_bytes(r, token_bytes) for h, r in zip(lane.held, lane.requests))


@dataclass(slots=True)
class Setup:
    """What a workload run needs besides the workload: capacities, CB settings, who runs."""

    plan: list[int]
    capacity_tokens: int
    deepcopy_prefixes: int | None
    cb: BatchingConfig
    skip: frozenset[str]
    eviction: str = "gdsf"  # the kvblocks lane's policy
    also_eviction: tuple[str, ...] = ()  # more kvblocks lanes, one per policy, named "kvblocks, POLICY"


@dataclass(slots=True)
class AllAtOnce:
    """Continuous batching given every request of a turn wave together: per-request results
    (TTFT includes queueing) and the time of the whole run."""

    outputs: list[list[int]]
    hits: list[int]
    ttft: list[float]
    prompt_tokens: list[int]
    elapsed_s: float
    cache_bytes: int


def run_workload(
    model, tokenizer, w: Workload, setup: Setup, opts: BenchOptions
) -> tuple[dict[str, Lane], AllAtOnce | None]:
    """Interleaved run of every server; returns the lanes by name and CB's all-at-once run."""
    clock = CLOCKS[opts.clock]
    kv = Kvblocks(model, tokenizer, setup.capacity_tokens, setup.eviction)
    servers: list[Server] = [Ideal(model), kv]
    for policy in setup.also_eviction:
        servers.append(Kvblocks(model, tokenizer, setup.capacity_tokens, policy, f"kvblocks, {policy}"))
    if "no-reuse" not in setup.skip:
        servers.append(NoReuse(model))
    if "deepcopy" not in setup.skip:
        servers.append(DeepcopyRecipe(model, setup.deepcopy_prefixes))
    if "cb" not in setup.skip:
        servers.append(ContinuousBatching(model, setup.cb, w.max_new_tokens))
    try:
        warm_up(servers, opts.warmup, w, clock)
        lanes = {s.name: Lane(s, w, setup.plan, clock) for s in servers}
        variants = [lane.variant() for lane in lanes.values()]
        latency = measure(variants, len(w.turns), replace(opts, warmup=0), w.name)
    finally:
        for s in servers:
            s.close()
    for name, lane in lanes.items():
        lane.latency = latency[name]
    batch = None if "cb-batch" in setup.skip else run_all_at_once(model, w, setup.cb, clock)
    return lanes, batch


def run_all_at_once(model, w: Workload, config: BatchingConfig, clock: Callable[[], float]) -> AllAtOnce:
    """Every request of a turn wave handed to continuous batching together, timed as a whole.

    Prompts of later waves carry CB's own replies, as a batch user's would.
    """
    batching = BatchingManager(model, w.max_new_tokens, config)
    transcript, more = Transcript(w), w.more_turns()
    n = len(w.turns)
    outputs: list[list[int]] = [[] for _ in range(n)]
    hits, ttft, prompt_tokens = [0] * n, [0.0] * n, [0] * n
    try:
        t0 = clock()
        for wave in w.waves():
            prompts = [transcript.prompt(w.turns[i]) for i in wave]
            result = generate_all_at_once(batching, prompts, w.max_new_tokens)
            for k, i in enumerate(wave):
                outputs[i], hits[i], ttft[i] = result.outputs[k], result.hits[k], result.ttft_s[k]
                prompt_tokens[i] = len(prompts[k])
                transcript.record(w.turns[i], [*prompts[k], *outputs[i]], more[i])
        elapsed = clock() - t0
    finally:
        batching.close()
    return AllAtOnce(outputs, hits, ttft, prompt_tokens, elapsed, batching.cache_bytes)


# ---- reporting ---------------------------------------------------------------------------------


@dataclass(slots=True)
class WorkloadReport(Report):
    """A `Report` whose samples are TTFTs per variant, plus a table of every variant's results."""

    rows: list[Row] = field(default_factory=list)
    ideal_lines: dict[str, float] = field(default_factory=dict)

    def to_markdown(self) -> str:
        base = Report.to_markdown(self).split("\n")
        table = [
            "| variant | hit rate | vs ideal | TTFT mean | TTFT p50 | TTFT p99 | end-to-end | generated tok/s "
            "| peak KV | same tokens as ideal |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        table += [
            f"| {r.variant} | {r.hit_rate:.4f} | {r.hit_vs_ideal:.4f} | {fmt_seconds(r.ttft_mean_s)} | "
            f"{fmt_seconds(r.ttft_p50_s)} | {fmt_seconds(r.ttft_p99_s)} | {fmt_seconds(r.end_to_end_s)} | "
            f"{fmt_number(r.generated_tok_per_s)} | {r.peak_kv_bytes / MB:,.0f} MB | "
            f"{r.same_tokens_as_ideal}/{r.requests} |"
            for r in self.rows
        ]
        return "\n".join([*base[:4], *table, "", "TTFT per variant:", "", *base[4:]])

    def to_json(self, machine: dict[str, object]) -> dict[str, object]:
        return Report.to_json(self, machine) | {
            "variants": [asdict(r) for r in self.rows],
            "ideal_hit_rates": self.ideal_lines,
        }

    def save(self, opts: BenchOptions, machine: dict[str, object]) -> list[Path]:
        paths = Report.save(self, opts, machine)
        if opts.plots:
            paths.append(opts.out / f"{self.name}-overview.png")
            plot_overview(self, paths[-1])
        return paths


def plot_overview(report: WorkloadReport, path: Path) -> None:
    """TTFT of every request per variant, hit rate against the ideal, end-to-end time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.rows
    names = [
        textwrap.fill(r.variant + (" (TTFT incl. queueing)" if r.variant == CB_BATCH else ""), 14)
        for r in rows
    ]
    x = np.arange(len(rows))
    colors = [f"C{k}" for k in range(len(rows))]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 5.2))
    rng = np.random.default_rng(0)
    for k, r in enumerate(rows):
        y = np.asarray(r.ttft_s) * 1e3
        a.scatter(k + rng.uniform(-0.25, 0.25, len(y)), y, s=12, alpha=0.6, color=colors[k])
        a.hlines(np.median(y), k - 0.35, k + 0.35, color="black", lw=2)
    a.set_yscale("log")
    a.set_ylabel("time to first token, ms (log scale)")
    a.set_title("TTFT of every request (bar: median)")
    b.bar(x, [r.hit_rate for r in rows], color=colors)
    styles = iter(["--", ":", "-."])
    for label, value in report.ideal_lines.items():
        b.axhline(value, ls=next(styles), color="black", lw=1.2, label=f"{label}: {value:.3f}")
    for k, r in enumerate(rows):
        b.annotate(f"{r.hit_rate:.3f}", (k, r.hit_rate), ha="center", va="bottom", fontsize=8)
    b.set_ylabel("prompt tokens not prefilled / prompt tokens")
    b.set_title("Hit rate against the ideal")
    b.set_ylim(0, 1.18 * max(1e-9, *[r.hit_rate for r in rows], *report.ideal_lines.values()))
    b.legend(loc="upper right", fontsize=8, framealpha=0.95)
    kv = next(r.end_to_end_s for r in rows if r.variant == "kvblocks")
    c.bar(x, [r.end_to_end_s for r in rows], color=colors)
    for k, r in enumerate(rows):
        c.annotate(f"{r.end_to_end_s / kv:.2f}x", (k, r.end_to_end_s), ha="center", va="bottom", fontsize=8)
    c.set_ylabel("seconds, all requests")
    c.set_title("End-to-end time (label: vs kvblocks)")
    for ax in (a, b, c):
        ax.set_xticks(x, names, fontsize=8)
    fig.suptitle(report.title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_report(
    lanes: dict[str, Lane], batch: AllAtOnce | None, ideals: dict[str, float], params: dict[str, object],
    bounded: bool, token_bytes: int,
) -> WorkloadReport:  # fmt: skip
    ideal_rate = next(iter(ideals.values()))
    reference = lanes["ideal"].outputs
    rows = [
        row_for(name, lane, lane.latency, peak_bytes(lane, token_bytes), ideal_rate, reference)
        for name, lane in lanes.items()
    ]
    rows = [rows[1], rows[0], *rows[2:]]  # kvblocks first, then the ideal, then the baselines
    if batch is not None:
        rows.append(row_for(CB_BATCH, batch, batch.elapsed_s, batch.cache_bytes, ideal_rate, reference))
    title = SUITES[str(params["workload"])].title
    samples = {name: lane.ttft for name, lane in lanes.items()}
    name = f"workload-{params['workload']}"
    report = WorkloadReport(name, title, params, samples, baseline="ideal", rows=rows, ideal_lines=ideals)
    report.checks = checks(rows, lanes, ideals, bounded)
    return report


def checks(rows: list[Row], lanes: dict[str, Lane], ideals: dict[str, float], bounded: bool) -> list[Check]:
    by = {r.variant: r for r in rows}
    kv, ideal = by["kvblocks"], by["ideal"]
    out: list[Check] = []
    labels = list(ideals)
    if bounded:
        for r in rows:
            if r.variant == "kvblocks" or r.variant.startswith("kvblocks, "):
                out += [
                    Check(f"{r.variant} hit rate / {label}", r.hit_rate / ideals[label]) for label in labels
                ]
    else:
        out.append(Check("kvblocks hit rate / ideal", kv.hit_rate / ideals[labels[0]], "", 0.99, True))
    out.append(Check("kvblocks TTFT / ideal, ratio of medians", kv.ttft_p50_s / ideal.ttft_p50_s, "", 1.10))
    out.append(Check("kvblocks TTFT / ideal, ratio of means", kv.ttft_mean_s / ideal.ttft_mean_s))
    k, i = lanes["kvblocks"], lanes["ideal"]
    equal = [a / b for a, b, ha, hb in zip(k.ttft, i.ttft, k.hits, i.hits) if ha == hb]
    if equal:
        metric = f"kvblocks TTFT / ideal at equal hits (median per request, {len(equal)} requests)"
        out.append(Check(metric, float(np.median(equal))))
    for r in rows:
        if r.variant in ("kvblocks", "ideal") or r.variant.startswith("kvblocks, "):
            continue
        if r.variant != CB_BATCH:
            out.append(
                Check(f"{r.variant} / kvblocks, mean TTFT", r.ttft_mean_s / kv.ttft_mean_s, "", 1.0, True)
            )
        out.append(
            Check(f"{r.variant} / kvblocks, end-to-end", r.end_to_end_s / kv.end_to_end_s, "", 1.0, True)
        )
    return out


def common_notes(
    opts: BenchOptions, setup: Setup, w: Workload, lanes: dict[str, Lane], batch: AllAtOnce | None
) -> list[str]:
    kv = lanes["kvblocks"].server
    stats = kv.trie.stats() if isinstance(kv, Kvblocks) and kv.trie is not None else {}
    notes = [
        f"{len(w.turns)} requests served one at a time by every variant, interleaved request by request in "
        f"rotated order after {opts.warmup} untimed warm-up round(s) per variant; every variant starts cold; "
        f"clock: {opts.clock}; greedy decoding of exactly {w.max_new_tokens} tokens (EOS ignored)",
        "hit rate = prompt tokens a variant did not prefill / prompt tokens; TTFT = request start to first "
        "token; end-to-end = sum of the request latencies (closed loop, one request in flight)",
        "ideal = the bare model (`ModelRunner.forward`) prefilling only the tokens an oracle knows are already "
        "computed, on a ready `DynamicCache` handed over untimed; kvblocks = `CachedGenerator.stream` on a "
        "`KVCacheTrie` (match, re-attach, prefill, decode with text assembly, insert), all timed; its TTFT is "
        "the time to its first streamed piece, which `CachedGenerator` yields after storing the prompt's KV",
        "deepcopy recipe = prefill each system prompt once by ids (timed, in the first request that needs it), "
        "`copy.deepcopy` it per request, prefill the rest, decode, with the same forward loop as the ideal",
        f"transformers CB = `model.init_continuous_batching` (transformers' `ContinuousBatchingManager`, paged "
        f"cache with block-level prefix sharing), page_size={setup.cb.page_size}, num_blocks={setup.cb.num_blocks}, "
        f"max_batch_tokens={setup.cb.max_batch_tokens}; its hits are read from the scheduler's "
        "`search_prefix_match`",
        "peak KV = tensor accounting, not RSS: max over requests of (K/V bytes a variant keeps between requests "
        "+ the request's own cache of prompt + reply); for kvblocks the kept bytes are the resident tokens of its "
        f"pool ({setup.capacity_tokens:,}-token pool preallocated with torch.empty, only touched pages become "
        "resident); for CB the preallocated paged cache, which holds both",
        f"kvblocks trie at the end: {stats.get('resident_tokens', 0):,} resident tokens, "
        f"{stats.get('evicted_tokens', 0):,} evicted, {stats.get('insert_dropped_tokens', 0):,} dropped at insert",
    ]
    if batch is not None:
        notes.append(
            f"{CB_BATCH} = every request of a turn wave submitted together (`add_requests`, as "
            "`model.generate_batch` does, which also sorts the prompts so that equal prefixes run back to back: "
            "the arrival order the ideals are computed for does not bind it), timed once as a whole, not "
            "interleaved; its TTFT includes queueing behind the other requests (wall clock: transformers' own "
            "perf_counter timestamps), so only its end-to-end time is compared"
        )
    return notes


# ---- command line ------------------------------------------------------------------------------

COMMON_OPTIONS = (
    Option("--seed", int, 0, "seed of the token ids and arrival order (default 0)"),
    Option("--eviction", None, DEFAULT_POLICY, "the kvblocks lane's eviction policy",
           choices=tuple(POLICIES)),
    Option("--also-eviction", None, [],
           "add a kvblocks lane with this eviction policy, named 'kvblocks, POLICY' (repeatable)",
           choices=tuple(POLICIES), repeat=True),
    Option("--skip", None, [], "leave out a baseline (repeatable)", choices=OPTIONAL, repeat=True),
    Group("transformers continuous batching", (
        Option("--cb-page-size", positive_int, 256, "tokens per page (default 256)"),
        Option("--cb-max-batch-tokens", positive_int, 2048, "tokens per batch (default 2048)"),
        Option("--cb-blocks", positive_int, None,
               "paged cache blocks (default: as many tokens as kvblocks may cache, plus one request)"),
    )),
)  # fmt: skip
SHARED_OPTIONS = (
    Option("--groups", positive_int, 4, "system prompts (default 4)"),
    Option("--prompts-per-group", positive_int, 8, "requests per group (default 8)"),
    Option("--system", positive_int, 1024, "system prompt tokens (default 1024)"),
    Option("--question", positive_int, 32, "question tokens (default 32)"),
    Option("--output", positive_int, 16, "generated tokens (default 16)"),
    Option("--order", None, "arrival",
           "arrival: shuffled (default); sorted: equal system prompts back to back, the order "
           "transformers' generate_batch runs them in", choices=("arrival", "sorted")),
)  # fmt: skip
MULTI_TURN_OPTIONS = (
    Option("--conversations", positive_int, 8, "conversations (default 8)"),
    Option("--turns", positive_int, 4, "turns per conversation (default 4)"),
    Option("--systems", positive_int, 1, "distinct system prompts (default 1)"),
    Option("--system", positive_int, 1024, "system prompt tokens (default 1024)"),
    Option("--user", positive_int, 32, "user tokens per turn (default 32)"),
    Option("--output", positive_int, 16, "reply tokens per turn (default 16)"),
)
PRESSURE_OPTIONS = (
    Option("--capacity-fraction", float, 0.5,
           "cache capacity as a fraction of all system prompt tokens (default 0.5: half of them)"),
    Option("--zipf", float, 0.0,
           "skewed popularity: each request picks system prompt k with probability ~ 1/k**S "
           "(default 0: every prompt equally often)", metavar="S"),
)  # fmt: skip
SHARED_PARAMS = ("groups", "prompts_per_group", "system", "question", "output", "order")


@dataclass(slots=True, frozen=True)
class Suite:
    """One workload suite: its command line, its report's title and the flags its params record."""

    help: str
    description: str
    title: str
    options: tuple[Option | Group, ...]
    params: tuple[str, ...]


SUITES = {
    "shared-prompt": Suite(
        "G groups x P prompts sharing a system prompt, against the alternatives",
        "Shared system prompts: kvblocks against no reuse, the deepcopy recipe, transformers "
        "continuous batching and the ideal.",
        "Shared system prompts",
        (*COMMON_OPTIONS, *SHARED_OPTIONS),
        (*SHARED_PARAMS, "eviction"),
    ),
    "multi-turn": Suite(
        "conversations whose turns carry the whole history, against the alternatives",
        "Multi-turn chat: every turn resends the history, the model's replies included.",
        "Multi-turn conversations",
        (*COMMON_OPTIONS, *MULTI_TURN_OPTIONS),
        ("conversations", "turns", "systems", "system", "user", "output", "eviction"),
    ),
    "pressure": Suite(
        "shared-prompt with a cache too small for the system prompts: eviction vs the offline optimum",
        "Shared system prompts with a cache that holds only a fraction of them.",
        "Shared system prompts under cache pressure",
        (*COMMON_OPTIONS, *SHARED_OPTIONS, *PRESSURE_OPTIONS),
        (*SHARED_PARAMS, "capacity_fraction", "zipf", "eviction"),
    ),
}


def add_parser(suites: argparse._SubParsersAction) -> None:
    for kind, suite in SUITES.items():
        run = functools.partial(run_kind, kind)
        text = {"help": suite.help, "description": suite.description}
        add_suite(suites, kind, run, **text, model=True, options=suite.options)


def run_kind(kind: str, args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    if kind == "pressure" and not 0.0 < args.capacity_fraction < 1.0:
        raise UserError(f"--capacity-fraction must be in (0, 1), got {args.capacity_fraction}")
    model, tokenizer = fixtures.load_model(args.model)
    return [bench_workload(model, tokenizer, kind, vars(args), opts)]


def make_workload(kind: str, sizes: dict, vocab: int) -> Workload:
    if kind == "multi-turn":
        shape = [sizes[k] for k in ("conversations", "turns", "system", "user", "output")]
        return multi_turn(*shape, vocab, sizes["systems"], sizes["seed"])
    shape = [sizes[k] for k in ("groups", "prompts_per_group", "system", "question", "output")]
    w = shared_prompt(*shape, vocab, sizes["seed"], sizes.get("order", "arrival"), sizes.get("zipf", 0.0))
    if kind == "pressure":
        w.name = "pressure"
    return w


@dataclass(slots=True)
class Plan:
    """The ideal a workload is held to and the cache sizes every server gets for it."""

    hits: list[int]  # the ideal's hits, request by request
    ideals: dict[str, float]  # hit-rate lines, the one the checks divide by first
    capacity: int  # kvblocks' pool, in tokens
    prefixes: int | None  # system prompt caches the deepcopy recipe keeps (None: all)
    notes: list[str]  # what the ideal is, first in the report's notes


def plan_unbounded(kind: str, w: Workload, sizes: dict) -> Plan:
    """An unbounded cache: the ideal hits everything computed before; every cache holds it all."""
    lengths, hits = w.prompt_lengths(), unbounded_ideal(w)
    rate = sum(hits) / sum(lengths)
    capacity = math.ceil(1.25 * computed_tokens(w, hits)) + max(lengths) + w.max_new_tokens
    if kind == "shared-prompt":
        s, q, p = sizes["system"], sizes["question"], sizes["prompts_per_group"]
        formula = s * (p - 1) / (p * (s + q))
        assert abs(formula - rate) < 1e-12, (formula, rate)
        note = f"ideal hit rate S(P-1)/(P(S+Q)) = {formula:.4f} (unbounded cache)"
    else:
        note = (
            f"ideal hit rate = history already computed / prompt tokens = {rate:.4f}: a turn hits the previous "
            "prompt and all but the last token of the reply (that one is sampled, never fed back); a "
            "conversation's first turn hits the system prompt once any conversation has computed it"
        )
    return Plan(hits, {"ideal": rate}, capacity, None, [note])


def plan_pressure(w: Workload, sizes: dict) -> Plan:
    """A cache for a fraction of the system prompts: the ideal is the offline optimum at that size."""
    lengths = w.prompt_lengths()
    rate = sum(unbounded_ideal(w)) / sum(lengths)
    system_tokens = sum(len(s) for s in w.systems)
    capacity = max(1, int(sizes["capacity_fraction"] * system_tokens))
    hits = offline_optimal(w, capacity)
    optimum = sum(hits) / sum(lengths)
    lru = sum(lru_whole_prefixes(w, capacity)) / sum(lengths)
    prefixes = max(1, capacity // max(len(s) for s in w.systems))
    notes = [
        f"capacity {capacity:,} tokens = {sizes['capacity_fraction']} x {system_tokens:,} system prompt tokens "
        f"({len(w.systems)} prompts of {len(w.systems[0])}); kvblocks' pool has exactly that; the deepcopy "
        f"recipe keeps the {prefixes} most recently used system caches; CB gets that many tokens of pages "
        "plus one request's pages (its running request lives in the same cache)",
        f"ideal = offline optimum for this capacity (Belady's MIN with bypass over system prompt tokens: keep "
        f"the prompts needed soonest), hit rate {optimum:.4f}; unbounded ideal "
        f"{rate:.4f}; an LRU cache of whole system prompts would get {lru:.4f}",
    ]
    ideals = {"offline optimal, same capacity": optimum, "unbounded ideal": rate}
    return Plan(hits, ideals, capacity, prefixes, notes)


def bench_workload(model, tokenizer, kind: str, sizes: dict, opts: BenchOptions) -> WorkloadReport:
    """Build the workload `kind` from `sizes` (the CLI's flags), run every variant, report."""
    from kvblocks.generate.generator import context_length

    w = make_workload(kind, sizes, model.config.vocab_size)
    longest = max(w.prompt_lengths()) + w.max_new_tokens
    limit = context_length(model.config)
    if limit is not None and longest > limit:
        raise UserError(f"the longest request needs {longest} tokens; the model's context is {limit}")
    plan = plan_pressure(w, sizes) if kind == "pressure" else plan_unbounded(kind, w, sizes)
    page = sizes["cb_page_size"]
    blocks = math.ceil(plan.capacity / page) + math.ceil(longest / page) + 1
    cb = BatchingConfig(page, sizes.get("cb_blocks") or blocks, sizes["cb_max_batch_tokens"])
    policy = sizes.get("eviction", "gdsf")
    others = tuple(p for p in sizes.get("also_eviction") or () if p != policy)
    skip = frozenset(sizes.get("skip") or ())
    setup = Setup(plan.hits, plan.capacity, plan.prefixes, cb, skip, policy, others)
    lanes, batch = run_workload(model, tokenizer, w, setup, opts)
    kv = lanes["kvblocks"].server
    token_bytes = kv.trie.token_bytes if isinstance(kv, Kvblocks) and kv.trie is not None else 0
    params = _params(kind, sizes, model, opts, len(w.turns), plan.capacity)
    report = build_report(lanes, batch, plan.ideals, params, kind == "pressure", token_bytes)
    report.notes = [*plan.notes, *common_notes(opts, setup, w, lanes, batch)]
    return report


def _params(kind: str, sizes: dict, model, opts: BenchOptions, requests: int, capacity: int) -> dict:
    return (
        {"workload": kind, **fixtures.model_params(model)}
        | {k: sizes[k] for k in SUITES[kind].params}
        | {"requests": requests, "capacity_tokens": capacity, "seed": sizes["seed"], "clock": opts.clock}
    )
