"""DiskIndex: which record files the disk tier holds, their sizes in least-recently-used order
(`BytesLRU`), and their recency on disk.

It is built at start by listing the directory (a restart keeps the cache) and rebuilt by `rescan`,
which is how two processes on one directory learn of each other's files. Recency lives in memory: a
hit reorders the LRU and nothing else on the read path. The files' mtimes, which order the files for
a restart and for another process's rescan, are written lazily (`persist`: at most every
`touch_interval_s`, at a rescan and at close), each to the time of its last hit: a process killed
meanwhile loses only that much of its order, never a record.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from kvblocks.spill.disk_files import RECORD, TEMP, entries, record_path, stale, subdirs
from kvblocks.spill.lru import BytesLRU


class DiskIndex:
    """The tier's files by name (`disk_files.file_name`). Thread-safe: every method takes `lock`."""

    def __init__(self, root: Path, capacity: int, touch_interval_s: float) -> None:
        self.root = root
        self.lock = threading.Lock()
        self.lru = BytesLRU(capacity)
        self.touch_interval_s = touch_interval_s
        self.rescanned = 0.0  # time.time() of the last rescan
        self._touched: dict[str, int] = {}  # name -> mtime (ns) its last hit asks for, not yet written
        self._persisted = time.monotonic()

    def rescan(self) -> int:
        """Rebuild from the directory (least recently modified first; the order this process saw
        since the last rescan wins) and delete stale temporary files; how many were deleted."""
        self.persist(force=True)  # so the listing orders by this process's latest hits too
        found, deleted = [], 0
        now = time.time()
        for sub in subdirs(self.root):
            for entry in entries(sub):
                try:
                    st = entry.stat()
                except OSError:  # deleted by another process since the listing
                    continue
                if RECORD.fullmatch(entry.name):
                    found.append((st.st_mtime_ns, entry.name[:-4], st.st_size))
                elif (m := TEMP.fullmatch(entry.name)) and stale(int(m.group(2)), now - st.st_mtime):
                    with contextlib.suppress(OSError):  # gone already, or read-only
                        os.unlink(entry.path)
                        deleted += 1
        with self.lock:
            seen = {name: i for i, name in enumerate(self.lru)}
            found.sort(key=lambda f: (seen.get(f[1], -1), f[0]))
            self.lru.reset((name, size) for _, name, size in found)
        self.rescanned = now
        return deleted

    def hit(self, names: Sequence[str]) -> None:
        """`names` (a run, first chunk first) were read: the first ends most recent, in memory now
        and in the files' mtimes at the next `persist` (a run's tail is worth nothing without its head,
        so it goes first)."""
        now = time.time_ns()
        with self.lock:
            self.lru.touch(reversed(names))
            for i, name in enumerate(names):
                self._touched.pop(name, None)
                self._touched[name] = now - i * 1000  # 1 µs apart: the first chunk ends latest
        if time.monotonic() - self._persisted > self.touch_interval_s:
            self.persist()

    def persist(self, force: bool = False) -> None:
        """Write the pending hits' times to their files' mtimes (all when `force`, else only once
        `touch_interval_s` has passed since the last time)."""
        with self.lock:
            if not force and time.monotonic() - self._persisted <= self.touch_interval_s:
                return
            touched, self._touched = self._touched, {}
            self._persisted = time.monotonic()
        for name, ns in touched.items():
            with contextlib.suppress(OSError):  # read-only, or deleted since: recency is a hint
                os.utime(record_path(self.root, name), ns=(ns, ns))

    def found(self, name: str, size: int) -> None:
        """A file read whole that the index did not list (another process wrote it since the last
        rescan) enters at the least recent end: each process evicts the other's unused files first."""
        with self.lock:
            if name not in self.lru:
                self.lru.add(name, size, recent=False)

    def added(self, name: str, size: int) -> None:
        """This process wrote `name`: the most recent."""
        with self.lock:
            self.lru.add(name, size)
            self._touched.pop(name, None)  # the write set its mtime

    def victim(self, name: str, size: int) -> str | None:
        """The file to evict before `size` bytes under `name` fit, or None when they fit (or nothing
        else is left to evict)."""
        with self.lock:
            return None if self.lru.fits(size, name) else self.lru.victim(keep=name)

    def forget(self, name: str) -> None:
        with self.lock:
            self.lru.pop(name)
            self._touched.pop(name, None)

    def unlink(self, name: str, inode: int | None = None) -> bool:
        """Remove `name` from the index and the directory; with `inode`, only if the file is still
        that one (another process may have renamed a good record over a damaged one)."""
        self.forget(name)
        path = record_path(self.root, name)
        try:
            if inode is not None and os.stat(path).st_ino != inode:
                return False
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
        except OSError:  # read-only: the file stays, and the next rescan counts it again
            return False

    def used(self) -> int:
        return self.lru.used

    def __len__(self) -> int:
        return len(self.lru)
