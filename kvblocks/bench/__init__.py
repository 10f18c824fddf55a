"""Benchmarks behind `kvblocks bench`: a shared harness (`harness`), what the suites run against
(`fixtures`: the model, KV sources, the peer servers; Redis and `kvblocks serve` processes come from
the product's `kvblocks.launch`), and one module per suite, named after it (`workloads` holds the
three workload suites; `prefix_listing` is `kvblocks bench inspection`). The suites import the
product; the product never imports them (`tests/test_imports.py`)."""

from __future__ import annotations

import argparse


def bench_parser() -> argparse.ArgumentParser:
    """`kvblocks bench SUITE ...`; the suites import torch, so the top-level CLI builds this parser only
    when the `bench` command runs."""
    from kvblocks.bench import (
        blocks,
        constrained,
        dtype,
        fleet,
        gpu,
        hybrid,
        micro,
        packed,
        prefix_listing,
        quant,
        redis,
        seq2seq,
        server,
        soak,
        specdec,
        tiers,
        weights,
        workloads,
    )

    p = argparse.ArgumentParser(
        prog="kvblocks bench",
        description="Benchmarks, each checked against its targets: the exit status is 1 when a target is "
        "missed (--no-fail only reports).",
    )
    suites = p.add_subparsers(dest="suite", metavar="SUITE")
    first = (micro, workloads, redis, specdec, server, fleet, packed, hybrid)
    for suite in (
        *first,
        seq2seq,
        prefix_listing,
        constrained,
        soak,
        gpu,
        blocks,
        dtype,
        quant,
        weights,
        tiers,
    ):
        suite.add_parser(suites)
    return p
