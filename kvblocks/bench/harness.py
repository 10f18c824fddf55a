"""Benchmark harness shared by every `kvblocks bench` workload.

Compared variants run interleaved round by round (A B C, B C A, C A B, ...) after warm-up, on a
fixed torch thread count, so background load on a busy machine hits all of them alike; ratios
are taken between medians.
A `Report` holds the raw samples and the checks against targets, and is written as JSON,
Markdown and a PNG box plot under the output folder.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kvblocks.cli.argtypes import count, positive_int
from kvblocks.errors import UserError


@dataclass(slots=True)
class BenchOptions:
    threads: int = 1
    warmup: int = 2
    out: Path = Path("bench-results")
    plots: bool = True
    progress: bool = True
    clock: str = "wall"
    fail: bool = True
    targets: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchOptions:
        plots = not args.no_plots and can_plot()
        return cls(args.threads, args.warmup, Path(args.out), plots, not args.no_progress, args.clock,
                   not args.no_fail, dict(args.target))  # fmt: skip


@dataclass(slots=True, frozen=True)
class Option:
    """One row of a suite's option table: a flag, its type, default and help (which states the default).
    `bool` is a switch; `repeat` collects every use in a list."""

    flag: str
    type: Callable[[str], object] | None
    default: object
    help: str
    choices: Sequence[str] | None = None
    repeat: bool = False
    metavar: str | None = None

    def add_to(self, p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        if self.type is bool:
            p.add_argument(self.flag, action="store_true", help=self.help)
            return
        extra: dict[str, object] = {"action": "append"} if self.repeat else {}
        if self.type is not None:
            extra["type"] = self.type
        if self.choices is not None:
            extra["choices"] = list(self.choices)
        if self.metavar is not None:
            extra["metavar"] = self.metavar
        p.add_argument(self.flag, default=self.default, help=self.help, **extra)


@dataclass(slots=True, frozen=True)
class Group:
    """Options shown under their own heading in `--help`."""

    title: str
    options: Sequence[Option]


def add_options(
    p: argparse.ArgumentParser | argparse._ArgumentGroup, table: Sequence[Option | Group]
) -> None:
    """Register a suite's option table: every suite's flags come from data through this one function."""
    for row in table:
        if isinstance(row, Group):
            add_options(p.add_argument_group(row.title), row.options)
        else:
            row.add_to(p)


def ints(prefix: str, rows: Sequence[tuple[str, int, str]]) -> tuple[Option, ...]:
    """`--PREFIX-NAME N` (`--NAME N` without a prefix), a positive integer, for each (name, default, help)."""
    head = f"--{prefix}-" if prefix else "--"
    return tuple(
        Option(head + name, positive_int, default, f"{text} (default {default:,})")
        for name, default, text in rows
    )


def can_plot() -> bool:
    """Whether matplotlib (the `bench` extra) is installed; without it the results are written unplotted."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "kvblocks: no plots: matplotlib is not installed (pip install 'kvblocks[bench]')", file=sys.stderr
        )
        return False
    return True


def repeats_row(default: int, text: str = "timed runs per variant") -> tuple[str, int, str]:
    """The `ints` row nearly every benchmark's table has."""
    return ("repeats", default, text)


# a layer layout like SmolLM2-135M's, for benchmarks of the pool and the Redis tier without a model
SMOLLM2_KV_SHAPE = (("layers", 30, "layers"), ("heads", 3, "KV heads"), ("head-dim", 64, "head dim"))


def target_override(text: str) -> tuple[str, float]:
    name, sep, value = text.rpartition("=")
    try:
        if sep and name:
            return name.strip(), float(value)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected METRIC=VALUE, got '{text}'")


HARNESS_OPTIONS = (
    Option("--threads", positive_int, 1, "torch CPU threads (default 1)"),
    Option("--warmup", count, 2, "untimed runs of every variant before measuring (default 2)"),
    Option("--out", None, "bench-results", "folder for JSON, Markdown and PNG results"),
    Option("--no-plots", bool, False, "skip the PNG plots"),
    Option("--no-progress", bool, False, "no progress bar on stderr"),
    Option("--clock", None, "wall",
           "time runs by wall clock (default) or by this process's CPU time, which leaves out the time "
           "other processes on a busy machine take the core away (use with --threads 1)",
           choices=("wall", "cpu")),
    Option("--no-fail", bool, False,
           "only report missed targets; by default a missed target makes the exit status 1"),
    Option("--target", target_override, [],
           "hold METRIC (a name from the report's metric column) to VALUE instead of its built-in "
           "target, in the same direction (repeatable)", repeat=True, metavar="METRIC=VALUE"),
)  # fmt: skip
MODEL_OPTION = Option("--model", None, None, "model path (default: SmolLM2-135M-Instruct)")
DTYPE_OPTION = Option(
    "--dtype",
    None,
    "auto",
    "dtype of the model, as `kvblocks serve --dtype` (default auto: bfloat16 on a CPU with native BF16 "
    "where the suite runs the batch-invariant packed engine, else float32)",
    choices=("auto", "float32", "bfloat16", "float16", "float64"),
)


def add_suite(
    suites: argparse._SubParsersAction,
    name: str,
    run: Callable[[argparse.Namespace, BenchOptions], Sequence[Report]],
    *,
    help: str,
    description: str,
    model: bool = False,
    dtype: bool = False,
    only: Sequence[str] = (),
    options: Sequence[Option | Group] = (),
) -> argparse.ArgumentParser:
    """Register `kvblocks bench NAME`: the harness options, `--model`, `--dtype` and `--only CHOICE` if asked for,
    then the suite's own option table. `run(args, opts)` returns the reports; they are published under
    NAME and checked (exit status 1 when a target is missed, unless --no-fail)."""
    p = suites.add_parser(name, help=help, description=description)
    add_options(p, HARNESS_OPTIONS)
    if model:
        MODEL_OPTION.add_to(p)
    if dtype:
        DTYPE_OPTION.add_to(p)
    if only:
        Option(
            "--only", None, None, "run only this benchmark (repeatable)", choices=only, repeat=True
        ).add_to(p)
    add_options(p, options)
    p.set_defaults(func=functools.partial(run_suite, name, run))
    return p


def run_suite(
    name: str, run: Callable[[argparse.Namespace, BenchOptions], Sequence[Report]], args: argparse.Namespace
) -> int:
    opts = BenchOptions.from_args(args)
    set_threads(opts.threads)
    return publish(run(args, opts), opts, name)


def set_threads(n: int) -> None:
    """Pin intra-op threads: on a busy 2-core machine more threads than cores is up to 10x slower."""
    torch.set_num_threads(n)


def machine_info(opts: BenchOptions) -> dict[str, object]:
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": opts.threads,
        "clock": opts.clock,
        "cuda": torch.cuda.is_available(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


@contextmanager
def progress(total: int, desc: str, enabled: bool = True) -> Iterator[tqdm]:
    """A tqdm bar on stderr that disappears when done (a no-op bar when `enabled` is false)."""
    bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True, disable=not enabled)
    try:
        yield bar
    finally:
        bar.close()


# ---- measuring -----------------------------------------------------------------------------


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass(slots=True)
class Variant:
    """One compared alternative. Only `run` is timed; `setup`/`teardown` bracket every run."""

    name: str
    run: Callable[[], None]
    setup: Callable[[], None] | None = None
    teardown: Callable[[], None] | None = None

    def once(self, clock: Callable[[], float]) -> float:
        if self.setup is not None:
            self.setup()
        t0 = clock()
        self.run()
        elapsed = clock() - t0
        if self.teardown is not None:
            self.teardown()
        return elapsed


def measure(
    variants: Sequence[Variant], repeats: int, opts: BenchOptions, desc: str = ""
) -> dict[str, list[float]]:
    """Seconds per run for each variant: `opts.warmup` untimed rounds, then `repeats` timed rounds.

    Every round runs each variant once (A B C, then B C A, then C A B, ...): interleaving makes
    drifting background load hit all variants alike, and rotating the order keeps one variant
    from always inheriting the caches and allocator state the same predecessor left behind.
    Sample `i` of every variant comes from round `i`, so samples can be paired by index.
    """
    names = [v.name for v in variants]
    assert len(set(names)) == len(names), names
    clock = CLOCKS[opts.clock]
    for _ in range(opts.warmup):
        for v in variants:
            v.once(clock)
    samples: dict[str, list[float]] = {name: [] for name in names}
    with progress(repeats * len(variants), desc, opts.progress) as bar:
        for r in range(repeats):
            k = r % len(variants)
            for v in [*variants[k:], *variants[:k]]:
                samples[v.name].append(v.once(clock))
                bar.update()
    return samples


@dataclass(slots=True, frozen=True)
class Stats:
    n: int
    median: float
    p99: float
    mean: float
    min: float
    max: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stats:
        a = np.asarray(samples, dtype=np.float64)
        assert a.size > 0, "no samples"
        return cls(int(a.size), *map(float, (np.median(a), np.percentile(a, 99), a.mean(), a.min(), a.max())))


# ---- reporting -----------------------------------------------------------------------------


@dataclass(slots=True)
class Check:
    """A measured value against a target (`higher_is_better` decides the direction)."""

    name: str
    value: float
    unit: str = ""
    target: float | None = None
    higher_is_better: bool = False

    @property
    def passed(self) -> bool | None:
        if self.target is None:
            return None
        return self.value >= self.target if self.higher_is_better else self.value <= self.target

    def target_text(self) -> str:
        if self.target is None:
            return ""
        return f"{'>=' if self.higher_is_better else '<='} {fmt_number(self.target)} {self.unit}".strip()

    def row(self) -> str:
        result = {True: "pass", False: "**MISS**", None: ""}[self.passed]
        value = f"{fmt_number(self.value)} {self.unit}".strip()
        return f"| {self.name} | {value} | {self.target_text()} | {result} |"


def fmt_number(x: float) -> str:
    if x == 0 or abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3g}" if abs(x) >= 1 else f"{x:.3f}"


def fmt_seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s"


@dataclass(slots=True)
class Report:
    """One benchmark's result. `baseline` names the variant the others' medians are divided by."""

    name: str
    title: str
    params: dict[str, object]
    samples: dict[str, list[float]] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    baseline: str | None = None

    def stats(self) -> dict[str, Stats]:
        return {name: Stats.of(s) for name, s in self.samples.items()}

    def median(self, variant: str) -> float:
        return float(np.median(self.samples[variant]))

    def ratio(self, a: str, b: str) -> float:
        return self.median(a) / self.median(b)

    def paired_ratio(self, a: str, b: str) -> float:
        """Median over rounds of a_i / b_i: robust when the machine's load drifts between rounds."""
        return float(np.median(np.asarray(self.samples[a]) / np.asarray(self.samples[b])))

    def to_markdown(self) -> str:
        lines = [f"### {self.title}", "", " ".join(f"`{k}={v}`" for k, v in self.params.items()), ""]
        if self.samples:
            ratio_col = f" vs {self.baseline} |" if self.baseline else ""
            lines += [
                f"| variant | runs | median | p99 | mean |{ratio_col}",
                "|---|---:|---:|---:|---:|" + ("---:|" if self.baseline else ""),
            ]
            for name, st in self.stats().items():
                ratio = f" {self.ratio(name, self.baseline):.3f} |" if self.baseline else ""
                lines.append(
                    f"| {name} | {st.n} | {fmt_seconds(st.median)} | {fmt_seconds(st.p99)} | "
                    f"{fmt_seconds(st.mean)} |{ratio}"
                )
            lines.append("")
        if self.checks:
            lines += ["| metric | value | target | result |", "|---|---:|---:|:---:|"]
            lines += [c.row() for c in self.checks]
            lines.append("")
        lines += [f"- {note}" for note in self.notes]
        return "\n".join(lines).rstrip() + "\n"

    def to_json(self, machine: dict[str, object]) -> dict[str, object]:
        return {
            "name": self.name,
            "title": self.title,
            "machine": machine,
            "params": self.params,
            "baseline": self.baseline,
            "stats_s": {name: asdict(st) for name, st in self.stats().items()},
            "ratios_of_medians": (
                {name: self.ratio(name, self.baseline) for name in self.samples} if self.baseline else {}
            ),
            "checks": [dict(asdict(c), passed=c.passed) for c in self.checks],
            "notes": self.notes,
            "samples_s": self.samples,
        }

    def save(self, opts: BenchOptions, machine: dict[str, object]) -> list[Path]:
        opts.out.mkdir(parents=True, exist_ok=True)
        paths = [opts.out / f"{self.name}.json", opts.out / f"{self.name}.md"]
        paths[0].write_text(json.dumps(self.to_json(machine), indent=2) + "\n")
        paths[1].write_text(self.to_markdown())
        if opts.plots and self.samples:
            paths.append(opts.out / f"{self.name}.png")
            plot_samples(self, paths[-1])
        return paths


@dataclass(slots=True, frozen=True)
class Ratio:
    """A row of a suite's target table: median(a) / median(b) of two variants of one report, or with
    `paired` the median of their per-round ratios."""

    metric: str
    a: str
    b: str
    target: float | None = None
    higher_is_better: bool = False
    paired: bool = False

    def check(self, report: Report) -> Check:
        value = report.paired_ratio(self.a, self.b) if self.paired else report.ratio(self.a, self.b)
        return Check(self.metric, value, target=self.target, higher_is_better=self.higher_is_better)


def prefixed(args: argparse.Namespace, prefix: str) -> dict[str, object]:
    """The values of the `--PREFIX-*` flags (an `ints(prefix, ...)` table), keyed by the rest of the name."""
    head = prefix.replace("-", "_") + "_"
    return {k.removeprefix(head): v for k, v in vars(args).items() if k.startswith(head)}


def plot_samples(report: Report, path: Path) -> None:
    """Box plot of each variant's run times (log scale: variants often differ by orders of magnitude)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report.samples)
    fig, ax = plt.subplots(figsize=(2.5 + 2.0 * len(names), 4.5))
    ax.boxplot([np.asarray(report.samples[n]) * 1e3 for n in names])
    ax.set_xticks(range(1, len(names) + 1), [textwrap.fill(n, 22) for n in names], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms per run (log scale)")
    ax.set_title(report.title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary_markdown(reports: Sequence[Report]) -> str:
    lines = ["| benchmark | metric | value | target | result |", "|---|---|---:|---:|:---:|"]
    for r in reports:
        lines += [f"| {r.title} {c.row()}" for c in r.checks]
    return "\n".join(lines) + "\n"


def publish(reports: Sequence[Report], opts: BenchOptions, suite: str) -> int:
    """Print every report as Markdown, write each one plus a `<suite>-summary` to `opts.out`, and return
    the exit status: 1 if a check missed its target (unless `opts.fail` is off), else 0."""
    apply_targets(reports, opts.targets)
    machine = machine_info(opts)
    written: list[Path] = []
    for r in reports:
        written += r.save(opts, machine)
        print(r.to_markdown())
    summary = summary_markdown(reports)
    print(f"### Summary\n\n{summary}")
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / f"{suite}-summary.md").write_text(summary)
    data = {"machine": machine, "reports": [r.to_json(machine) for r in reports]}
    (opts.out / f"{suite}-summary.json").write_text(json.dumps(data, indent=2) + "\n")
    print(f"kvblocks: wrote {len(written) + 2} files to {opts.out}/", file=sys.stderr)
    missed = [f"{r.title}: {c.name}" for r in reports for c in r.checks if c.passed is False]
    if not missed:
        return 0
    verdict = "reported only (--no-fail)" if not opts.fail else "exit status 1"
    print(f"kvblocks: {len(missed)} target(s) missed, {verdict}: " + "; ".join(missed), file=sys.stderr)
    return 1 if opts.fail else 0


def apply_targets(reports: Sequence[Report], targets: dict[str, float]) -> None:
    """Replace the targets of the checks named in `targets` (--target METRIC=VALUE)."""
    checks = [c for r in reports for c in r.checks]
    unknown = sorted(set(targets) - {c.name for c in checks})
    if unknown:
        names = ", ".join(sorted({c.name for c in checks})) or "none"
        raise UserError(f"--target: no metric named {', '.join(unknown)} in this run (metrics: {names})")
    for c in checks:
        if c.name in targets:
            c.target = targets[c.name]
