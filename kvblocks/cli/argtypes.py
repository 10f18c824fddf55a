"""argparse `type=` converters shared by the command lines (`kvblocks`, `kvblocks bench`, `scripts/fleet`)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def count(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        value = low - 1
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got '{text}'")
    return value
