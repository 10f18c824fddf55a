"""Loopback ports for child processes."""

from __future__ import annotations

import os
import random
import socket
import time

HOST = "127.0.0.1"
PORTS_FROM = 10000  # free_port picks from here up to the ephemeral range


def _ephemeral_start() -> int:
    """Where the OS's ephemeral (outgoing source) ports begin: Linux's setting, else its default."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing listens on right now, chosen at random below the ephemeral range: a port the
    OS hands out (bind to 0) is one that any outgoing connection may take as its source port before
    the process it was picked for binds it, which CI saw as "Address already in use"."""
    high = _ephemeral_start()
    rng = random.Random(os.getpid() * 1_000_003 + time.monotonic_ns())
    for _ in range(100 if high - PORTS_FROM > 1000 else 0):
        with socket.socket() as s:
            try:
                s.bind((HOST, rng.randrange(PORTS_FROM, high)))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:  # no room below the ephemeral range: let the OS pick
        s.bind((HOST, 0))
        return s.getsockname()[1]
