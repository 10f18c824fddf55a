"""DiskTier alone: framing, each kind of damage (a flipped value through the codec above it), eviction by
size, the index rebuilt at start, two processes on one directory, and a disk that is full, read-only or
gone."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import IdTokenizer, tiny_llama

from kvblocks import CachedGenerator, KVCacheTrie
from kvblocks.spill import disk
from kvblocks.spill.disk import FRAME, DiskTier
from kvblocks.spill.stack import TierStack
from kvblocks.spill.tier import Tier

KEY = "kvblocks:ns0:{:04d}"


def value(i: int, size: int = 1000) -> bytes:
    return (f"record {i};".encode() * size)[:size]


def record_files(root: Path) -> list[Path]:
    return sorted(root.glob("??/*.kvb"))


def only_file(root: Path) -> Path:
    [path] = record_files(root)
    return path


def test_disk_tier_is_a_tier_and_round_trips(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    assert isinstance(tier, Tier)
    keys = [KEY.format(i) for i in range(3)]
    written = tier.put([(k, value(i)) for i, k in enumerate(keys)])
    assert written == tier.used_bytes() == sum(p.stat().st_size for p in record_files(tmp_path))
    assert tier.get([*keys, "kvblocks:ns0:absent"], [2000] * 4) == [value(0), value(1), value(2), None]
    assert tier.sizes([*keys, "kvblocks:ns0:absent"]) == [1000, 1000, 1000, 0]
    assert tier.get([keys[0]], [10]) == [value(0)[:10]]  # at most `limit` bytes are read
    assert sorted(tier.scan("kvblocks:ns0:")) == keys and list(tier.scan("kvblocks:other:")) == []
    assert tier.delete([keys[1], "kvblocks:ns0:absent"]) == 1
    assert tier.get([keys[1]], [2000]) == [None] and len(record_files(tmp_path)) == 2
    tier.put([(keys[0], b"replaced")])
    assert tier.get([keys[0]], [100]) == [b"replaced"]
    c = tier.counters()
    assert (c["hits"], c["misses"], c["files"]) == (5, 2, 2), c


def test_a_key_is_hashed_never_used_as_a_path(tmp_path):
    root = tmp_path / "cache"
    tier = DiskTier(root, 1 << 20)
    hostile = ["../../escape", "/etc/passwd", "a\x00b", "..", "x/" * 300]
    tier.put([(k, value(i)) for i, k in enumerate(hostile)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    assert len(record_files(root)) == len(hostile)
    assert tier.get(hostile, [5000] * len(hostile)) == [value(i) for i in range(len(hostile))]


def damage_truncate(path: Path, other: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def damage_torn_empty(path: Path, other: Path) -> None:
    path.write_bytes(b"")


def damage_flip_value(path: Path, other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x04
    path.write_bytes(bytes(data))


def damage_flip_frame(path: Path, other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[9] ^= 0x01  # the value length
    path.write_bytes(bytes(data))


def damage_flip_key(path: Path, other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[20] ^= 0x80  # a byte of the key after the frame
    path.write_bytes(bytes(data))


def damage_foreign_key(path: Path, other: Path) -> None:
    path.write_bytes(other.read_bytes())  # another key's whole, valid file under this name


def damage_foreign_program(path: Path, other: Path) -> None:
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(5000))


def damage_appended(path: Path, other: Path) -> None:
    path.write_bytes(path.read_bytes() + b"more")


@pytest.mark.parametrize(
    "damage",
    [
        damage_truncate,
        damage_torn_empty,
        damage_flip_frame,
        damage_flip_key,
        damage_foreign_key,
        damage_foreign_program,
        damage_appended,
    ],
)
def test_damaged_file_is_a_counted_miss_and_is_deleted(tmp_path, damage):
    """Damage to the frame or the key, or a file of another size or program: the tier's own check.
    A bit flipped inside a value is the codec's (the next test)."""
    tier = DiskTier(tmp_path, 1 << 20)
    a, b = KEY.format(1), KEY.format(2)
    tier.put([(a, value(1))])
    path = only_file(tmp_path)
    tier.put([(b, value(2))])
    other = next(p for p in record_files(tmp_path) if p != path)
    damage(path, other)
    assert tier.get([a, b], [5000, 5000]) == [None, value(2)]
    assert not path.exists()
    c = tier.counters()
    assert (c["damaged_deleted"], c["misses"], c["files"]) == (1, 1, 1), c
    assert tier.used_bytes() == other.stat().st_size


CHUNK = 8
SECRET = b"a disk-tier test secret"


@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_bit_flipped_value_is_refused_by_the_codec_counted_and_deleted_by_the_tier(tmp_path, secret):
    """The frame does not checksum the value: the record's own checksum (or seal) catches the flip,
    the stack counts a miss and the tier deletes the file, counting it as damaged."""
    model, tokenizer = tiny_llama(seed=0), IdTokenizer()
    text = " ".join(str(t) for t in np.random.default_rng(3).integers(0, 128, 80))
    plain = CachedGenerator(model, tokenizer, None).generate(text, max_new_tokens=2).token_ids
    tier = DiskTier(tmp_path, 1 << 30)
    stack = TierStack([tier], chunk_tokens=CHUNK, secret=secret)
    cache = KVCacheTrie.for_model(model, capacity_tokens=1000, spill=stack)
    try:
        assert CachedGenerator(model, tokenizer, cache).generate(text, max_new_tokens=2).token_ids == plain
        assert stack.flush()
        ns, ids = cache.namespace.key, np.array(tokenizer(text)["input_ids"])
        key = stack.key(ns, stack.codec.chunk_hashes(ns, ids, CHUNK)[3])
        path = tier.path(key)
        data = bytearray(path.read_bytes())
        data[-50] ^= 0x04  # inside the record's KV (or its ciphertext)
        path.write_bytes(bytes(data))
        cache.clear()
        again = CachedGenerator(model, tokenizer, cache).generate(text, max_new_tokens=2)
        assert again.token_ids == plain and again.cached_tokens == 3 * CHUNK  # the run ends before it
        assert stack.flush()
        s = cache.stats()
        assert (s["disk_verify_failures"], s["disk_deleted_invalid"], s["disk_damaged_deleted"]) == (
            1,
            1,
            1,
        ), s
        assert path.read_bytes() != bytes(data)  # deleted, then written again whole by write-through
    finally:
        cache.close()


def test_the_stack_refuses_a_format_without_verification_over_the_disk_tier(tmp_path):
    from kvblocks.adapters.lmcache import LMCacheCodec

    with pytest.raises(ValueError, match="disk tier relies on kvblocks' own records"):
        TierStack([DiskTier(tmp_path, 1 << 20)], codec=LMCacheCodec("org/model", redis_is_trusted=True))


def test_eviction_keeps_the_size_bound_and_drops_the_least_recently_used(tmp_path):
    size = FRAME.size + len(KEY.format(0)) + 1000
    tier = DiskTier(tmp_path, 3 * size)
    for i in range(3):
        tier.put([(KEY.format(i), value(i))])
    assert tier.get([KEY.format(0)], [5000]) == [value(0)]  # 0 is now the most recent
    tier.put([(KEY.format(3), value(3))])
    assert tier.get([KEY.format(i) for i in range(4)], [5000] * 4) == [value(0), None, value(2), value(3)]
    assert tier.used_bytes() == 3 * size == sum(p.stat().st_size for p in record_files(tmp_path))
    assert tier.counters()["evictions"] == 1
    # A run read together loses its tail first: a chunk is useless without those before it.
    tier.get([KEY.format(0), KEY.format(2), KEY.format(3)], [5000] * 3)
    tier.put([(KEY.format(4), value(4))])
    assert tier.sizes([KEY.format(i) for i in (0, 2, 3)]) == [1000, 1000, 0]
    # One record larger than the whole tier is refused (counted), not written over everything.
    assert tier.put([("big", bytes(3 * size))]) == 0 and tier.counters()["write_failures"] == 1


def test_a_restart_rebuilds_the_index_from_the_directory_in_the_order_of_use(tmp_path):
    size = FRAME.size + len(KEY.format(0)) + 1000
    first = DiskTier(tmp_path, 3 * size)
    for i in range(3):
        first.put([(KEY.format(i), value(i))])
        os.utime(only_by_key(tmp_path, first, KEY.format(i)), (1000 + i, 1000 + i))
    first.get([KEY.format(0)], [5000])  # touches its file: a restart sees 0 as the most recent
    first.close()
    second = DiskTier(tmp_path, 3 * size)
    assert second.used_bytes() == 3 * size and second.counters()["files"] == 3
    assert second.get([KEY.format(2)], [5000]) == [value(2)]
    second.put([(KEY.format(3), value(3))])
    assert second.sizes([KEY.format(i) for i in range(4)]) == [1000, 0, 1000, 1000]
    # A smaller size at restart evicts down to it on the next write.
    third = DiskTier(tmp_path, 2 * size)
    third.put([(KEY.format(5), value(5))])
    assert third.used_bytes() <= 2 * size and len(record_files(tmp_path)) == 2


def only_by_key(root: Path, tier: DiskTier, key: str) -> Path:
    path = tier.path(key)
    assert path.parent.parent == root and path.exists()
    return path


def test_stale_temporary_files_are_cleaned_at_start_and_nothing_foreign_is_touched(tmp_path):
    sub = tmp_path / "ab"
    sub.mkdir()
    name = "ab" + "0" * 30
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    dead_pid = int(dead.stdout)
    crashed = sub / f".{name}.{dead_pid}.00000000.tmp"  # its writer was killed
    old = sub / f".{name}.{os.getppid()}.00000001.tmp"  # a live pid, but an hour old
    live = sub / f".{name}.{os.getppid()}.00000002.tmp"  # another live server mid-write
    foreign = [tmp_path / "notes.txt", sub / "photo.jpg", tmp_path / "zz-not-hex" / f"{name}.kvb"]
    for path in [crashed, old, live, *foreign]:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"partial")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    tier = DiskTier(tmp_path, 1 << 20)
    assert not crashed.exists() and not old.exists() and live.exists()
    assert tier.counters()["stale_temps_deleted"] == 2
    assert all(p.exists() for p in foreign)
    assert tier.used_bytes() == 0  # foreign files are not records and not counted
    tier.put([(KEY.format(i), value(i, 400_000)) for i in range(5)])  # evicts, never a foreign file
    assert all(p.exists() for p in foreign)


def test_a_write_that_fails_leaves_no_file_behind(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 1 << 20, retry_interval_s=0.3)
    tier.put([(KEY.format(0), value(0))])

    def full(fd, head, data, fsync):
        os.write(fd, head)  # part of the file, then the disk is full
        os.close(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk, "write_file", full)
    assert tier.put([(KEY.format(i), value(i)) for i in (1, 2, 3)]) == 0
    c = tier.counters()
    assert (c["write_failures"], c["write_skipped_degraded"]) == (1, 2), c
    health = tier.health()
    assert health.state == "degraded" and "ENOSPC" in health.reason
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [only_file(tmp_path).name]
    assert tier.get([KEY.format(0)], [5000]) == [value(0)]  # reads go on
    monkeypatch.undo()
    assert tier.put([(KEY.format(4), value(4))]) == 0  # still within the retry interval
    time.sleep(0.35)
    assert tier.put([(KEY.format(4), value(4))]) > 0 and tier.health().state == "ok"


CHILD = """
import json, os, resource, sys, time
from kvblocks.spill.disk import DiskTier
args = json.loads(sys.argv[1])
if args.get("fsize"):
    resource.setrlimit(resource.RLIMIT_FSIZE, (args["fsize"], args["fsize"]))
tier = DiskTier(args["root"], args["capacity"], rescan_interval_s=args.get("rescan", 60.0))
out = {"read": tier.get(args["read"], [1 << 20] * len(args["read"])) if args.get("read") else []}
out["read"] = [None if v is None else v.decode() for v in out["read"]]
out["written"] = tier.put([(k, v.encode()) for k, v in args.get("write", [])])
out["health"] = [tier.health().state, tier.health().reason]
out["counters"] = tier.counters()
print(json.dumps(out))
"""


def run_child(args: dict, prefix: tuple[str, ...] = ()) -> dict:
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", CHILD, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_file_size_limit_is_a_full_disk_in_a_real_process(tmp_path):
    # RLIMIT_FSIZE makes the kernel refuse the write itself (EFBIG, after a short write).
    small, big = "s" * 100, "b" * 100_000
    out = run_child(
        {"root": str(tmp_path), "capacity": 1 << 20, "fsize": 20_000, "write": [["k2", big], ["k1", small]]}
    )
    assert out["health"][0] == "degraded" and "EFBIG" in out["health"][1], out
    assert out["counters"]["write_failures"] == 1 and out["counters"]["files"] == 1
    assert [p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()] == [FRAME.size + 2 + 100]
    assert DiskTier(tmp_path, 1 << 20).get(["k1", "k2"], [1 << 20] * 2) == [small.encode(), None]


# root ignores a directory's mode: its child drops the capabilities that let it
NOT_ROOT = (
    ("setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner") if os.geteuid() == 0 else ()
)


@pytest.mark.skipif(bool(NOT_ROOT) and shutil.which("setpriv") is None, reason="root without setpriv")
def test_a_read_only_directory_serves_reads_and_stops_writes(tmp_path):
    root = tmp_path / "ro"
    try:
        tier = DiskTier(root, 1 << 20)
        tier.put([(KEY.format(0), value(0))])
        for path in [root, *root.iterdir()]:
            path.chmod(0o555)
        out = run_child(
            {"root": str(root), "capacity": 1 << 20, "read": [KEY.format(0)], "write": [["k", "v"]]}, NOT_ROOT
        )
        assert out["read"] == [value(0).decode()] and out["written"] == 0, out
        assert out["health"] == ["degraded", f"{root} is read-only: writes stopped"], out
        assert out["counters"]["write_failures"] == 1
    finally:
        for path in [root, *root.iterdir()]:
            path.chmod(0o755)


def test_a_directory_deleted_under_the_tier_is_a_miss_then_recreated(tmp_path):
    root = tmp_path / "cache"
    tier = DiskTier(root, 1 << 20)
    tier.put([(KEY.format(0), value(0))])
    shutil.rmtree(root)
    assert tier.get([KEY.format(0)], [5000]) == [None]
    assert tier.health().state == "down"
    assert tier.put([(KEY.format(1), value(1))]) > 0
    assert tier.health().state == "ok" and tier.used_bytes() == only_file(root).stat().st_size
    # Gone and not recreatable (a file took its place): degraded, reads are misses, nothing raises.
    shutil.rmtree(root)
    root.write_bytes(b"")
    assert tier.put([(KEY.format(2), value(2))]) == 0
    assert tier.get([KEY.format(1)], [5000]) == [None]
    assert tier.health().state == "down" and tier.counters()["write_failures"] >= 1


def test_two_processes_share_one_directory(tmp_path):
    """Each writes its own records and reads the other's; the size bound holds across both (each
    rescans before writing here), and a record the other deleted is a miss, not an error."""
    size = FRAME.size + len("p0:0000") + 5000
    capacity = 20 * size
    write = {p: [[f"{p}:{i:04d}", f"{p}{i}".ljust(5000, ".")] for i in range(30)] for p in ("a", "b")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LOOP, str(tmp_path), str(capacity), p],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
        )
        for p in ("a", "b")
    ]
    results = [proc.communicate(timeout=120) for proc in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
        assert out.strip() == "ok", out + err
    total = sum(p.stat().st_size for p in record_files(tmp_path))
    assert total <= capacity + 2 * size  # each may overshoot by the record it is writing
    tier = DiskTier(tmp_path, capacity)
    assert tier.used_bytes() == total
    found = tier.get([k for p in "ab" for k, _ in write[p]], [1 << 20] * 60)
    assert all(
        v is None or v.decode() == dict(write["a"] + write["b"])[k]
        for k, v in zip([k for p in "ab" for k, _ in write[p]], found)
    )
    assert tier.counters()["damaged_deleted"] == 0


# Process `me` writes its 30 records over and over while reading the other's: every read is either
# a miss or the other's exact value (renames are atomic), never an error or a torn value.
LOOP = textwrap.dedent(
    """
    import sys
    from kvblocks.spill.disk import DiskTier
    root, capacity, me = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    other = "b" if me == "a" else "a"
    tier = DiskTier(root, capacity, rescan_interval_s=0.0)
    mine = [(f"{me}:{i:04d}", f"{me}{i}".ljust(5000, ".").encode()) for i in range(30)]
    theirs = {f"{other}:{i:04d}": f"{other}{i}".ljust(5000, ".").encode() for i in range(30)}
    seen = 0
    for round in range(15):
        for item in mine:
            tier.put([item])
        got = tier.get(list(theirs), [1 << 20] * 30)
        for key, v in zip(theirs, got):
            assert v is None or v == theirs[key], (key, v[:20])
            seen += v is not None
        tier.delete([mine[round][0]])
    c = tier.counters()
    assert c["damaged_deleted"] == 0, c
    assert seen > 0, "never saw the other process's records"
    print("ok")
    """
)


def test_eviction_hands_whole_records_to_the_tier_below(tmp_path):
    size = FRAME.size + len(KEY.format(0)) + 1000
    tier = DiskTier(tmp_path, 2 * size)
    demoted: list[tuple[str, bytes]] = []
    tier.bind_demote(demoted.extend)
    for i in range(3):
        tier.put([(KEY.format(i), value(i))])
    assert demoted == [(KEY.format(0), value(0))]
    damage_flip_frame(only_by_key(tmp_path, tier, KEY.format(1)), tmp_path)
    tier.put([(KEY.format(3), value(3))])  # evicts 1, whose file is damaged: nothing goes down
    assert demoted == [(KEY.format(0), value(0))] and tier.counters()["evictions"] == 2


def test_records_are_readable_by_their_owner_only(tmp_path):
    root = tmp_path / "cache"
    DiskTier(root, 1 << 20).put([(KEY.format(0), value(0))])
    path = only_file(root)
    assert [p.stat().st_mode & 0o777 for p in (root, path.parent, path)] == [0o700, 0o700, 0o600]


def test_a_slow_read_is_cut_at_the_budget_and_the_run_read_so_far_is_kept(tmp_path, monkeypatch):
    keys = [KEY.format(i) for i in range(4)]
    DiskTier(tmp_path, 1 << 20).put([(k, value(i)) for i, k in enumerate(keys)])
    tier = DiskTier(tmp_path, 1 << 20, read_budget_s=0.05)
    assert tier.get(keys, [2000] * 4) == [value(i) for i in range(4)]  # a quick disk: the whole run
    read = tier._read

    def slow(*args):  # a disk that takes 30 ms a file
        time.sleep(0.03)
        return read(*args)

    monkeypatch.setattr(tier, "_read", slow)
    out = tier.get(keys, [2000] * 4)
    assert out[:2] == [value(0), value(1)] and out[2:] == [None, None]  # 60 ms > 50 ms: cut after two
    assert tier.counters()["read_budget_cuts"] == 1
    assert len(record_files(tmp_path)) == 4  # cut records stay: they are not damaged


def test_a_hit_reorders_in_memory_and_its_mtime_is_written_lazily_first_chunk_latest(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, touch_interval_s=3600.0)
    keys = [KEY.format(i) for i in range(3)]
    tier.put([(k, value(i)) for i, k in enumerate(keys)])
    paths = [tier.path(k) for k in keys]
    for i, path in enumerate(paths):
        os.utime(path, (1000 + i, 1000 + i))
    assert tier.get(keys[:2], [5000, 5000]) == [value(0), value(1)]
    assert [p.stat().st_mtime for p in paths] == [1000, 1001, 1002]  # the read path wrote nothing
    assert list(tier.index.lru)[-2:] == [tier.path(k).stem for k in (keys[1], keys[0])]
    tier.close()
    m0, m1, m2 = (p.stat().st_mtime_ns for p in paths)
    assert m0 > m1 > 1002 * 10**9 and m2 == 1002 * 10**9  # a run's first chunk ends the most recent
    eager = DiskTier(tmp_path, 1 << 20, touch_interval_s=0.0)
    eager.get([keys[2]], [5000])
    assert paths[2].stat().st_mtime_ns > m0  # past the interval, the next hit writes them
