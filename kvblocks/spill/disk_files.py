"""The disk tier's files: where a record lives, the frame around it, and listing the directory.

One record is one file, `DIR/<h[:2]>/<h>.kvb` where `h` is a hash of its key: a key never becomes a
path. The file is `FRAME` (magic, version, key length, value length), the key, then the value as the
stack's codec made it. The frame checks only what the codec cannot: that the file is a whole record
of this format (not torn, truncated, grown or another program's) and that it holds this key (not
another key's file copied over it). Damage inside the value is the codec's to catch, and it does:
kvblocks' records carry an xxh3 of their payload, or an AES-GCM tag when sealed, over the same bytes,
so a second checksum here would read every value twice for nothing.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path

MAGIC = b"KVBD"
# 2: the frame no longer holds an xxh3 of the value or the key's hash; a version-1 file is foreign
# (a counted miss, deleted when read, evicted like any file meanwhile).
VERSION = 2
FRAME = struct.Struct("<4sHHQ")  # magic, version, key length, value length; the key follows
MAX_KEY_BYTES = 1024
SUFFIX = ".kvb"
RECORD = re.compile(r"[0-9a-f]{32}\.kvb")
FANOUT = re.compile(r"[0-9a-f]{2}")
TEMP = re.compile(r"\.([0-9a-f]{32})\.(\d+)\.([0-9a-f]{8})\.tmp")
# A temporary file this old is a crashed writer's (a write takes milliseconds).
STALE_TEMP_S = 60.0
# Errors that mean the disk cannot take writes now; anything else an OSError says is a failed write.
FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}


def file_name(key: str) -> str:
    """The name (without directory and suffix) of `key`'s file."""
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


def record_path(root: Path, name: str) -> Path:
    return root / name[:2] / (name + SUFFIX)


def temp_path(path: Path, name: str) -> Path:
    """A fresh temporary name beside `path`, naming this process (see `stale`)."""
    return path.with_name(f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")


def frame(key: str, value_bytes: int) -> bytes:
    """The frame and key that precede a value of `value_bytes` in its file."""
    k = key.encode()
    if len(k) > MAX_KEY_BYTES:
        raise ValueError(f"a disk tier key is at most {MAX_KEY_BYTES} bytes, got {len(k)}")
    return FRAME.pack(MAGIC, VERSION, len(k), value_bytes) + k


def overhead(key: str) -> int:
    """Bytes a file holds besides its value."""
    return FRAME.size + len(key.encode())


def parse(head: bytes, key: bytes, file_size: int) -> int | None:
    """The value's length when `head` frames a value of `key` and the file holds exactly all of it."""
    if len(head) != FRAME.size + len(key):
        return None
    magic, version, key_len, length = FRAME.unpack_from(head)
    if (magic, version, key_len) != (MAGIC, VERSION, len(key)) or head[FRAME.size :] != key:
        return None
    return length if file_size == len(head) + length else None


def framed_key(head: bytes) -> str | None:
    """The key a file's first bytes name, when they are a frame of this format."""
    if len(head) < FRAME.size:
        return None
    magic, version, key_len, _ = FRAME.unpack_from(head)
    if (magic, version) != (MAGIC, VERSION) or len(head) < FRAME.size + key_len:
        return None
    try:
        return head[FRAME.size : FRAME.size + key_len].decode()
    except UnicodeDecodeError:
        return None


def write_file(fd: int, head: bytes, value: bytes | memoryview, fsync: bool) -> None:
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


def read_record(path: Path, name: str) -> tuple[str, bytes] | None:
    """The (key, value) of the file `name` at `path`, when its frame is whole and names the file."""
    try:
        with open(path, "rb", buffering=0) as f:
            data = f.read()
    except OSError:
        return None
    key = framed_key(data[: FRAME.size + MAX_KEY_BYTES])
    if key is None or file_name(key) != name:
        return None
    start = overhead(key)
    return None if parse(data[:start], key.encode(), len(data)) is None else (key, data[start:])


def scan_keys(root: Path, prefix: str) -> Iterator[str]:
    """Keys of the records under `root` that start with `prefix` (reads each file's frame)."""
    for sub in subdirs(root):
        for entry in entries(sub):
            if not RECORD.fullmatch(entry.name):
                continue
            try:
                with open(entry.path, "rb") as f:
                    head = f.read(FRAME.size + MAX_KEY_BYTES)
            except OSError:
                continue
            key = framed_key(head)
            if key is not None and key.startswith(prefix) and file_name(key) == entry.name[:-4]:
                yield key


def degraded_reason(exc: OSError, root: Path) -> str:
    """Why a failed write stops writes for a while (a full or read-only disk, a directory that
    cannot be recreated), or "" for a failure of that one write."""
    if exc.errno in FULL:
        return f"disk full ({errno.errorcode.get(exc.errno, exc.errno)}): writes stopped"
    if exc.errno in READ_ONLY:
        return f"{root} is read-only: writes stopped"
    if not root.is_dir():
        return f"{root} is gone and cannot be recreated"
    return ""


def entries(path: str | Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def subdirs(root: Path) -> list[str]:
    """The fan-out directories under `root` (two hex digits; anything else there is not the tier's)."""
    return [e.path for e in entries(root) if FANOUT.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]


def stale(pid: int, age_s: float) -> bool:
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
