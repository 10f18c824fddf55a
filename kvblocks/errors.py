"""Errors the command line reports as one line (exit status 2) instead of a traceback."""

from __future__ import annotations


class UserError(Exception):
    """Bad input or environment: printed as one line, exit status 2, no traceback."""
