"""The spill tiers `kvblocks serve` (and every command that loads a model) builds from its flags.

`TIERS` lists one builder per tier, fastest first: each reads its flags and returns its `Tier`, or
None when the flags leave it off. Adding a tier is one builder here, one line in `TIERS`, and its
flags in `add_tier_args`. The tiers found make one `TierStack`, sealed with the deployment secret
(`--redis-secret-file`, or $KVBLOCKS_REDIS_SECRET), by `--write-policy`.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvblocks.errors import UserError

DEFAULT_DISK_CACHE = "~/.cache/kvblocks/disk-cache"  # kvblocks.models.cache_home() / "disk-cache"
WRITE_POLICIES = ("write-through", "write-back")  # kvblocks.spill.stack.WRITE_POLICIES, without torch
# Test-only: lets a CPU-only test server build the host tier, which `serve` refuses on the CPU.
HOST_TIER_ON_CPU_ENV = "KVBLOCKS_TEST_HOST_TIER_ON_CPU"


def add_tier_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host-cache-size",
        default=None,
        metavar="SIZE",
        help="host-memory tier between the device pool and the tiers below (e.g. 64GiB): records evicted "
        "from a GPU's pool kept in RAM, per cache (an encoder-decoder model has two); refused on a CPU-only "
        "server, whose pool already is RAM (default: off)",
    )
    p.add_argument(
        "--disk-cache",
        nargs="?",
        const=DEFAULT_DISK_CACHE,
        default=None,
        metavar="DIR",
        help="a spill tier of files under DIR that outlives a restart (without DIR: "
        "~/.cache/kvblocks/disk-cache); off by default. Sealed with the Redis secret when one is set",
    )
    p.add_argument(
        "--disk-cache-size",
        default="4GiB",
        metavar="SIZE",
        help="most bytes the disk tier keeps, least recently used out first (default 4GiB)",
    )
    p.add_argument(
        "--write-policy",
        choices=WRITE_POLICIES,
        default="write-through",
        help="how the spill tiers are written: write-through (every completed chunk into every tier at "
        "once; default) or write-back (into the first tier when the device evicts it, and down a tier "
        "when a tier evicts it)",
    )


def host_tier(args: argparse.Namespace):
    """--host-cache-size: a HostTier of that many bytes, on a device that is not the CPU."""
    if not args.host_cache_size:
        return None
    size = parse_bytes(args.host_cache_size, "--host-cache-size")
    if args.device.split(":")[0] == "cpu" and os.environ.get(HOST_TIER_ON_CPU_ENV) != "1":
        raise UserError(
            "--host-cache-size: the device is the CPU, whose KV pool already is host memory; "
            "grow --capacity instead (the host tier is for a GPU's evicted KV)"
        )
    from kvblocks.spill.host import HostTier

    return HostTier(size)


def redis_tier(args: argparse.Namespace):
    """--redis URL: the Redis tier, with --redis-ttl."""
    if not args.redis:
        return None
    from kvblocks.spill.redis_tier import redis_store

    return redis_store(args.redis, ttl_s=args.redis_ttl if args.redis_ttl > 0 else None)


def disk_tier(args: argparse.Namespace):
    """--disk-cache [DIR]: a DiskTier of --disk-cache-size bytes; a directory that cannot be made is a
    clear error."""
    if not args.disk_cache:
        return None
    from kvblocks.models import cache_home
    from kvblocks.spill.disk import DiskTier

    size = parse_bytes(args.disk_cache_size, "--disk-cache-size")
    where = cache_home() / "disk-cache" if args.disk_cache == DEFAULT_DISK_CACHE else args.disk_cache
    try:
        return DiskTier(os.path.expanduser(where), size)
    except OSError as exc:
        raise UserError(f"--disk-cache {args.disk_cache}: {exc.strerror or exc}") from exc


# Fastest first.
TIERS = (host_tier, disk_tier, redis_tier)


def spill_stack(args: argparse.Namespace):
    """The TierStack the flags ask for (None without any tier); one per cache."""
    try:
        tiers = [tier for build in TIERS if (tier := build(args)) is not None]
        if not tiers:
            return None
        from kvblocks.spill.sealing import read_secret
        from kvblocks.spill.stack import TierStack

        stack = TierStack(
            tiers,
            chunk_tokens=args.redis_chunk_tokens,
            secret=read_secret(args.redis_secret_file),
            write_policy=args.write_policy,
        )
    except ValueError as exc:
        flag = "--redis" if args.redis else "--host-cache-size"
        raise UserError(f"{flag}: {exc}") from exc
    for warning in stack.server_warnings():
        print(warning, file=sys.stderr, flush=True)
    return stack


def parse_bytes(text: str, flag: str) -> int:
    """A size in bytes: a number with a unit (KiB, MiB, GiB, TiB, KB, MB, GB, TB) or plain bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
    units |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1}
    t = text.strip().lower()
    for unit, scale in units.items():
        if t.endswith(unit):
            t, factor = t[: -len(unit)].strip(), scale
            break
    else:
        factor = 1
    try:
        value = int(float(t) * factor)
    except ValueError:
        value = 0
    if value <= 0:
        raise UserError(f"{flag} must be a positive size like 8GiB, got '{text}'")
    return value
