"""KV events in vLLM's wire format: which blocks of KV a replica holds, for cache-aware routers.

A replica publishes what its device cache stores and evicts, the way vLLM does (`--kv-events-config`),
so routers that consume vLLM's events (vllm-router `--policy kv_aware --kv-event-source`) route on it:

- ZMQ multipart messages `(topic, sequence number as 8-byte big-endian, payload)` on a PUB socket the
  replica binds (an XPUB: a new subscriber is sent the whole resident state, see below);
- payload: a msgpack `EventBatch` array `[ts, events, data_parallel_rank]`; each event a map tagged
  by `"type"` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) with vLLM's field names and order
  and its `omit_defaults` rule (required fields always present, optional ones only when set): the
  bytes msgspec writes for vLLM's current structs (`tag=True`, no longer `array_like`). Positional
  events (`["BlockStored", hashes, ...]`, older vLLM) are refused by vllm-router 0.1.17 ("KV event
  must be a tagged map"), so they are not offered;
- an optional ROUTER replay socket: a request `(identity, b"", start_seq)` is answered with every
  buffered batch from `start_seq` on, `(identity, b"", topic, seq, payload)`, then the end marker
  `(identity, b"", b"", -1, b"")` (vllm-router's replay reader expects the topic frame).

The trie is token-granular; events speak of full blocks of `block_size` tokens from the start of a
sequence. Block i's hash chains its parent's: h_i = xxh3_64(h_{i-1} || tokens of block i), h_{-1}
from the model's namespace, so one prefix has the same hashes on every replica of the model (routers
key their index on them). Tenants and cache salts are left out of the hash: a router tokenizes the
request alone and cannot tell them apart. A block is reported stored when the first namespace caches
it and removed when the last one evicts it. Blocks that leave the device but lie in complete chunks
of the Redis tier are reported as stored in the shared tier (medium `STORAGE`, ownership `redis`),
which vllm-router scores as an external pool any replica can restore from.

Publishing never blocks the engine: the trie's hooks put jobs on a bounded queue (a full queue drops
and counts them); one thread hashes, encodes, sends and serves replays. After a drop, and whenever a
subscriber connects, the thread takes a snapshot of the trie and publishes `AllBlocksCleared` followed
by every resident block, so a router that joins late or missed events converges on the truth.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any

import msgpack
import numpy as np
import xxhash
import zmq

log = logging.getLogger("kvblocks.telemetry.kv_events")

DEFAULT_BLOCK_SIZE = 16  # vLLM's default block size, and the routers' `--kv-event-block-size`
MEDIUM_GPU = "GPU"  # vLLM's name for the device tier (whatever the device is)
MEDIUM_STORAGE = "STORAGE"  # vLLM's name for a storage offloading tier
SHARED_TIER = "redis"  # `ownership`: the pool every replica of the deployment restores from
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's end marker

Event = dict  # one event: a map tagged by "type", fields in vLLM's order


# ---- wire format ----------------------------------------------------------------------------


def block_stored(
    block_hashes: list[int],
    parent_block_hash: int | None,
    token_ids: list[int],
    block_size: int,
    *,
    medium: str = MEDIUM_GPU,
    ownership: str | None = None,
) -> Event:
    """vLLM's `BlockStored`: required fields always, `ownership` only when set (omit_defaults)."""
    event = {
        "type": "BlockStored",
        "block_hashes": block_hashes,
        "parent_block_hash": parent_block_hash,
        "token_ids": token_ids,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }
    if ownership is not None:
        event["ownership"] = ownership
    return event


def block_removed(block_hashes: list[int]) -> Event:
    """vLLM's `BlockRemoved`, from the device (the shared tier's expiry is not observed)."""
    return {"type": "BlockRemoved", "block_hashes": block_hashes, "medium": MEDIUM_GPU}


def all_blocks_cleared() -> Event:
    """vLLM's `AllBlocksCleared`."""
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: list[Event], data_parallel_rank: int = 0) -> bytes:
    """vLLM's `EventBatch` (an array-like struct: `[ts, events, data_parallel_rank]`)."""
    return msgpack.packb([float(ts), events, data_parallel_rank])


# ---- block hashes ---------------------------------------------------------------------------


class BlockHasher:
    """Chained 64-bit hashes of full blocks: h_i = xxh3_64(h_{i-1} as 8 bytes || block i's token ids
    as int32 little-endian), h_{-1} = xxh3_64(`seed`). Equal prefixes hash equally on every replica
    that uses the same seed (the model's namespace key)."""

    def __init__(self, block_size: int, seed: str) -> None:
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.root = xxhash.xxh3_64_intdigest(seed.encode())

    def hashes(self, ids: np.ndarray, parent: int | None = None) -> list[int]:
        """Hashes of the full blocks of `ids`, chained from `parent` (the hash of the block before
        `ids[0]`; None: `ids` starts the sequence)."""
        bs = self.block_size
        n = len(ids) // bs
        data = np.ascontiguousarray(ids[: n * bs], dtype="<i4").tobytes()
        out, width = [], 4 * bs
        parent = self.root if parent is None else parent
        for i in range(n):
            parent = xxhash.xxh3_64_intdigest(parent.to_bytes(8, "big") + data[i * width : (i + 1) * width])
            out.append(parent)
        return out


# ---- publisher ------------------------------------------------------------------------------


def check_endpoint(endpoint: str) -> None:
    """A ZMQ address to bind: tcp://HOST:PORT (HOST may be *) or ipc://PATH."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a KV events endpoint is tcp://HOST:PORT or ipc://PATH, got '{endpoint}'")


@dataclass(slots=True)
class PublisherCounters:
    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    shared_blocks: int = 0
    dropped_jobs: int = 0
    resyncs: int = 0
    replays: int = 0
    subscriptions: int = 0


# What the trie hands the publisher to take a snapshot: the lock its hooks run under, and a reader
# of its nodes under that lock, parents first: (index of the node's parent in that list or -1 under
# a namespace's root, a copy of the node's tokens).
Snapshot = tuple[AbstractContextManager, Callable[[], list[tuple[int, np.ndarray]]]]


class ResidentBlocks:
    """Which blocks were reported resident, with how many namespaces hold each: the events a
    change of the trie makes (a block is stored when the first namespace holds it, removed when the
    last one lets it go). Runs on the publisher's thread only."""

    def __init__(self, hasher: BlockHasher, count: Callable[..., None]) -> None:
        self.hasher, self.count = hasher, count
        self.held: dict[int, int] = {}  # block hash -> namespaces holding it on the device

    def stored(self, ids: np.ndarray, start: int) -> list[Event]:
        """Tokens `[start, len(ids))` of one namespace became resident."""
        return self._hold(ids, self.hasher.hashes(ids), start // self.hasher.block_size, None)

    def _hold(self, ids: np.ndarray, hashes: list[int], first: int, before: int | None) -> list[Event]:
        """One more namespace holds blocks `first..` of `ids` (`before`: the hash of the block
        preceding `ids[0]`); `BlockStored` for the blocks no namespace held."""
        new = []
        for i in range(first, len(hashes)):
            held = self.held.get(hashes[i], 0)
            self.held[hashes[i]] = held + 1
            if held == 0:
                new.append(i)
        self.count(stored_blocks=len(new))
        return self._stored_runs(ids, hashes, new, before, medium=MEDIUM_GPU)

    def evicted(self, ids: np.ndarray, keep: int, shared_end: int) -> list[Event]:
        """Tokens `[keep, len(ids))` of one namespace left the device, `[0, shared_end)` restorable."""
        hashes = self.hasher.hashes(ids)
        gone = []
        for i in range(keep // self.hasher.block_size, len(hashes)):
            held = self.held.pop(hashes[i], 0)
            if held > 1:
                self.held[hashes[i]] = held - 1
            elif held == 1:
                gone.append(i)
        if not gone:
            return []
        shared = [i for i in gone if (i + 1) * self.hasher.block_size <= shared_end]
        self.count(removed_blocks=len(gone), shared_blocks=len(shared))
        events = [block_removed([hashes[i] for i in gone])]
        return events + self._stored_runs(
            ids, hashes, shared, None, medium=MEDIUM_STORAGE, ownership=SHARED_TIER
        )

    def _stored_runs(
        self, ids: np.ndarray, hashes: list[int], blocks: list[int], before: int | None, **kind
    ) -> list[Event]:
        """One `BlockStored` per run of consecutive blocks of `ids`, each naming its run's parent."""
        events, bs = [], self.hasher.block_size
        run_start = 0
        for k in range(1, len(blocks) + 1):
            if k == len(blocks) or blocks[k] != blocks[k - 1] + 1:
                first, last = blocks[run_start], blocks[k - 1] + 1
                events.append(
                    block_stored(
                        hashes[first:last],
                        hashes[first - 1] if first > 0 else before,
                        ids[first * bs : last * bs].tolist(),
                        bs,
                        **kind,
                    )
                )
                run_start = k
        return events

    def replace(self, nodes: list[tuple[int, np.ndarray]]) -> list[Event]:
        """Forget what was reported: `AllBlocksCleared`, then every block of the trie's `nodes`
        (parent index, tokens), parents first."""
        self.held.clear()
        events = [all_blocks_cleared()]
        # Each node carries on from its parent's last full block, with the ids of the unfinished
        # block (fewer than block_size) and the hash before it.
        tails: list[tuple[np.ndarray, int | None]] = []
        for parent, tokens in nodes:
            tail, before = tails[parent] if parent >= 0 else (tokens[:0], None)
            ids = np.concatenate([tail, tokens])
            hashes = self.hasher.hashes(ids, before)
            events += self._hold(ids, hashes, 0, before)
            tails.append((ids[len(hashes) * self.hasher.block_size :], hashes[-1] if hashes else before))
        return events


class KVEventPublisher:
    """Publishes a `KVCacheTrie`'s stored and evicted blocks as vLLM KV events.

    `endpoint` is bound here (`tcp://HOST:PORT`, `tcp://*:PORT`, `ipc://PATH`): routers connect to it.
    `replay_endpoint` (optional) serves missed batches from the last `buffer_steps`. Jobs beyond
    `queue_size` are dropped and counted (then the state is republished whole). Attach it with
    `KVCacheTrie.attach_events`; `close()` (or the trie's) stops it.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        topic: str = "",
        queue_size: int = 10_000,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_jobs_per_batch: int = 256,
        bind_retry_s: float = 0.5,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        for value in (endpoint, replay_endpoint):
            if value is not None:
                check_endpoint(value)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.block_size = block_size
        self.topic = topic.encode()
        self.counters = PublisherCounters()
        self._count_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._lost = threading.Event()
        self._resyncing = False
        self._stop = threading.Event()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._max_jobs = max_jobs_per_batch
        self._seq = 0
        self._blocks: ResidentBlocks | None = None  # what was reported resident (set by `bind`)
        self._snapshot: Snapshot | None = None
        self._ctx = zmq.Context.instance()
        # XPUB, not PUB: same messages for subscribers, and it hears them subscribe.
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.set_hwm(hwm)
        self._replay = self._ctx.socket(zmq.ROUTER) if replay_endpoint else None
        for socket, address in ((self._pub, endpoint), (self._replay, replay_endpoint)):
            if socket is None:
                continue
            deadline = time.monotonic() + bind_retry_s
            while True:
                try:
                    socket.bind(address)
                    break
                except zmq.ZMQError as exc:
                    if exc.errno == zmq.EADDRINUSE and time.monotonic() < deadline:
                        time.sleep(0.02)  # released by a publisher this process just closed?
                        continue
                    self._close_sockets()
                    raise ValueError(f"cannot bind {address}: {zmq.strerror(exc.errno)}") from exc
        self._thread = threading.Thread(target=self._run, name="kvblocks-kv-events", daemon=True)

    # ---- wiring (called by KVCacheTrie.attach_events) ---------------------------------------

    def bind(self, seed: str, snapshot: Snapshot) -> None:
        """Start publishing for one trie: `seed` roots the block hashes; `snapshot` reads its state."""
        if self._blocks is not None:
            raise ValueError("a KVEventPublisher belongs to one KVCacheTrie")
        self._blocks = ResidentBlocks(BlockHasher(self.block_size, seed), self._count)
        self._snapshot = snapshot
        self._lost.set()  # the first thing published is the trie's whole state
        self._thread.start()

    # ---- hooks (called under the trie's lock: they only queue) ------------------------------

    def stored(self, ids: np.ndarray, start: int) -> None:
        """Tokens `[start, len(ids))` of `ids` became resident on the device."""
        full = len(ids) // self.block_size
        if full > start // self.block_size:
            self._put(("stored", ids[: full * self.block_size].copy(), start))

    def evicted(self, ids: np.ndarray, keep: int, shared_end: int = 0) -> None:
        """Tokens `[keep, len(ids))` of `ids` leave the device; `[0, shared_end)` stay restorable
        from the shared tier."""
        full = len(ids) // self.block_size
        if full > keep // self.block_size:
            self._put(("evicted", ids[: full * self.block_size].copy(), keep, shared_end))

    def cleared(self) -> None:
        """The cache is being emptied: publish `AllBlocksCleared`, then what stays (locked or pinned
        blocks), instead of one removal per block."""
        self._lost.set()

    def _put(self, job: tuple) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self._count(dropped_jobs=1)
            self._lost.set()

    # ---- reporting and shutdown -------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        with self._count_lock:
            out = {f"kv_events_{k}": v for k, v in asdict(self.counters).items()}
        return out | {"kv_events_queue_depth": self._queue.qsize(), "kv_events_sequence": self._seq}

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every hooked change is published; True if that happened in time."""
        deadline = time.monotonic() + timeout_s
        while self._busy() and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._busy()

    def _busy(self) -> bool:
        return bool(self._queue.unfinished_tasks) or self._lost.is_set() or self._resyncing

    def close(self, timeout_s: float = 10.0) -> None:
        """Publish what is queued, stop the thread and close the sockets."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        else:
            self._close_sockets()

    # ---- the publisher thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if self._lost.is_set():
                    self._resync()
                jobs = self._take_jobs()
                if jobs:
                    self._publish(self._apply(jobs))
                    for _ in jobs:
                        self._queue.task_done()
                elif self._stop.is_set():
                    return
                self._serve_subscriptions()
                self._serve_replays()
        except Exception:  # a bug must not pass silently: log it, routers then see no more events
            log.exception("kvblocks: the KV events publisher stopped")
        finally:
            self._close_sockets()

    def _take_jobs(self) -> list[tuple]:
        try:
            jobs = [self._queue.get(timeout=0.05)]
        except queue.Empty:
            return []
        while len(jobs) < self._max_jobs:
            try:
                jobs.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return jobs

    def _apply(self, jobs: list[tuple[Any, ...]]) -> list[Event]:
        events: list[Event] = []
        ledger = self._ledger()
        for job in jobs:
            if job[0] == "stored":
                events += ledger.stored(job[1], job[2])
            else:
                events += ledger.evicted(job[1], job[2], job[3])
        return events

    def _ledger(self) -> ResidentBlocks:
        assert self._blocks is not None, "bind() starts the thread"
        return self._blocks

    def _resync(self) -> None:
        """Replace what was reported with the trie's state now: `AllBlocksCleared`, then every block."""
        lock, read_nodes = self._snapshot
        self._resyncing = True  # set before `_lost` clears, so `flush` sees no gap
        with lock:  # no hook runs meanwhile: queued jobs are older than the snapshot, which covers them
            self._lost.clear()
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
                self._queue.task_done()
            nodes = read_nodes()
        self._count(resyncs=1)
        self._publish(self._ledger().replace(nodes))
        self._resyncing = False

    def _publish(self, events: list[Event]) -> None:
        if not events:
            return
        payload = encode_batch(time.time(), events)
        seq = self._seq.to_bytes(8, "big")
        self._pub.send_multipart((self.topic, seq, payload))
        self._buffer.append((self._seq, payload))
        self._seq += 1
        self._count(batches=1)

    def _serve_subscriptions(self) -> None:
        """A new subscriber (a router starting or reconnecting) gets the whole state."""
        while self._pub.poll(0):
            message = self._pub.recv()
            if message[:1] == b"\x01":
                self._lost.set()
                self._count(subscriptions=1)

    def _serve_replays(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("kvblocks: ignoring a KV events replay request of %d frames", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            self._count(replays=1)
            for seq, payload in self._buffer:
                if seq >= first:
                    self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        """Unbind, then close. ZMQ releases an address on its I/O thread a moment after this returns,
        so a new bind of the same address in this process may have to wait briefly (`bind_retry_s`)."""
        for socket, address in ((self._pub, self.endpoint), (self._replay, self.replay_endpoint)):
            if socket is None or socket.closed:
                continue
            with contextlib.suppress(zmq.ZMQError):  # never bound (a failed start) or already gone
                socket.unbind(address)
            socket.close(linger=0)

    def _count(self, **deltas: int) -> None:
        with self._count_lock:
            for name, d in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + d)
