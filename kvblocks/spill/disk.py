"""DiskTier: sealed spill records in files under one directory, bounded by size, kept across restarts.

One record is one file (`spill.disk_files`: its name is a hash of the key, never the key): a small
frame, the key, then the record as the stack's codec made it. The tier checks the frame (a whole
file of this format, holding this key); the codec checks the record, an xxh3 of its payload or, with
a secret, an AES-GCM seal, so a torn, truncated, bit-flipped or foreign file (another key's file
copied over, another program's) is a counted miss and is deleted, never returned as KV: the frame's
damage by the tier as it reads (`damaged_deleted`), the record's by the stack, which counts a
verification failure and hands the key back to `discard` (counted there too). The tier therefore
holds only records of a codec that verifies them (`needs_verified_records`; the stack checks).

Writes go to a temporary name in the same directory and are renamed over the final one, so a reader
(this process or another server sharing the directory) sees a whole file or none. Files are not
fsynced by default: a killed process loses nothing already renamed, and what a power loss tears is
caught like any other damage, so durability would buy a cache nothing (`fsync=True` makes every
write durable, at the cost BENCHMARKS.md measures).

The size bound is kept by an index (`spill.disk_index`: file name -> bytes, least recently used
first) built at start by listing the directory and rebuilt every `rescan_interval_s` by the writer,
which is how two processes on one directory learn of each other's files: between rescans each may
overshoot by what the other wrote. A hit reorders the index in memory; the files' mtimes, which order
them for a restart and for the other process, follow at most every `touch_interval_s` and at close.

Files are the owner's alone (0600, directories 0700): without a secret a record holds the prompt's
token ids in the clear. A full disk (ENOSPC, EDQUOT, EFBIG), a read-only one (EROFS, EACCES) or a
directory gone and not recreatable stops writes for `retry_interval_s` (counted, health says why);
reads go on.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kvblocks.spill.disk_files import (
    FRAME,
    degraded_reason,
    file_name,
    frame,
    overhead,
    parse,
    read_record,
    record_path,
    scan_keys,
    temp_path,
    write_file,
)
from kvblocks.spill.disk_index import DiskIndex
from kvblocks.spill.tier import TierHealth, TierUnavailable, Value

__all__ = ["FRAME", "DiskTier", "write_file"]

COUNTERS = (
    "hits",
    "misses",
    "read_file_bytes",
    "written_file_bytes",
    "written_files",
    "evictions",
    "damaged_deleted",
    "write_failures",
    "write_skipped_degraded",
    "rescans",
    "stale_temps_deleted",
    "read_budget_cuts",
)


class DiskTier:
    """A `Tier` of files under `directory`, at most `capacity_bytes` of them (frames included)."""

    name = "disk"
    # Damage inside a value is the codec's to catch (see the module doc): the stack refuses a codec
    # that does not verify its records over this tier.
    needs_verified_records = True

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        fsync: bool = False,
        retry_interval_s: float = 30.0,
        rescan_interval_s: float = 60.0,
        read_budget_s: float = 0.5,
        touch_interval_s: float = 10.0,
    ) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"the disk tier's size must be positive, got {capacity_bytes}")
        self.root = Path(directory).expanduser()
        self.capacity = capacity_bytes
        self.fsync = fsync
        self.retry_interval_s = retry_interval_s
        self.rescan_interval_s = rescan_interval_s
        # A lookup runs while a request is admitted: like Redis's reply timeout, a slow disk may hold it
        # at most this long; the run read by then is used and the rest is computed (`read_budget_cuts`).
        self.read_budget_s = read_budget_s
        self._lock = threading.Lock()  # the counters'
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._health = TierHealth("ok")
        self._blocked_until = 0.0
        self._demote: Callable[[list[tuple[str, Value]]], None] | None = None
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.index = DiskIndex(self.root, capacity_bytes, touch_interval_s)
        self.rescan()

    def bind_demote(self, demote: Callable[[list[tuple[str, Value]]], None]) -> None:
        """`demote(items)` receives the records eviction removes (read back before their files go),
        so a stack under write-back hands them to the tier below."""
        self._demote = demote

    # ---- Tier ----------------------------------------------------------------------------

    def sizes(self, keys: Sequence[str]) -> list[int]:
        out = []
        for key in keys:
            try:
                size = os.stat(self.path(key)).st_size
            except FileNotFoundError:
                out.append(0)
                continue
            except OSError as exc:
                raise TierUnavailable(f"disk tier at {self.root}: {exc}") from exc
            extra = overhead(key)
            out.append(size - extra if size > extra else -1)
        return out

    def get(self, keys: Sequence[str], limits: Sequence[int]) -> list[Value | None]:
        """Every file is opened and its read-ahead asked for first, so a cold run's reads reach the
        device together rather than one file after another; then each is read and its frame checked."""
        deadline = time.monotonic() + self.read_budget_s
        names = [file_name(key) for key in keys]
        files = [self._open(name) for name in names]
        out: list[Value | None] = [None] * len(keys)
        try:
            for i, (key, f, limit) in enumerate(zip(keys, files, limits)):
                if i and time.monotonic() > deadline:  # the run so far is used; the rest is computed
                    self._count(read_budget_cuts=1)
                    break
                out[i] = self._read(key, f, limit)
        finally:
            for f in files:
                if f is not None:
                    f.close()
        hit = [name for name, v in zip(names, out) if v is not None]
        self.index.hit(hit)
        self._count(hits=len(hit), misses=len(keys) - len(hit))
        return out

    def put(self, items: Sequence[tuple[str, Value]]) -> int:
        """Write each record (evicting the least recently used first); returns the bytes written.
        While the disk is full or read-only nothing is written (counted, never raised); a directory
        deleted under the tier is recreated."""
        if not self.root.is_dir():
            self._recreate()
        if time.time() - self.index.rescanned > self.rescan_interval_s:
            self.rescan()
        written = 0
        for i, (key, value) in enumerate(reversed(items)):  # the first chunk of a run ends most recent
            if time.monotonic() < self._blocked_until:
                self._count(write_skipped_degraded=len(items) - i)
                break
            head = frame(key, len(value))
            size = len(head) + len(value)
            if size > self.capacity:
                self._count(write_failures=1)
                continue
            name = file_name(key)
            self._make_room(name, size)
            if self._write(name, head, value):
                self.index.added(name, size)
                written += size
        self._count(written_file_bytes=written)
        self.index.persist()
        return written

    def delete(self, keys: Sequence[str]) -> int:
        return sum(self.index.unlink(file_name(k)) for k in keys)

    def discard(self, keys: Sequence[str]) -> int:
        """Delete records the codec refused (damage inside a value): counted as damaged files."""
        deleted = self.delete(keys)
        self._count(damaged_deleted=deleted)
        return deleted

    def scan(self, prefix: str) -> Iterator[str]:
        """Keys of the records in the directory that start with `prefix` (reads each file's frame)."""
        return scan_keys(self.root, prefix)

    def used_bytes(self) -> int:
        return self.index.used()

    def capacity_bytes(self) -> int | None:
        return self.capacity

    def records(self) -> int:
        return len(self.index)

    def health(self) -> TierHealth:
        if not self.root.is_dir():
            return TierHealth("down", f"{self.root} is gone (recreated on the next write)")
        if time.monotonic() >= self._blocked_until:
            return TierHealth("ok")
        return self._health

    def counters(self) -> dict[str, int]:
        with self._lock:
            counts = dict(self._counts)
        return counts | {"files": len(self.index), "used_bytes": self.index.used()}

    def close(self) -> None:
        """Every record is in its file, or was never written; the hits' recency goes to the mtimes."""
        self.index.persist(force=True)

    # ---- index ---------------------------------------------------------------------------

    def rescan(self) -> None:
        """Rebuild the index from the directory and delete stale temporary files (`DiskIndex.rescan`)."""
        deleted = self.index.rescan()
        self._count(rescans=1, stale_temps_deleted=deleted)

    def _recreate(self) -> None:
        """The directory was deleted under the tier: its files went with it."""
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            self._failed(exc)
        self.rescan()

    def _make_room(self, name: str, size: int) -> None:
        evicted: list[tuple[str, Value]] = []
        while (victim := self.index.victim(name, size)) is not None:
            record = read_record(record_path(self.root, victim), victim) if self._demote is not None else None
            if self.index.unlink(victim):
                self._count(evictions=1)
                if record is not None:
                    evicted.append(record)
        if evicted and self._demote is not None:
            self._demote(evicted)

    # ---- files ---------------------------------------------------------------------------

    def _open(self, name: str) -> io.FileIO | None:
        try:
            f = open(record_path(self.root, name), "rb", buffering=0)  # noqa: SIM115 (`get` closes it)
        except FileNotFoundError:  # never written, evicted, or deleted by another process
            self.index.forget(name)
            return None
        except OSError:
            return None
        with contextlib.suppress(OSError):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
        return f

    def _read(self, key: str, f: io.FileIO | None, limit: int) -> bytes | None:
        """At most `limit` bytes of `key`'s value from its open file, when its frame is whole; the
        value is read straight into the one bytes object returned (no copy after the kernel's)."""
        if f is None:
            return None
        try:
            st = os.fstat(f.fileno())
            k = key.encode()
            length = parse(f.read(FRAME.size + len(k)), k, st.st_size)
            if length is None:
                self._damaged(file_name(key), st.st_ino)
                return None
            value = f.read(min(length, limit))
        except OSError:
            return None
        if len(value) < min(length, limit):  # truncated since fstat
            self._damaged(file_name(key), st.st_ino)
            return None
        self.index.found(file_name(key), st.st_size)
        self._count(read_file_bytes=len(value))
        return value

    def _damaged(self, name: str, inode: int) -> None:
        self._count(damaged_deleted=int(self.index.unlink(name, inode)))

    def _write(self, name: str, head: bytes, value: Value) -> bool:
        path = record_path(self.root, name)
        temp = temp_path(path, name)
        try:
            try:
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileNotFoundError:  # first write to this fan-out directory, or the tree is gone
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                write_file(fd, head, value, self.fsync)
                os.replace(temp, path)
            except BaseException:
                with contextlib.suppress(OSError):  # gone already, or read-only
                    os.unlink(temp)
                raise
        except OSError as exc:
            self._failed(exc)
            return False
        self._count(written_files=1)
        return True

    def _failed(self, exc: OSError) -> None:
        """A write failed: a full or read-only disk (or one whose directory cannot be recreated)
        blocks writes for `retry_interval_s`; the first write after that is the probe."""
        self._count(write_failures=1)
        reason = degraded_reason(exc, self.root)
        if reason:
            self._health = TierHealth("degraded", reason)
            self._blocked_until = time.monotonic() + self.retry_interval_s

    def path(self, key: str) -> Path:
        """The file that holds (or would hold) `key`'s record."""
        return record_path(self.root, file_name(key))

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                self._counts[name] += d
