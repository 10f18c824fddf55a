"""`kvblocks bench specdec --only trees`: draft trees against draft chains with the same drafter.

Three workloads, each run with no speculation, a chain of `gamma` drafts and a tree `gamma` deep
(`--tree-width` branches per node, at most `--tree-tokens` nodes, adaptive), greedy unless said:

- agents: an agent's conversation holds earlier calls of the same tools with other arguments; the
  model writes the next call, so prompt lookup finds several earlier calls after `{"city": "`;
- retried: the same request retried with sampling (temperature 0.8, other seeds): the trie holds
  every earlier answer, and a tree drafts all of them where a chain drafts the most recent;
- templated: a form filled in line after line: lookup finds every earlier line's continuation.

Per workload: tokens per target forward of each variant, decode speed (generated tokens / time of
the generate call, the prompt served from the prefix cache after the warm-up), and the same requests
batched through the packed engine beside `--batched-others` plain requests (the tree must never be
slower than the chain there: adaptive shape). Greedy outputs of chain and tree must equal no
speculation's.
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass

from kvblocks.bench.harness import BenchOptions, Check, Report, Variant, measure
from kvblocks.errors import UserError

CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Perth"]
UNITS = ["celsius", "fahrenheit", "kelvin"]


def _agent_prompt(i: int) -> list[dict]:
    """A tool-calling conversation with earlier calls of the same tool with other arguments (city,
    unit, days): the next call forks at each argument where the history holds several values."""
    calls = []
    for k in range(5):
        city, unit, days = CITIES[(i + k) % len(CITIES)], UNITS[(i + k) % len(UNITS)], 1 + (i + k) % 4
        call = f'{{"city": "{city}", "unit": "{unit}", "days": {days}}}'
        calls += [
            {"role": "user", "content": f"Forecast for {city} in {unit}, {days} days?"},
            {"role": "assistant", "content": f'{{"name": "get_forecast", "arguments": {call}}}'},
            {"role": "user", "content": f"Tool result: {10 + k} degrees in {city}."},
        ]
    system = (
        "You call tools by answering with one JSON object and nothing else: "
        '{"name": "get_forecast", "arguments": {"city": ..., "unit": ..., "days": ...}}.'
    )
    city, unit, days = CITIES[(i + 2) % len(CITIES)], UNITS[(i + 3) % len(UNITS)], 1 + (i + 1) % 4
    ask = {"role": "user", "content": f"Forecast for {city} in {unit}, {days} days?"}
    return [{"role": "system", "content": system}, *calls, ask]


def _template_prompt(i: int) -> list[dict]:
    names = ["Ada", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hal"]
    rows = "\n".join(f"Name: {n}, Team: Blue, Role: engineer, Status: active" for n in names[:3])
    rest = ", ".join(names[3 + i % 2 :])
    return [
        {
            "role": "user",
            "content": f"Continue this list in exactly the same format for {rest}:\n{rows}\n",
        }
    ]


def _retry_prompt(i: int) -> list[dict]:
    return [{"role": "user", "content": "Give me a one-line motto for a bakery."}]


@dataclass(slots=True)
class TreeWorkload:
    name: str
    drafter: str  # lookup or trie
    prompts: list  # chat messages per request
    temperature: float = 0.0


WORKLOADS = {
    "agents": TreeWorkload("agents", "lookup", [_agent_prompt(i) for i in range(3)]),
    "retried": TreeWorkload("retried", "trie", [_retry_prompt(i) for i in range(3)], temperature=0.8),
    "templated": TreeWorkload("templated", "lookup", [_template_prompt(i) for i in range(2)]),
}


def bench_trees(opts: BenchOptions, model, tokenizer, args: argparse.Namespace) -> list[Report]:
    from kvblocks import CachedGenerator, KVCacheTrie
    from kvblocks.specdec import PromptLookupDrafter, SpeculativeGenerator, TreeShape, TrieDrafter

    gamma, tokens = args.tree_gamma, args.tree_max_tokens
    shape = TreeShape(budget=args.tree_tokens, depth=args.tree_depth, width=args.tree_width)
    chain_gammas = sorted({gamma, *(int(g) for g in str(args.tree_chain_gammas).split(",") if g.strip())})
    reports = []
    names = [n.strip() for n in args.tree_workloads.split(",") if n.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        raise UserError(
            f"--tree-workloads: unknown {', '.join(unknown)} (choose from {', '.join(WORKLOADS)})"
        )
    cost = None  # one cost model for the whole run: probed by the first tree generator
    for w in (WORKLOADS[n] for n in names):
        cache = KVCacheTrie.for_model(model, capacity_tokens=1 << 16)
        first: dict[str, int] = {}  # tokens the current request's first round emitted

        def drafter(w=w, cache=cache):
            return TrieDrafter(cache) if w.drafter == "trie" else PromptLookupDrafter()

        def observe(name: str, first=first):
            def on_round(rnd) -> None:
                first.setdefault(name, rnd.accepted + 1)

            return on_round

        gens: dict = {"plain": CachedGenerator(model, tokenizer, cache)}
        for g in chain_gammas:
            name = _chain(g)
            gens[name] = SpeculativeGenerator(
                model, tokenizer, cache, drafter(), gamma=g, on_round=observe(name)
            )
        gens["tree"] = SpeculativeGenerator(
            model, tokenizer, cache, drafter(), tree=shape, cost=cost, on_round=observe("tree")
        )
        cost = gens["tree"].step_cost()
        ids = w.prompts  # chat messages: the generators apply the chat template
        seeds = iter(range(1 << 30))
        spec: dict[str, list] = {name: [] for name in gens}
        outputs: dict[str, list] = {name: [] for name in gens}
        decode: dict[str, list] = {name: [] for name in gens}  # (tokens, seconds) after the first round

        def run(
            name, w=w, gens=gens, ids=ids, spec=spec, outputs=outputs, seeds=seeds, first=first, decode=decode
        ):
            seed = next(seeds)
            done = [0, 0.0]
            for prompt in ids:
                kw = {"temperature": w.temperature, "seed": seed} if w.temperature else {}
                first.pop(name, None)
                r = gens[name].generate(prompt, max_new_tokens=tokens, ignore_eos=False, **kw)
                outputs[name].append(r.token_ids)
                if r.spec is not None:
                    spec[name].append(r.spec)
                done[0] += len(r.token_ids) - first.get(name, 1)
                done[1] += r.total_s - r.ttft_s
            decode[name].append(tuple(done))

        variants = [Variant(name, lambda name=name: run(name)) for name in gens]
        samples = measure(variants, args.repeats, opts, desc=f"trees {w.name}")
        chains = [_chain(g) for g in chain_gammas]
        per_call = {name: _tokens_per_call(spec[name]) for name in (*chains, "tree")}
        rate = {name: _rate(decode[name][opts.warmup :]) for name in gens}
        best = max(chains, key=lambda c: rate[c])
        default = _chain(gamma)
        report = Report(
            f"specdec_trees_{w.name}",
            f"Draft trees vs chains: {w.name} ({w.drafter} drafter)",
            {
                "gamma": gamma,
                "chain_gammas": ",".join(map(str, chain_gammas)),
                "tree_tokens": shape.budget,
                "tree_depth": shape.depth,
                "tree_width": shape.width,
                "max_new_tokens": tokens,
            },
            samples,
            baseline="plain",
        )
        if not w.temperature:
            same = all(len({tuple(outputs[n][i]) for n in gens}) == 1 for i in range(len(outputs["plain"])))
            report.checks.append(
                Check("greedy output identical (plain, every chain, tree)", float(same), "", 1.0, True)
            )
        tpf = _ratio(per_call["tree"], per_call[default])
        target = w.name == "agents"
        report.checks += [
            *(Check(f"tokens per target forward, {c}", per_call[c]) for c in chains),
            Check("tokens per target forward, tree", per_call["tree"]),
            Check(f"tree / {default} tokens per forward", tpf, "x", 1.5 if target else None, True),
            Check(f"tree / {best} (the fastest chain) tokens per forward", _ratio(per_call["tree"], per_call[best]), "x"),
            *(Check(f"decode tokens/s, {n}", rate[n], "tok/s") for n in gens),
            Check(f"decode speed tree / {default}", _ratio(rate["tree"], rate[default]), "x", 1.3 if target else 1.0, True),
            Check(f"decode speed tree / {best} (the fastest chain)", _ratio(rate["tree"], rate[best]), "x"),
            Check("decode speed tree / no speculation", _ratio(rate["tree"], rate["plain"]), "x", 2.0 if target else None, True),
        ]  # fmt: skip
        if args.batched_others:
            chain_s, tree_s = _batched(gens, default, ids, tokens, args.batched_others)
            name = f"batched beside {args.batched_others}: tree / {default} time"
            report.checks.append(Check(name, tree_s / chain_s, "x", 1.05))
        report.notes.append(
            "decode speed: tokens after each request's first round / time from its first emission to "
            "its last (prefill and the first round left out, as in the other specdec suites); "
            f"targets judged against the default chain ({default}), the fastest chain reported beside"
        )
        report.notes.append(
            f"step cost: {cost.a * 1e3:.1f} ms + {cost.b * 1e3:.2f} ms a row past {cost.knee} rows"
        )
        report.notes.append("provisional when taken on a loaded machine")
        reports.append(report)
    return reports


def _chain(gamma: int) -> str:
    return f"chain γ={gamma}"


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def _rate(runs: list) -> float:
    """Median tokens per second over timed runs of (tokens, seconds)."""
    import statistics

    rates = [n / s for n, s in runs if s > 0]
    return statistics.median(rates) if rates else 0.0


def _tokens_per_call(stats: list) -> float:
    rounds = sum(s.rounds for s in stats)
    return sum(s.emitted for s in stats) / rounds if rounds else 0.0


def _batched(gens: dict, chain: str, ids: list, tokens: int, others: int) -> tuple[float, float]:
    """Seconds for the workload's requests beside `others` plain requests in one packed engine,
    with the chain generator and with the tree generator."""
    from kvblocks import GenerationParams
    from kvblocks.engine.batch import BatchEngine

    filler = [{"role": "user", "content": "Tell me about the sea."}]
    out = []
    for name in (chain, "tree"):
        engine = BatchEngine(gens[name], max_batch_size=others + len(ids)).start()
        try:
            done = threading.Semaphore(0)
            prompts = ids + [filler] * others
            start = time.perf_counter()
            for p in prompts:
                engine.submit(
                    p,
                    lambda item, done=done: done.release() if getattr(item, "result", None) is not None or isinstance(item, BaseException) else None,
                    params=GenerationParams(max_new_tokens=tokens),
                )  # fmt: skip
            for _ in prompts:
                done.acquire(timeout=600)
            out.append(time.perf_counter() - start)
        finally:
            engine.stop()
    return out[0], out[1]
