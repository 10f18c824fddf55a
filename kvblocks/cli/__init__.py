"""`kvblocks` command line: `commands` parses and runs; `client` talks to a running server."""

from kvblocks.cli.commands import main

__all__ = ["main"]
