"""DiskTier: sealed spill records in files under one directory, bounded by size, kept across restarts.

One record is one file, `DIR/<h[:2]>/<h>.kvb` where `h` is a hash of its key: a key never becomes a
path. A file is a small frame around the record the stack's codec made (`FRAME`: magic, version, key
length, value length, xxh3 of key and value, the key's hash) plus the key itself, so the tier checks
its own framing before the codec checks the record: a torn, truncated, bit-flipped or foreign file
(another key's file copied over, another program's) is a counted miss and is deleted, never returned.

Writes go to a temporary name in the same directory and are renamed over the final one, so a reader
(this process or another server sharing the directory) sees a whole file or none. Files are not
fsynced by default: a killed process loses nothing already renamed, and what a power loss tears is
caught by the frame like any other damage, so durability would buy a cache nothing (`fsync=True`
makes every write durable, at the cost BENCHMARKS.md measures).

The size bound is kept by an in-memory index (file name -> bytes, least recently used first) that is
built at start by listing the directory (a restart keeps the cache) and rebuilt every
`rescan_interval_s` by the writer, which is how two processes on one directory learn of each other's
files: between rescans each may overshoot by what the other wrote. A hit also touches the file's
mtime, so a restart and the other process order files by their last use too. A run of chunks is
touched last-first: a chunk is worth nothing without the ones before it, so the tail goes first.

Files are the owner's alone (0600, directories 0700): without a secret a record holds the prompt's
token ids in the clear. A full disk (ENOSPC, EDQUOT, EFBIG), a read-only one (EROFS, EACCES) or a
directory gone and not recreatable stops writes for `retry_interval_s` (counted, health says why);
reads go on.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import re
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import xxhash

from kvblocks.spill.tier import TierHealth, TierUnavailable

MAGIC = b"KVBD"
VERSION = 1
# magic, version, key length, value length, xxh3-64 of key + value, blake2b-128 of the key
FRAME = struct.Struct("<4sHHQQ16s")
MAX_KEY_BYTES = 1024
SUFFIX = ".kvb"
_RECORD = re.compile(r"[0-9a-f]{32}\.kvb")
_FANOUT = re.compile(r"[0-9a-f]{2}")
_TEMP = re.compile(r"\.([0-9a-f]{32})\.(\d+)\.([0-9a-f]{8})\.tmp")
# A temporary file this old is a crashed writer's (a write takes milliseconds).
STALE_TEMP_S = 60.0
# Errors that mean the disk cannot take writes now; anything else an OSError says is a failed write.
FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}


def key_hash(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def digest(key: bytes, value: bytes) -> int:
    return xxhash.xxh3_64_intdigest(value, seed=xxhash.xxh3_64_intdigest(key))


def frame(key: str, value: bytes) -> bytes:
    """The frame and key that precede `value` in its file."""
    k = key.encode()
    if len(k) > MAX_KEY_BYTES:
        raise ValueError(f"a disk tier key is at most {MAX_KEY_BYTES} bytes, got {len(k)}")
    return FRAME.pack(MAGIC, VERSION, len(k), len(value), digest(k, value), key_hash(key)) + k


class DiskTier:
    """A `Tier` of files under `directory`, at most `capacity_bytes` of them (frames included)."""

    name = "disk"

    def __init__(
        self,
        directory: str | os.PathLike,
        capacity_bytes: int,
        *,
        fsync: bool = False,
        retry_interval_s: float = 30.0,
        rescan_interval_s: float = 60.0,
        read_budget_s: float = 0.5,
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
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, least recent first
        self._used = 0
        self._counts = dict.fromkeys(
            (
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
            ),
            0,
        )
        self._health = TierHealth("ok")
        self._blocked_until = 0.0
        self._demote: Callable[[list[tuple[str, bytes]]], None] | None = None
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.rescan()

    def bind_demote(self, demote: Callable[[list[tuple[str, bytes]]], None]) -> None:
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
            overhead = FRAME.size + len(key.encode())
            out.append(size - overhead if size > overhead else -1)
        return out

    def get(self, keys: Sequence[str], limits: Sequence[int]) -> list[bytes | None]:
        """Every file is opened and its read-ahead asked for first, so a cold run's reads reach the
        device together rather than one file after another; then each is read and checked."""
        deadline = time.monotonic() + self.read_budget_s
        files = [self._open(key) for key in keys]
        out: list[bytes | None] = [None] * len(keys)
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
        hit = [self._name(k) for k, v in zip(keys, out) if v is not None]
        now = time.time()
        with self._lock:
            for name in reversed(hit):  # the first chunk of a run ends most recent
                self._index.move_to_end(name)
        for name in hit:  # other processes and a restart see the use too
            with contextlib.suppress(OSError):  # read-only, or deleted since: recency is a hint
                os.utime(self._file(name), (now, now))
        self._count(hits=len(hit), misses=len(keys) - len(hit))
        return out

    def put(self, items: Sequence[tuple[str, bytes]]) -> int:
        """Write each record (evicting the least recently used first); returns the bytes written.
        While the disk is full or read-only nothing is written (counted, never raised); a directory
        deleted under the tier is recreated. Files another process wrote since the last rescan enter
        the index at the least recent end, so each process evicts the other's unused files first."""
        if not self.root.is_dir():
            self._recreate()
        if time.time() - self._rescanned > self.rescan_interval_s:
            self.rescan()
        written = 0
        for i, (key, value) in enumerate(reversed(items)):  # the first chunk of a run ends most recent
            if time.monotonic() < self._blocked_until:
                self._count(write_skipped_degraded=len(items) - i)
                break
            head = frame(key, value)
            size = len(head) + len(value)
            if size > self.capacity:
                self._count(write_failures=1)
                continue
            name = self._name(key)
            self._make_room(name, size)
            if self._write(name, head, value):
                with self._lock:
                    self._used += size - self._index.pop(name, 0)
                    self._index[name] = size
                written += size
        self._count(written_file_bytes=written)
        return written

    def delete(self, keys: Sequence[str]) -> int:
        return sum(self._unlink(self._name(k)) for k in keys)

    def scan(self, prefix: str) -> Iterator[str]:
        """Keys of the records in the directory that start with `prefix` (reads each file's frame)."""
        for sub in self._subdirs():
            for entry in _entries(sub):
                if not _RECORD.fullmatch(entry.name):
                    continue
                try:
                    with open(entry.path, "rb") as f:
                        head = f.read(FRAME.size + MAX_KEY_BYTES)
                except OSError:
                    continue
                key = _framed_key(head)
                if key is not None and key.startswith(prefix) and self._name(key) == entry.name[:-4]:
                    yield key

    def used_bytes(self) -> int:
        return self._used

    def capacity_bytes(self) -> int | None:
        return self.capacity

    def records(self) -> int:
        return len(self._index)

    def health(self) -> TierHealth:
        if not self.root.is_dir():
            return TierHealth("down", f"{self.root} is gone (recreated on the next write)")
        if time.monotonic() >= self._blocked_until:
            return TierHealth("ok")
        return self._health

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts) | {"files": len(self._index), "used_bytes": self._used}

    def close(self) -> None:
        """Nothing is buffered: every record is in its file, or was never written."""

    # ---- index ---------------------------------------------------------------------------

    def rescan(self) -> None:
        """Rebuild the index from the directory (least recently modified first) and delete stale
        temporary files; recency this process saw since the last rescan is kept."""
        found = []
        now = time.time()
        for sub in self._subdirs():
            for entry in _entries(sub):
                try:
                    st = entry.stat()
                except OSError:  # deleted by another process since the listing
                    continue
                if _RECORD.fullmatch(entry.name):
                    found.append((st.st_mtime, entry.name[:-4], st.st_size))
                elif (m := _TEMP.fullmatch(entry.name)) and _stale(int(m.group(2)), now - st.st_mtime):
                    with contextlib.suppress(OSError):  # gone already, or read-only
                        os.unlink(entry.path)
                        self._count(stale_temps_deleted=1)
        with self._lock:
            seen = {name: i for i, name in enumerate(self._index)}
            found.sort(key=lambda f: (seen.get(f[1], -1), f[0]))
            self._index = OrderedDict((name, size) for _, name, size in found)
            self._used = sum(self._index.values())
            self._counts["rescans"] += 1
        self._rescanned = now

    def _recreate(self) -> None:
        """The directory was deleted under the tier: its files went with it."""
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            self._failed(exc)
        self.rescan()

    def _make_room(self, name: str, size: int) -> None:
        evicted = []
        while True:
            with self._lock:
                if self._used - self._index.get(name, 0) + size <= self.capacity or not self._index:
                    break
                victim = next(iter(self._index))
                if victim == name:
                    self._index.move_to_end(name)
                    continue
            record = self._load(victim) if self._demote is not None else None
            if self._unlink(victim):
                self._count(evictions=1)
                if record is not None:
                    evicted.append(record)
        if evicted:
            self._demote(evicted)

    def _load(self, name: str) -> tuple[str, bytes] | None:
        """The (key, value) a file holds, when its frame is whole and names the file."""
        try:
            with open(self._file(name), "rb", buffering=0) as f:
                data = f.read()
        except OSError:
            return None
        key = _framed_key(data[: FRAME.size + MAX_KEY_BYTES])
        if key is None or self._name(key) != name:
            return None
        k = key.encode()
        parsed = _parse(data[: FRAME.size + len(k)], k, len(data))
        value = data[FRAME.size + len(k) :]
        return None if parsed is None or digest(k, value) != parsed[1] else (key, value)

    def _unlink(self, name: str, inode: int | None = None) -> bool:
        """Remove `name` from the index and the directory; with `inode`, only if the file is still
        that one (another process may have renamed a good record over a damaged one)."""
        with self._lock:
            self._used -= self._index.pop(name, 0)
        path = self._file(name)
        try:
            if inode is not None and os.stat(path).st_ino != inode:
                return False
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
        except OSError:  # read-only: the file stays, and the next rescan counts it again
            return False

    # ---- files ---------------------------------------------------------------------------

    def _open(self, key: str) -> io.FileIO | None:
        name = self._name(key)
        try:
            f = open(self._file(name), "rb", buffering=0)  # noqa: SIM115 (`get` closes it)
        except FileNotFoundError:  # never written, evicted, or deleted by another process
            with self._lock:
                self._used -= self._index.pop(name, 0)
            return None
        except OSError:
            return None
        with contextlib.suppress(OSError):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
        return f

    def _read(self, key: str, f: io.FileIO | None, limit: int) -> bytes | None:
        if f is None:
            return None
        name = self._name(key)
        try:
            st = os.fstat(f.fileno())
            k = key.encode()
            head = f.read(FRAME.size + len(k))
            parsed = _parse(head, k, st.st_size)
            if parsed is None:
                self._damaged(name, st.st_ino)
                return None
            length, expected = parsed
            value = f.read(min(length, limit))
        except OSError:
            return None
        if len(value) < min(length, limit):  # truncated since fstat
            self._damaged(name, st.st_ino)
            return None
        if len(value) == length and digest(k, value) != expected:
            self._damaged(name, st.st_ino)
            return None
        with self._lock:
            if name not in self._index:  # written by another process since the last rescan
                self._index[name] = st.st_size
                self._used += st.st_size
        self._count(read_file_bytes=len(value))
        return value

    def _damaged(self, name: str, inode: int) -> None:
        self._count(damaged_deleted=int(self._unlink(name, inode)))

    def _write(self, name: str, head: bytes, value: bytes) -> bool:
        path = self._file(name)
        temp = path.with_name(f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
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
        if exc.errno in FULL:
            reason = f"disk full ({errno.errorcode.get(exc.errno, exc.errno)}): writes stopped"
        elif exc.errno in READ_ONLY:
            reason = f"{self.root} is read-only: writes stopped"
        elif not self.root.is_dir():
            reason = f"{self.root} is gone and cannot be recreated"
        else:
            return
        self._health = TierHealth("degraded", reason)
        self._blocked_until = time.monotonic() + self.retry_interval_s

    def _name(self, key: str) -> str:
        return key_hash(key).hex()

    def _file(self, name: str) -> Path:
        return self.root / name[:2] / (name + SUFFIX)

    def path(self, key: str) -> Path:
        """The file that holds (or would hold) `key`'s record."""
        return self._file(self._name(key))

    def _subdirs(self) -> Iterator[str]:
        for entry in _entries(self.root):
            if _FANOUT.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                yield entry.path

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                self._counts[name] += d


def write_file(fd: int, head: bytes, value: bytes, fsync: bool) -> None:
    """Write a whole file and close it (the seam where tests make the disk full). A short write
    (a size limit reached) is retried, and the retry raises what stopped it."""
    try:
        for data in (memoryview(head), memoryview(value)):
            while data:
                data = data[os.write(fd, data) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _parse(head: bytes, key: bytes, file_size: int) -> tuple[int, int] | None:
    """(value length, digest) when `head` frames a value of `key` and the file holds all of it."""
    if len(head) != FRAME.size + len(key):
        return None
    magic, version, key_len, length, digest, hashed = FRAME.unpack_from(head)
    if (magic, version, key_len) != (MAGIC, VERSION, len(key)) or head[FRAME.size :] != key:
        return None
    if hashed != hashlib.blake2b(key, digest_size=16).digest() or file_size != len(head) + length:
        return None
    return length, digest


def _framed_key(head: bytes) -> str | None:
    if len(head) < FRAME.size:
        return None
    magic, version, key_len, *_ = FRAME.unpack_from(head)
    if (magic, version) != (MAGIC, VERSION) or len(head) < FRAME.size + key_len:
        return None
    try:
        return head[FRAME.size : FRAME.size + key_len].decode()
    except UnicodeDecodeError:
        return None


def _entries(path: str | Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _stale(pid: int, age_s: float) -> bool:
    """A temporary file is a crashed writer's when it is old or its process is gone."""
    if age_s > STALE_TEMP_S:
        return True
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False
