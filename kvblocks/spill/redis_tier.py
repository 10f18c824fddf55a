"""RedisTier: the spill tier below the device pool, shared by every process using the same Redis.

Reads happen on a device miss, before the model runs: one pipelined STRLEN finds the longest run
of consecutive chunks present with the size a record must have, one pipelined GETRANGE (bounded by
that size) fetches them, each is verified and promoted into the device pool. Redis is not trusted
with memory or time: a value of the wrong size or type is refused unread and deleted, a value that
fails verification in any way is deleted, and lookups wait at most `fetch_timeout_s` per reply. For a recurrent or hybrid model, snapshots of the recurrent state taken where a
chunk ends are records too (`on_snapshot`, `fetch_state`), authenticated like KV chunks. Writes
never block generation: they go through a bounded queue to a background thread, and a full queue
drops (and counts) the write. Any Redis failure is a miss, never an
error; after a failure the tier stays quiet for `retry_interval_s`, then reconnects.

The shared tier repairs itself: writes that failed or met a down tier are held (up to `retry_size`,
oldest dropped first) and retried once Redis answers again, and a device hit on chunks not seen in
Redis for `recheck_interval_s` queues their write-through, which writes those Redis lacks (after a
FLUSHALL, a restart or an eviction), so other replicas find them again.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvblocks.cache.layout import KVLayout, StateLayout
from kvblocks.spill.records import ChunkCodec, NativeCodec, VerificationError
from kvblocks.spill.sealing import Sealer

log = logging.getLogger("kvblocks.redis")

# A record lives a day (a prefix still in use is written again once it expired), so a Redis without
# maxmemory does not grow without bound.
DEFAULT_TTL_S = 24 * 3600.0
TRUSTED_REDIS_WARNING = (
    "kvblocks: the Redis tier has no secret, so Redis is trusted: anyone who can write to it can "
    "change outputs and anyone who can read it sees prompt token ids (set --redis-secret-file or "
    "KVBLOCKS_REDIS_SECRET; see docs/SECURITY.md)"
)

# What an unreachable or failing Redis raises. RedisClusterException is not a RedisError: a
# RedisCluster client raises it when no startup node answers.
REDIS_FAILURES = (redis.RedisError, redis.exceptions.RedisClusterException)
# How many chunk keys the tier remembers having seen in Redis (to rate-limit repairs).
CONFIRMED_KEYS = 4096

# Reads the tier needs from its trie: (namespace key, ids, start, end) -> per-layer [n, 2, H, D]
# tensors, or None when those tokens are no longer resident.
ReadKV = Callable[[str, np.ndarray, int, int], "list[torch.Tensor | None] | None"]


@dataclass(slots=True)
class TierCounters:
    lookups: int = 0
    lookup_chunks: int = 0
    hit_chunks: int = 0
    hit_tokens: int = 0
    read_bytes: int = 0
    errors: int = 0
    verify_failures: int = 0
    rejected_size: int = 0
    rejected_type: int = 0
    deleted_invalid: int = 0
    skipped_while_down: int = 0
    write_jobs: int = 0
    write_drops: int = 0
    written_chunks: int = 0
    written_bytes: int = 0
    write_skipped_present: int = 0
    write_skipped_evicted: int = 0
    write_errors: int = 0
    write_deferred: int = 0
    write_retried: int = 0
    repair_jobs: int = 0
    state_lookups: int = 0
    state_hits: int = 0
    written_states: int = 0


@dataclass(slots=True)
class Fetched:
    """Verified KV for positions `[start, start + length)`: per-layer `[length, 2, H, D]`."""

    start: int
    length: int
    kv: list[torch.Tensor | None]


class RedisTier:
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
        self.url = url
        self.chunk_tokens = chunk_tokens
        self.key_prefix = key_prefix
        if codec is not None and secret is not None:
            raise ValueError("a secret seals kvblocks' own records; it cannot apply to another codec")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        self.codec = (
            codec
            if codec is not None
            else NativeCodec(key_prefix, None if secret is None else Sealer(secret))
        )
        if not self.codec.authenticated:
            log.warning(TRUSTED_REDIS_WARNING)
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.retry_interval_s = retry_interval_s
        self.write_mode = write_mode
        self.counters = TierCounters()
        self._count_lock = threading.Lock()
        self._down_until = 0.0
        is_cluster = (
            cluster if cluster is not None else url.startswith(("redis+cluster://", "rediss+cluster://"))
        )

        def factory(socket_timeout: float) -> Callable[[], redis.Redis | redis.RedisCluster]:
            kwargs = dict(
                socket_timeout=socket_timeout,
                socket_connect_timeout=connect_timeout_s,
                retry=Retry(NoBackoff(), 0),
            ) | dict(client_options or {})
            if is_cluster:
                return lambda: redis.RedisCluster.from_url(url.replace("+cluster", ""), **kwargs)
            return lambda: redis.Redis.from_url(url, **kwargs)

        # Lookups and writes have their own clients: a lookup's timeout is short, a write's longer.
        self._factories = {"read": factory(fetch_timeout_s), "write": factory(timeout_s)}
        self._clients: dict[str, redis.Redis | redis.RedisCluster | None] = {"read": None, "write": None}
        self._held: deque[tuple] = deque()
        self.retry_size = retry_size
        self.recheck_interval_s = recheck_interval_s
        self._confirmed: OrderedDict[str, float] = OrderedDict()  # chunk key -> when seen in Redis
        self._confirm_lock = threading.Lock()
        self._layout: KVLayout | None = None
        self._state: StateLayout | None = None
        self._device: torch.device | None = None
        self._read_kv: ReadKV | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._writer = threading.Thread(target=self._write_loop, name="kvblocks-redis-writer", daemon=True)
        self._writer.start()

    # ---- wiring ----------------------------------------------------------------------------

    def bind(
        self,
        layout: KVLayout,
        device: torch.device,
        read_kv: ReadKV,
        namespace_key: str = "",
        state: StateLayout | None = None,
    ) -> None:
        """Called once by the owning KVCacheTrie; `namespace_key` is its unsalted namespace, `state`
        the layout of its model's recurrent-state snapshots (None for an attention-only model)."""
        if self._read_kv is not None:
            raise ValueError("a RedisTier belongs to one KVCacheTrie; create one per cache")
        self.codec.bind(layout, namespace_key)
        if state is not None and not hasattr(self.codec, "encode_state"):
            log.warning("kvblocks: this spill format has no state records; a recurrent model spills KV only")
        self._layout, self._device, self._read_kv, self._state = layout, device, read_kv, state

    @property
    def spills_state(self) -> bool:
        return self._state is not None and hasattr(self.codec, "encode_state")

    def key(self, namespace_key: str, chunk_hash: str) -> str:
        return self.codec.key(namespace_key, chunk_hash)

    # ---- read path -------------------------------------------------------------------------

    def fetch(self, namespace_key: str, ids: np.ndarray, start: int, limit: int) -> Fetched | None:
        """Longest verified run of chunks continuing a device hit of `start` tokens, within `limit`."""
        c = self.chunk_tokens
        first = start // c
        hashes = self.codec.chunk_hashes(namespace_key, ids[:limit], c)
        if first >= len(hashes):
            return None
        keys = [self.key(namespace_key, h) for h in hashes[first:]]
        if time.monotonic() < self._down_until:
            self._count(skipped_while_down=1)
            return None
        self._count(lookups=1, lookup_chunks=len(keys))
        bounds = [self.codec.size_bounds(k, namespace_key, c, self._layout) for k in keys]
        try:
            client = self._connection("read")
            lengths = _execute(client, [("strlen", k) for k in keys])
            run = next(
                (i for i, (k, n, b) in enumerate(zip(keys, lengths, bounds)) if not self._sized(k, n, b)),
                len(keys),
            )
            if run == 0:
                return None
            values = _execute(client, [("getrange", k, 0, b[1] - 1) for k, b in zip(keys[:run], bounds)])
        except REDIS_FAILURES:
            self._mark_down()
            return None
        # Chunks decode straight into their rows of one tensor per layer; the run ends before the
        # first chunk that fails verification.
        restored = self._layout.empty(len(values) * c, pin_memory=_is_cuda(self._device))
        length = 0
        for i, raw in enumerate(values):
            if _wrong_type(raw):  # replaced since STRLEN answered
                self._reject(keys[i], rejected_type=1)
                break
            if len(raw) != lengths[i]:  # rewritten since STRLEN answered: the next lookup sees it
                break
            pos = (first + i) * c
            rows = [None if t is None else t[length : length + c] for t in restored]
            try:
                self.codec.decode_into(raw, keys[i], namespace_key, ids[pos : pos + c], self._layout, rows)
            except VerificationError:
                self._reject(keys[i], verify_failures=1)
                break
            length += c
            self._count(read_bytes=len(raw))
        self._confirm(keys[: length // c])
        if length == 0:
            return None
        # A run cut short is copied out of its buffer, whose rest holds what the failed chunk wrote
        # before its check failed (unauthenticated or non-finite), or was never written at all.
        cut = length < len(values) * c
        kv = [
            None if t is None else (t[:length].clone() if cut else t).to(self._device, non_blocking=True)
            for t in restored
        ]
        self._count(hit_chunks=length // c, hit_tokens=first * c + length - start)
        return Fetched(first * c, length, kv)

    def fetch_state(
        self, namespace_key: str, ids: np.ndarray, low: int, high: int
    ) -> tuple[int, torch.Tensor] | None:
        """The verified recurrent-state snapshot at the furthest chunk end in (low, high], as
        (position, snapshot on the device), or None. A snapshot that fails verification is a miss
        (and deleted); the next one down is tried."""
        if not self.spills_state:
            return None
        c = self.chunk_tokens
        hashes = self.codec.chunk_hashes(namespace_key, ids[:high], c)
        ends = [(k + 1) * c for k in range(len(hashes) - 1, low // c - 1, -1)]  # furthest first
        if not ends:
            return None
        if time.monotonic() < self._down_until:
            self._count(skipped_while_down=1)
            return None
        keys = [self.codec.state_key(namespace_key, hashes[end // c - 1]) for end in ends]
        self._count(state_lookups=1)
        bounds = [self.codec.state_size_bounds(k, namespace_key, c, self._state) for k in keys]
        try:
            client = self._connection("read")
            lengths = _execute(client, [("strlen", k) for k in keys])
            for end, key, n, (low, high) in zip(ends, keys, lengths, bounds):
                if not self._sized(key, n, (low, high)):
                    continue
                raw = _execute(client, [("getrange", key, 0, high - 1)])[0]
                if _wrong_type(raw):
                    self._reject(key, rejected_type=1)
                    continue
                if len(raw) != n:
                    continue
                try:
                    blob = self.codec.decode_state(raw, key, namespace_key, ids[end - c : end], self._state)
                except VerificationError:
                    self._reject(key, verify_failures=1)
                    continue
                self._count(state_hits=1, read_bytes=len(raw))
                return end, blob.to(self._device)
        except REDIS_FAILURES:
            self._mark_down()
        return None

    # ---- write path ------------------------------------------------------------------------

    def on_snapshot(self, namespace_key: str, ids: np.ndarray, blob: torch.Tensor) -> None:
        """The device keeps (write-through) or is about to drop (write-back) the recurrent-state
        snapshot after `ids`; one that ends a chunk is written, under that chunk's state key."""
        if not self.spills_state or not len(ids) or len(ids) % self.chunk_tokens:
            return
        self._enqueue(("state", namespace_key, ids.copy(), blob.to("cpu", copy=True)))

    def on_insert(self, namespace_key: str, ids: np.ndarray, start: int) -> None:
        """Tokens `[start, len(ids))` of `ids` were just cached on the device (write-through)."""
        if self.write_mode != "through":
            return
        c = self.chunk_tokens
        if len(ids) // c <= start // c:
            return
        self._enqueue(("through", namespace_key, ids.copy(), start))

    def on_hit(self, namespace_key: str, ids: np.ndarray, length: int) -> None:
        """The device holds the first `length` tokens of `ids`. Redis may have lost their chunks
        (FLUSHALL, a restart, eviction, a write dropped on an outage) while the device kept them:
        unless every chunk was seen in Redis within `recheck_interval_s`, queue a write-through of
        them from the first unseen one; the writer writes only those Redis lacks."""
        c = self.chunk_tokens
        if self.write_mode != "through" or length < c or time.monotonic() < self._down_until:
            return
        end = length // c * c
        keys = [self.key(namespace_key, h) for h in self.codec.chunk_hashes(namespace_key, ids[:end], c)]
        first = self._first_unconfirmed(keys)
        if first is None:
            return
        self._confirm(keys[first:])  # checked by the job: one job per chunk and interval
        self._count(repair_jobs=1)
        self._enqueue(("through", namespace_key, ids[:end].copy(), first * c))

    def on_evict(self, namespace_key: str, ids: np.ndarray, evicted_from: int, read: Callable) -> None:
        """Tokens `[evicted_from, len(ids))` are about to leave the device pool (write-back).

        `read(start, end)` gathers still-resident KV; complete chunks that lose tokens are copied
        to the host now, before their slots are reused, and written in the background.
        """
        if self.write_mode != "back":
            return
        c = self.chunk_tokens
        first, last = evicted_from // c, len(ids) // c
        if first >= last:
            return
        hashes = self.codec.chunk_hashes(namespace_key, ids[: last * c], c)
        for k in range(first, last):
            kv = [None if t is None else t.to("cpu", copy=True) for t in read(k * c, (k + 1) * c)]
            tokens = ids[k * c : (k + 1) * c].copy()
            self._enqueue(("record", self.key(namespace_key, hashes[k]), namespace_key, tokens, kv))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until queued writes are done (or dropped); True if the queue drained in time."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return self._queue.unfinished_tasks == 0

    def clear(self, batch: int = 500) -> int:
        """Delete every record under this tier's key prefix, every model's and tenant's (an admin's
        `/flush_cache?spill=true`); returns how many. Queued writes land first. Raises RuntimeError
        when Redis fails, and ValueError for a foreign format, whose keys other programs read."""
        if not self.codec.delete_invalid:
            raise ValueError(
                "the spill tier holds another program's records (LMCache format); delete them there"
            )
        self.flush()
        deleted = 0
        try:
            client = self._connection()
            keys = client.scan_iter(match=f"{self.key_prefix}:*", count=batch)
            while chunk := list(itertools.islice(keys, batch)):
                pipe = client.pipeline(transaction=False)
                for key in chunk:
                    pipe.unlink(key)
                deleted += sum(pipe.execute())
        except REDIS_FAILURES as exc:
            self._mark_down()
            raise RuntimeError(f"Redis at {self.url} failed while deleting records: {exc}") from exc
        return deleted

    def server_warnings(self) -> list[str]:
        """Deployment problems worth a line at start: today, a Redis that can grow without bound."""
        try:
            config = self._connection().config_get("maxmemory")
        except REDIS_FAILURES:  # unreachable, or CONFIG is disabled (managed Redis): nothing to say
            return []
        values = config.values() if isinstance(config, dict) else ()
        if any(str(v) == "0" for v in values):
            ttl = (
                "records never expire"
                if self.ttl_ms is None
                else f"records expire after {self.ttl_ms / 1000:g} s"
            )
            return [
                f"kvblocks: Redis at {self.url} has no maxmemory, so it grows until the host runs out of "
                f"memory ({ttl}); set maxmemory and maxmemory-policy allkeys-lru"
            ]
        return []

    def stats(self) -> dict[str, int]:
        with self._count_lock:
            return {f"redis_{k}": v for k, v in asdict(self.counters).items()} | {
                "redis_queue_depth": self._queue.qsize(),
                "redis_held_writes": len(self._held),
            }

    def close(self) -> None:
        """Finish queued writes, stop the writer thread and close the connection."""
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=5.0)
        for client in self._clients.values():
            if client is not None:
                client.close()

    # ---- internals -------------------------------------------------------------------------

    def _enqueue(self, job: tuple) -> None:
        try:
            self._queue.put_nowait(job)
            self._count(write_jobs=1)
        except queue.Full:
            self._count(write_drops=1)

    def _write_loop(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=self.retry_interval_s)
            except queue.Empty:  # idle: held writes are retried once Redis may be back
                self._retry_held()
                continue
            try:
                if job is None:
                    return
                self._write(job)
                self._retry_held()
            finally:
                self._queue.task_done()

    def _write(self, job: tuple) -> None:
        """Run one write job; one that meets a down tier or fails in Redis is held for a retry."""
        if time.monotonic() < self._down_until:
            self._hold(job)
            return
        try:
            if job[0] == "through":
                self._write_through(*job[1:])
            elif job[0] == "state":
                self._write_state(*job[1:])
            elif job[0] == "delete":
                self._count(deleted_invalid=self._connection().delete(job[1]))
            else:
                self._write_records([job[1:]])
        except REDIS_FAILURES:
            self._count(write_errors=1)
            self._mark_down()
            self._hold(job)
        except Exception:  # a bug must not end the writer: later writes would all be dropped
            self._count(write_errors=1)
            log.exception("kvblocks: a Redis write job failed; the writer goes on")

    def _hold(self, job: tuple) -> None:
        self._held.append(job)
        self._count(write_deferred=1)
        if len(self._held) > self.retry_size:
            self._held.popleft()
            self._count(write_drops=1)

    def _retry_held(self) -> None:
        while self._held and time.monotonic() >= self._down_until:
            self._count(write_retried=1)
            self._write(self._held.popleft())

    def _write_through(self, namespace_key: str, ids: np.ndarray, start: int) -> None:
        c = self.chunk_tokens
        hashes = self.codec.chunk_hashes(namespace_key, ids, c)
        wanted = list(range(start // c, len(hashes)))
        keys = [self.key(namespace_key, hashes[k]) for k in wanted]
        lengths = _execute(self._connection(), [("strlen", key) for key in keys])
        present = [
            self._holds_record(n, self.codec.size_bounds(key, namespace_key, c, self._layout))
            for key, n in zip(keys, lengths)
        ]
        records = []
        for k, key, there in zip(wanted, keys, present):
            if there:
                self._count(write_skipped_present=1)
                self._confirm([key])
                continue
            kv = self._read_kv(namespace_key, ids[: (k + 1) * c], k * c, (k + 1) * c)
            if kv is None:
                self._count(write_skipped_evicted=1)
                continue
            records.append((key, namespace_key, ids[k * c : (k + 1) * c], kv))
        self._write_records(records)

    def _write_state(self, namespace_key: str, ids: np.ndarray, blob: torch.Tensor) -> None:
        c = self.chunk_tokens
        key = self.codec.state_key(namespace_key, self.codec.chunk_hashes(namespace_key, ids, c)[-1])
        client = self._connection()
        bounds = self.codec.state_size_bounds(key, namespace_key, c, self._state)
        if self._holds_record(_execute(client, [("strlen", key)])[0], bounds):
            self._count(write_skipped_present=1)
            return
        value = self.codec.encode_state(key, namespace_key, ids[-c:], self._state, blob)
        client.set(key, value, px=self.ttl_ms)
        self._count(written_states=1, written_bytes=len(value))

    def _write_records(self, records: list[tuple]) -> None:
        if not records:
            return
        pipe = self._connection().pipeline(transaction=False)
        total = 0
        for key, namespace_key, tokens, kv in records:
            value = self.codec.encode(key, namespace_key, tokens, self._layout, kv)
            total += len(value)
            pipe.set(key, value, px=self.ttl_ms)
        pipe.execute()
        self._count(written_chunks=len(records), written_bytes=total)
        self._confirm([key for key, *_ in records])

    def _connection(self, role: str = "write") -> redis.Redis | redis.RedisCluster:
        client = self._clients[role]
        if client is None:
            client = self._clients[role] = self._factories[role]()
        return client

    def _mark_down(self) -> None:
        self._count(errors=1)
        self._down_until = time.monotonic() + self.retry_interval_s
        # Drop the clients without closing them: another thread (the writer, or a concurrent
        # request) may be mid-command on one, and closing its sockets under that thread raises
        # errors redis-py does not wrap (ValueError). Each closes once its last user lets go.
        self._clients = {"read": None, "write": None}

    def _sized(self, key: str, reply: int | Exception, bounds: tuple[int, int]) -> bool:
        """Whether STRLEN's `reply` says `key` holds a value of a record's size. A key of another
        type or size is refused unread and deleted (an absent key, length 0, is just absent)."""
        if _wrong_type(reply):
            self._reject(key, rejected_type=1)
            return False
        if reply == 0:
            return False
        if not bounds[0] <= reply <= bounds[1]:
            self._reject(key, rejected_size=1)
            return False
        return True

    def _holds_record(self, reply: int | Exception, bounds: tuple[int, int]) -> bool:
        """Whether a write finds a record where STRLEN answered `reply`: one of a record's size, or
        for a foreign format any value (other programs read those keys: never overwrite them)."""
        if not self.codec.delete_invalid:
            return _wrong_type(reply) or reply > 0
        return not _wrong_type(reply) and bounds[0] <= reply <= bounds[1]

    def _reject(self, key: str, **counter: int) -> None:
        """Count a refused value and delete it: its key fixes format version, namespace and tokens,
        so it is useless to every reader, and write-through (which skips present keys) would never
        replace it. A foreign format's keys (LMCache) are shared with programs that may read them
        otherwise, so they stay."""
        self._count(**counter)
        if self.codec.delete_invalid:
            self._enqueue(("delete", key))

    def _confirm(self, keys: list[str]) -> None:
        now = time.monotonic()
        with self._confirm_lock:
            for key in keys:
                self._confirmed[key] = now
                self._confirmed.move_to_end(key)
            while len(self._confirmed) > CONFIRMED_KEYS:
                self._confirmed.popitem(last=False)

    def _first_unconfirmed(self, keys: list[str]) -> int | None:
        since = time.monotonic() - self.recheck_interval_s
        with self._confirm_lock:
            return next((i for i, k in enumerate(keys) if self._confirmed.get(k, -1e18) < since), None)

    def _count(self, **deltas: int) -> None:
        with self._count_lock:
            for name, d in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + d)


def _execute(client: redis.Redis | redis.RedisCluster, calls: list[tuple]) -> list:
    """Run `calls` in one pipeline; a WRONGTYPE reply comes back in place of its result (it is that
    key's problem), any other failure raises (it is the tier's)."""
    pipe = client.pipeline(transaction=False)
    for name, *args in calls:
        getattr(pipe, name)(*args)
    replies = pipe.execute(raise_on_error=False)
    for reply in replies:
        if isinstance(reply, Exception) and not _wrong_type(reply):
            raise reply
    return replies


def _wrong_type(reply: object) -> bool:
    return isinstance(reply, redis.ResponseError) and str(reply).startswith("WRONGTYPE")


def _is_cuda(device: torch.device | None) -> bool:
    """Restores into a GPU decode into pinned host buffers, so the copy up is asynchronous."""
    return device is not None and device.type == "cuda"
