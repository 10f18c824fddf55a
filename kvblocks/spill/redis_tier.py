"""RedisTier: the public Redis spill tier (`kvblocks.RedisTier`), a `TierStack` whose one tier is Redis.

`RedisTier(url, secret=..., ...)` is what `KVCacheTrie.for_model(spill=...)` has always taken, with
the same keywords and counters (`redis_*`); it is a `TierStack` (`spill.stack`: lookups, the writer,
repair) over a `RedisStore` (`spill.redis_store`: STRLEN and bounded GETRANGE reads, pipelined
writes) on a `RedisConnection` (`spill.redis_conn`: clients, timeouts, reconnects). A stack with
more tiers (host memory, disk, then Redis) is a `TierStack` built from those parts
(`redis_store(url, ...)` makes the Redis one).

Redis is not trusted with memory or time: a value of the wrong size or type is refused unread and
deleted, a value that fails verification in any way is deleted, and lookups wait at most
`fetch_timeout_s` per reply. Any Redis failure is a miss, never an error; after one the tier stays
quiet for `retry_interval_s`, then reconnects.
"""

from __future__ import annotations

from typing import Any

from kvblocks.spill.lookup import Fetched
from kvblocks.spill.records import ChunkCodec
from kvblocks.spill.redis_conn import REDIS_FAILURES, RedisConnection
from kvblocks.spill.redis_store import RedisStore
from kvblocks.spill.stack import TierStack

__all__ = ["DEFAULT_TTL_S", "REDIS_FAILURES", "TRUSTED_REDIS_WARNING", "Fetched", "RedisTier", "redis_store"]

# A record lives a day (a prefix still in use is written again once it expired), so a Redis without
# maxmemory does not grow without bound.
DEFAULT_TTL_S = 24 * 3600.0
TRUSTED_REDIS_WARNING = (
    "kvblocks: the Redis tier has no secret, so Redis is trusted: anyone who can write to it can "
    "change outputs and anyone who can read it sees prompt token ids (set --redis-secret-file or "
    "KVBLOCKS_REDIS_SECRET; see docs/SECURITY.md)"
)


def redis_store(
    url: str = "redis://127.0.0.1:6379/0",
    *,
    ttl_s: float | None = DEFAULT_TTL_S,
    timeout_s: float = 0.5,
    fetch_timeout_s: float = 0.25,
    connect_timeout_s: float = 0.5,
    cluster: bool | None = None,
    client_options: dict[str, Any] | None = None,
) -> RedisStore:
    """The Redis tier of a stack. Lookups wait at most `fetch_timeout_s` for each reply (they hold up
    a request), writes `timeout_s` (they run on the writer thread); `ttl_s` bounds how long a record
    lives (None: forever); `client_options` go to redis-py's client as they are (TLS, a username)."""
    if ttl_s is not None and ttl_s <= 0:
        raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
    connection = RedisConnection(
        url,
        timeout_s=timeout_s,
        fetch_timeout_s=fetch_timeout_s,
        connect_timeout_s=connect_timeout_s,
        cluster=cluster,
        client_options=client_options,
    )
    store = RedisStore(connection, ttl_ms=None if ttl_s is None else max(1, int(ttl_s * 1000)))
    store.trust_warning = TRUSTED_REDIS_WARNING
    return store


class RedisTier(TierStack):
    """Chunk-aligned, content-addressed KV spill tier in Redis, Redis Cluster or Valkey.

    `write_mode="through"` (default) writes every completed chunk as soon as it is cached on the
    device, so other processes can hit at once; `"back"` writes chunks only when the device pool
    evicts them. `secret` (at least 16 bytes, shared by every process of one deployment) makes
    keys keyed hashes and seals values with AES-256-GCM; without it Redis is trusted and a warning
    is logged. `ttl_s` bounds how long a record lives (None: forever). `codec` picks another key
    and value format (the LMCache one); it excludes `secret`. `client_options` go to redis-py's client
    as they are (TLS certificates, a username, `parser_class`): replies are parsed by hiredis when it
    is installed, as it is with kvblocks.

    Lookups wait at most `fetch_timeout_s` for each Redis reply (they hold up a request), writes
    `timeout_s` (they run on the writer thread). `retry_size` bounds the writes held while Redis is
    down; `recheck_interval_s` is how often a device hit checks that Redis still has its chunks.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        chunk_tokens: int = 64,
        key_prefix: str = "kvblocks",
        secret: bytes | str | None = None,
        ttl_s: float | None = DEFAULT_TTL_S,
        timeout_s: float = 0.5,
        fetch_timeout_s: float = 0.25,
        connect_timeout_s: float = 0.5,
        retry_interval_s: float = 1.0,
        write_mode: str = "through",
        queue_size: int = 64,
        retry_size: int = 256,
        recheck_interval_s: float = 30.0,
        cluster: bool | None = None,
        codec: ChunkCodec | None = None,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if write_mode not in ("through", "back"):
            raise ValueError(f"write_mode must be 'through' or 'back', got '{write_mode}'")
        store = redis_store(
            url,
            ttl_s=ttl_s,
            timeout_s=timeout_s,
            fetch_timeout_s=fetch_timeout_s,
            connect_timeout_s=connect_timeout_s,
            cluster=cluster,
            client_options=client_options,
        )
        self.url, self.ttl_ms = url, store.ttl_ms
        super().__init__(
            [store],
            chunk_tokens=chunk_tokens,
            key_prefix=key_prefix,
            secret=secret,
            codec=codec,
            write_policy=write_mode,
            queue_size=queue_size,
            retry_size=retry_size,
            retry_interval_s=retry_interval_s,
            recheck_interval_s=recheck_interval_s,
        )
