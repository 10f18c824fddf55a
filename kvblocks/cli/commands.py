"""`kvblocks` command line."""

from __future__ import annotations

import argparse
import os
import sys

from kvblocks.cli.generate import add_generate_parser
from kvblocks.cli.serve_args import add_serve_parser
from kvblocks.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser. Nothing here imports torch, so the HTTP-only commands (`stats`, `inspect`,
    `explain`) start in well under a second; `bench` parses its own arguments when it runs (`cmd_bench`)."""
    from kvblocks.cli.client import add_inspect_parsers
    from kvblocks.cli.models import add_models_parser

    parser = argparse.ArgumentParser(
        prog="kvblocks", description="Exact prefix-sharing KV cache for transformers"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_generate_parser(sub)
    add_serve_parser(sub)
    add_inspect_parsers(sub)
    add_models_parser(sub)
    b = sub.add_parser(
        "bench",
        add_help=False,
        help="run benchmarks against their targets (kvblocks bench --help lists the suites)",
    )
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    b.set_defaults(func=cmd_bench)
    return parser


def cmd_bench(args: argparse.Namespace) -> int:
    from kvblocks.bench import bench_parser

    parser = bench_parser()
    bench_args = parser.parse_args(args.bench_args)
    if not getattr(bench_args, "func", None):
        parser.print_help()
        return 2
    return bench_args.func(bench_args)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":
        # `bench` takes everything after it, options before the suite name included (`bench -h`)
        args.bench_args = extra + args.bench_args
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except UserError as exc:
        print(f"kvblocks: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
