"""`kvblocks bench constrained`: what a grammar costs per token, and what compiling one costs.

SmolLM2-135M-Instruct decodes the same prompt with and without a JSON-schema constraint (the
arguments of a tool call), interleaved; the decode time per token after the first is compared.
Compiling a tool-call grammar (what every request with a forced `tool_choice` pays) is timed apart.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvblocks.bench.harness import (
    BenchOptions,
    Check,
    Option,
    Report,
    Variant,
    add_suite,
    measure,
    positive_int,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
QUERY = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_forecast", "description": "Weather forecast", "parameters": SCHEMA},
    },
    {
        "type": "function",
        "function": {"name": "search_docs", "description": "Search the manual", "parameters": QUERY},
    },
]
PROMPT = [{"role": "user", "content": "Give me the forecast for Paris in celsius for 3 days, as JSON."}]


def add_parser(suites: argparse._SubParsersAction) -> None:
    add_suite(
        suites,
        "constrained",
        run,
        help="constrained decoding: per-token overhead of a JSON-schema grammar, grammar compile time",
        description="Constrained decoding (llguidance) on the --model, against unconstrained decoding.",
        model=True,
        options=[Option("--repeats", positive_int, 7, "timed runs per variant (default 7)")],
    )


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    return [bench_constrained(args.model, args.repeats, opts)]


def bench_constrained(model_path: str | None, repeats: int, opts: BenchOptions) -> Report:
    from kvblocks import CachedGenerator, models
    from kvblocks.generate import grammar, tools
    from kvblocks.generate.params import GenerationParams

    model, tokenizer = models.load(model_path)
    gen = CachedGenerator(model, tokenizer, None)
    constraint = grammar.json_schema_constraint(tokenizer, gen.vocab_size, SCHEMA, True)
    constrained = gen.generate(PROMPT, GenerationParams(max_new_tokens=64, constraint=constraint))
    n = len(constrained.token_ids)  # the free run decodes as many tokens, EOS ignored
    per_token: dict[str, list[float]] = {"unconstrained": [], "json schema": []}

    def decode(name: str, params: GenerationParams) -> None:
        r = gen.generate(PROMPT, params)
        per_token[name].append((r.total_s - r.ttft_s) / max(1, len(r.token_ids) - 1))

    free = {"max_new_tokens": n, "ignore_eos": True}
    variants = [
        Variant("unconstrained", lambda: decode("unconstrained", GenerationParams(**free))),
        Variant(
            "json schema",
            lambda: decode("json schema", GenerationParams(max_new_tokens=64, constraint=constraint)),
        ),
    ]
    measure(variants, repeats, opts, "constrained decoding")
    warm = opts.warmup
    samples = {name: values[warm:] for name, values in per_token.items()}  # timed rounds only
    parser = tools.get_parser("hermes")
    compile_s = []
    for _ in range(max(repeats, 5)):
        t0 = time.perf_counter()
        lark = tools.tool_call_grammar(
            TOOLS, "required", parser, parallel_tool_calls=False, tokenizer=tokenizer
        )
        grammar.lark_constraint(tokenizer, gen.vocab_size, lark).start()
        compile_s.append(time.perf_counter() - t0)
    title = "Constrained decoding on SmolLM2-135M-Instruct (per decoded token)"
    params = {"tokens": n, "repeats": repeats, "output": constrained.text}
    report = Report("constrained-decoding", title, params, samples=samples, baseline="unconstrained")
    ratio = float(np.median(samples["json schema"]) / np.median(samples["unconstrained"]))
    report.checks.append(Check("json schema / unconstrained, per token", ratio, "x", 1.15))
    report.checks.append(Check("tool-call grammar compile + start", float(np.median(compile_s)) * 1e3, "ms"))
    report.notes.append(
        f"per token: unconstrained {np.median(samples['unconstrained']) * 1e3:.1f} ms, "
        f"json schema {np.median(samples['json schema']) * 1e3:.1f} ms"
    )
    return report
