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
    groups: int,
    per_group: int,
    system: int,
    question: int,
    output: int,
    vocab: int,
    seed: int = 0,
    order: str = "arrival",
    zipf: float = 0.0,
) -> Workload:
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
        "shared-prompt",
        systems,
        system_of,
        [Turn(i, tuple(questions[i])) for i in order_ids],
        output,
        vocab,
    )


def multi_turn(
    conversations: int,
    turns: int,
    system: int,
    user: int,
    output: int,
    vocab: int,
    systems: int = 1,
    seed: int = 0,
) -> Workload:
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
        self.request = Request(
            self.transcript.prompt(turn),
            c,
            self.workload.system_of[c],
            self.workload.system_len(c),
            self.workload.max_new_tokens,
            self.plan[i],
            self.more[i],
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
    name: str,
    ttft: list[float],
    latency: list[float] | float,
    hits: list[int],
    prompt_tokens: list[int],
    outputs: list[list[int]],
    peak_bytes: int,
    ideal_rate: float,
    reference: list[list[int]],
) -> Row:
    st = Stats.of(ttft)
    total = float(sum(latency)) if isinstance(latency, list) else float(latency)
    rate = sum(hits) / sum(prompt_tokens)
    return Row(
        name,
        rate,
        rate / ideal_rate if ideal_rate else float("nan"),
        st.mean,
        st.median,
        st.p99,
        total,
        sum(len(o) for o in outputs) / total,
        peak_bytes,
        sum(o == r for o, r in zip(outputs, reference)),
        len(outputs),
        list(ttft),
        list(latency) if isinstance(latency, list) else [],
        list(hits),
    )


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
    ttft_s: list[float]
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
        latency = measure(
            [lane.variant() for lane in lanes.values()], len(w.turns), replace(opts, warmup=0), w.name
        )
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
    w: Workload,
    lanes: dict[str, Lane],
    batch: AllAtOnce | None,
    ideals: dict[str, float],
    params: dict[str, object],
    bounded: bool,
    token_bytes: int,
) -> WorkloadReport:
    ideal_rate = next(iter(ideals.values()))
    reference = lanes["ideal"].outputs
    rows = [
        row_for(
            name,
            lane.ttft,
            lane.latency,
            lane.hits,
            lane.prompt_tokens,
            lane.outputs,
            peak_bytes(lane, token_bytes),
            ideal_rate,
            reference,
        )
        for name, lane in lanes.items()
    ]
    rows = [rows[1], rows[0], *rows[2:]]  # kvblocks first, then the ideal, then the baselines
    if batch is not None:
        rows.append(
            row_for(
                CB_BATCH,
                batch.ttft_s,
                batch.elapsed_s,
                batch.hits,
                batch.prompt_tokens,
                batch.outputs,
                batch.cache_bytes,
                ideal_rate,
                reference,
            )
        )
    title = {
        "shared-prompt": "Shared system prompts",
        "multi-turn": "Multi-turn conversations",
        "pressure": "Shared system prompts under cache pressure",
    }[params["workload"]]
    report = WorkloadReport(
        f"workload-{params['workload']}",
        title,
        params,
        {name: lane.ttft for name, lane in lanes.items()},
        baseline="ideal",
        rows=rows,
        ideal_lines=ideals,
    )
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
        out.append(
            Check(
                f"kvblocks TTFT / ideal at equal hits (median per request, {len(equal)} requests)",
                float(np.median(equal)),
            )
        )
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


def add_parser(suites: argparse._SubParsersAction) -> None:
    p = add_suite(
        suites,
        "shared-prompt",
        run_shared_prompt,
        help="G groups x P prompts sharing a system prompt, against the alternatives",
        description="Shared system prompts: kvblocks against no reuse, the deepcopy recipe, transformers "
        "continuous batching and the ideal.",
        model=True,
    )
    _common_args(p)
    _shared_args(p)

    p = add_suite(
        suites,
        "multi-turn",
        run_multi_turn,
        help="conversations whose turns carry the whole history, against the alternatives",
        description="Multi-turn chat: every turn resends the history, the model's replies included.",
        model=True,
    )
    _common_args(p)
    p.add_argument("--conversations", type=positive_int, default=8, help="conversations (default 8)")
    p.add_argument("--turns", type=positive_int, default=4, help="turns per conversation (default 4)")
    p.add_argument("--systems", type=positive_int, default=1, help="distinct system prompts (default 1)")
    p.add_argument("--system", type=positive_int, default=1024, help="system prompt tokens (default 1024)")
    p.add_argument("--user", type=positive_int, default=32, help="user tokens per turn (default 32)")
    p.add_argument("--output", type=positive_int, default=16, help="reply tokens per turn (default 16)")

    p = add_suite(
        suites,
        "pressure",
        run_pressure,
        help="shared-prompt with a cache too small for the system prompts: eviction vs the offline optimum",
        description="Shared system prompts with a cache that holds only a fraction of them.",
        model=True,
    )
    _common_args(p)
    _shared_args(p)
    p.add_argument(
        "--capacity-fraction",
        type=float,
        default=0.5,
        help="cache capacity as a fraction of all system prompt tokens (default 0.5: half of them)",
    )
    p.add_argument(
        "--zipf",
        type=float,
        default=0.0,
        metavar="S",
        help="skewed popularity: each request picks system prompt k with probability ~ 1/k**S "
        "(default 0: every prompt equally often)",
    )


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="seed of the token ids and arrival order (default 0)")
    p.add_argument(
        "--eviction",
        choices=list(POLICIES),
        default=DEFAULT_POLICY,
        help="the kvblocks lane's eviction policy",
    )
    p.add_argument(
        "--also-eviction",
        action="append",
        default=[],
        choices=list(POLICIES),
        help="add a kvblocks lane with this eviction policy, named 'kvblocks, POLICY' (repeatable)",
    )
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=OPTIONAL,
        help="leave out a baseline (repeatable)",
    )
    g = p.add_argument_group("transformers continuous batching")
    g.add_argument("--cb-page-size", type=positive_int, default=256, help="tokens per page (default 256)")
    g.add_argument(
        "--cb-max-batch-tokens", type=positive_int, default=2048, help="tokens per batch (default 2048)"
    )
    g.add_argument(
        "--cb-blocks",
        type=positive_int,
        default=None,
        help="paged cache blocks (default: as many tokens as kvblocks may cache, plus one request)",
    )


def _shared_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--groups", type=positive_int, default=4, help="system prompts (default 4)")
    p.add_argument("--prompts-per-group", type=positive_int, default=8, help="requests per group (default 8)")
    p.add_argument("--system", type=positive_int, default=1024, help="system prompt tokens (default 1024)")
    p.add_argument("--question", type=positive_int, default=32, help="question tokens (default 32)")
    p.add_argument("--output", type=positive_int, default=16, help="generated tokens (default 16)")
    p.add_argument(
        "--order",
        choices=("arrival", "sorted"),
        default="arrival",
        help="arrival: shuffled (default); sorted: equal system prompts back to back, the order "
        "transformers' generate_batch runs them in",
    )


def run_shared_prompt(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    return _run(args, opts, "shared-prompt")


def run_multi_turn(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    return _run(args, opts, "multi-turn")


def run_pressure(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    if not 0.0 < args.capacity_fraction < 1.0:
        raise UserError(f"--capacity-fraction must be in (0, 1), got {args.capacity_fraction}")
    return _run(args, opts, "pressure")


def _run(args: argparse.Namespace, opts: BenchOptions, kind: str) -> list[Report]:
    model, tokenizer = fixtures.load_model(args.model)
    return [bench_workload(model, tokenizer, kind, vars(args), opts)]


def make_workload(kind: str, sizes: dict, vocab: int) -> Workload:
    if kind == "multi-turn":
        return multi_turn(
            sizes["conversations"],
            sizes["turns"],
            sizes["system"],
            sizes["user"],
            sizes["output"],
            vocab,
            sizes["systems"],
            sizes["seed"],
        )
    w = shared_prompt(
        sizes["groups"],
        sizes["prompts_per_group"],
        sizes["system"],
        sizes["question"],
        sizes["output"],
        vocab,
        sizes["seed"],
        sizes.get("order", "arrival"),
        sizes.get("zipf", 0.0),
    )
    if kind == "pressure":
        w.name = "pressure"
    return w


def bench_workload(model, tokenizer, kind: str, sizes: dict, opts: BenchOptions) -> WorkloadReport:
    """Build the workload `kind` from `sizes` (the CLI's flags), run every variant, report."""
    from kvblocks.generate.generator import context_length

    w = make_workload(kind, sizes, model.config.vocab_size)
    lengths = w.prompt_lengths()
    longest = max(lengths) + w.max_new_tokens
    limit = context_length(model.config)
    if limit is not None and longest > limit:
        raise UserError(f"the longest request needs {longest} tokens; the model's context is {limit}")
    unbounded = unbounded_ideal(w)
    rate = sum(unbounded) / sum(lengths)
    page = sizes["cb_page_size"]
    request_pages = math.ceil(longest / page) + 1
    bounded = kind == "pressure"
    if bounded:
        system_tokens = sum(len(s) for s in w.systems)
        capacity = max(1, int(sizes["capacity_fraction"] * system_tokens))
        plan = offline_optimal(w, capacity)
        ideals = {
            "offline optimal, same capacity": sum(plan) / sum(lengths),
            "unbounded ideal": rate,
        }
        lru = lru_whole_prefixes(w, capacity)
        prefixes = max(1, capacity // max(len(s) for s in w.systems))
        blocks = math.ceil(capacity / page) + request_pages
    else:
        plan, ideals = unbounded, {"ideal": rate}
        capacity = math.ceil(1.25 * computed_tokens(w, unbounded)) + longest
        prefixes = None
        blocks = math.ceil(capacity / page) + request_pages
    cb = BatchingConfig(page, sizes.get("cb_blocks") or blocks, sizes["cb_max_batch_tokens"])
    policy = sizes.get("eviction", "gdsf")
    others = tuple(p for p in sizes.get("also_eviction") or () if p != policy)
    setup = Setup(plan, capacity, prefixes, cb, frozenset(sizes.get("skip") or ()), policy, others)
    lanes, batch = run_workload(model, tokenizer, w, setup, opts)
    kv = lanes["kvblocks"].server
    token_bytes = kv.trie.token_bytes if isinstance(kv, Kvblocks) and kv.trie is not None else 0
    params = _params(kind, sizes, model, opts, len(w.turns), capacity)
    report = build_report(w, lanes, batch, ideals, params, bounded, token_bytes)
    report.notes = common_notes(opts, setup, w, lanes, batch)
    if kind == "shared-prompt":
        s, q, p = sizes["system"], sizes["question"], sizes["prompts_per_group"]
        formula = s * (p - 1) / (p * (s + q))
        assert abs(formula - rate) < 1e-12, (formula, rate)
        report.notes.insert(0, f"ideal hit rate S(P-1)/(P(S+Q)) = {formula:.4f} (unbounded cache)")
    elif kind == "multi-turn":
        report.notes.insert(
            0,
            f"ideal hit rate = history already computed / prompt tokens = {rate:.4f}: a turn hits the previous "
            "prompt and all but the last token of the reply (that one is sampled, never fed back); a "
            "conversation's first turn hits the system prompt once any conversation has computed it",
        )
    else:
        report.notes[0:0] = [
            f"capacity {capacity:,} tokens = {sizes['capacity_fraction']} x {system_tokens:,} system prompt tokens "
            f"({len(w.systems)} prompts of {len(w.systems[0])}); kvblocks' pool has exactly that; the deepcopy "
            f"recipe keeps the {prefixes} most recently used system caches; CB gets that many tokens of pages "
            "plus one request's pages (its running request lives in the same cache)",
            f"ideal = offline optimum for this capacity (Belady's MIN with bypass over system prompt tokens: keep "
            f"the prompts needed soonest), hit rate {ideals['offline optimal, same capacity']:.4f}; unbounded ideal "
            f"{rate:.4f}; an LRU cache of whole system prompts would get {sum(lru) / sum(lengths):.4f}",
        ]
    return report


def _params(kind: str, sizes: dict, model, opts: BenchOptions, requests: int, capacity: int) -> dict:
    keys = {
        "shared-prompt": ("groups", "prompts_per_group", "system", "question", "output", "order", "eviction"),
        "pressure": (
            "groups",
            "prompts_per_group",
            "system",
            "question",
            "output",
            "order",
            "capacity_fraction",
            "zipf",
            "eviction",
        ),
        "multi-turn": ("conversations", "turns", "systems", "system", "user", "output", "eviction"),
    }[kind]
    name = getattr(model.config, "name_or_path", "") or model.config.model_type
    return (
        {"workload": kind, "model": name, "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
        | {k: sizes[k] for k in keys}
        | {"requests": requests, "capacity_tokens": capacity, "seed": sizes["seed"], "clock": opts.clock}
    )
