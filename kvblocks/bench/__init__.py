"""Benchmarks behind `kvblocks bench`: a shared harness (`harness`) and the suites built on it."""

from __future__ import annotations

import argparse

from kvblocks.bench import constrained, inspection, loadtest, micro, specdec, spill, workloads


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """Register `kvblocks bench SUITE ...` on the top-level subcommands."""
    p = sub.add_parser(
        "bench", help="run benchmarks", description="Benchmarks, each checked against its targets."
    )
    suites = p.add_subparsers(dest="suite", metavar="SUITE")
    micro.add_parser(suites)
    workloads.add_parser(suites)
    spill.add_parser(suites)
    specdec.add_parser(suites)
    loadtest.add_parser(suites)
    inspection.add_parser(suites)
    constrained.add_parser(suites)
    p.set_defaults(func=lambda args: _print_help(p))


def _print_help(p: argparse.ArgumentParser) -> int:
    p.print_help()
    return 2
