"""`kvblocks serve --disk-cache DIR` over real HTTP with the openai SDK: a restart (clean or `kill -9`)
keeps the cache warm, another model or secret never reads the records, and damaged files, a full
disk or a read-only directory cost hits, never an answer or the server."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

import msgpack
import openai
import pytest
from server_proc import ServerProcess, start_server, stop_cleanly, tiny_model_dir

from kvblocks.spill.disk import FRAME

SECRET_A = "disk-persistence-secret-aaaaaaaaaaaa"
SECRET_B = "disk-persistence-secret-bbbbbbbbbbbb"
CHUNK = 16
PROMPTS = [
    "Summarise the following ledger entries and name the largest one: "
    + ", ".join(f"entry {i} is {i * 37 % 101} units" for i in range(k, k + 12))
    for k in (0, 40, 80)
]


def serve(
    root: Path,
    *extra: str,
    model: Path | None = None,
    secret: str | None = None,
    command=None,
    chunk: int = CHUNK,
) -> ServerProcess:
    args = [
        "--model",
        str(model or tiny_model_dir()),
        "--disk-cache",
        str(root),
        "--disk-cache-size",
        "64MiB",
    ]
    args += ["--redis-chunk-tokens", str(chunk), *extra]
    env = {"KVBLOCKS_REDIS_SECRET": secret} if secret else {}
    return start_server(*args, env=env, command=command)


def ask(server: ServerProcess, prompt: str) -> tuple[str, int]:
    """(reply, cached prompt tokens) of a greedy chat completion."""
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120) as client:
        r = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=8,
            temperature=0,
        )
    details = r.usage.prompt_tokens_details
    return r.choices[0].message.content, (details.cached_tokens if details else 0)


def records(root: Path) -> list[Path]:
    return sorted(root.glob("??/*.kvb"))


def wait_for_records(root: Path, at_least: int, timeout: float = 30.0) -> list[Path]:
    """The writer thread writes behind the reply: wait until the files are there and stable."""
    deadline = time.monotonic() + timeout
    seen = -1
    while time.monotonic() < deadline:
        found = records(root)
        if len(found) >= at_least and len(found) == seen:
            return found
        seen = len(found)
        time.sleep(0.5)
    raise AssertionError(f"{len(records(root))} records under {root} after {timeout:g} s, wanted {at_least}")


def test_a_restarted_server_answers_its_first_repeat_from_the_disk(tmp_path):
    root = tmp_path / "cache"
    first = serve(root)
    reply, cached = ask(first, PROMPTS[0])
    assert cached == 0
    wait_for_records(root, 2)
    stop_cleanly(first)
    second = serve(root)
    try:
        again, cached = ask(second, PROMPTS[0])
        assert cached >= CHUNK and again == reply, (cached, again, reply)
    finally:
        stop_cleanly(second)


def test_stats_counts_a_restore_from_the_disk_as_a_spill_hit_of_that_tier(tmp_path, capsys, monkeypatch):
    from kvblocks.cli.commands import main

    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("KVBLOCKS_API_KEY", raising=False)
    server = serve(tmp_path / "cache")
    try:
        ask(server, PROMPTS[0])
        wait_for_records(tmp_path / "cache", 2)
        with server.client() as http:  # the device forgets; the disk tier keeps the records
            assert http.post("/flush_cache").status_code == 200
            _, cached = ask(server, PROMPTS[0])
            cache = http.get("/v1/cache/stats").json()["cache"]
        assert main(["stats", "--url", server.url]) == 0
        out = capsys.readouterr().out
    finally:
        stop_cleanly(server)
    assert cached >= CHUNK and cache["spill_hit_tokens"] == cache["disk_hit_tokens"] == cached
    rows = dict(
        (cells[1].strip(), cells[2].strip())
        for line in out.splitlines()
        if len(cells := line.split("│")) == 4
    )
    rate = f"{cached / cache['queried_tokens']:.1%}"
    assert rows["hit rate, spill tiers"] == rows["restored from disk"] == rate
    assert not any("redis" in label for label in rows)  # no Redis tier here, and none is named


def test_after_kill_9_the_restarted_server_still_hits_with_the_same_output(tmp_path):
    root = tmp_path / "cache"
    first = serve(root)
    replies = [ask(first, p)[0] for p in PROMPTS[:2]]
    wait_for_records(root, 4)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    first.stop()
    second = serve(root)
    try:
        for prompt, reply in zip(PROMPTS[:2], replies):
            again, cached = ask(second, prompt)
            assert cached >= CHUNK and again == reply, (cached, again, reply)
    finally:
        stop_cleanly(second)
    assert not list(root.glob("??/.*.tmp"))  # no temporary file outlives its writer's restart


def test_another_model_or_secret_never_reads_the_records(tmp_path):
    root = tmp_path / "cache"
    first = serve(root, secret=SECRET_A)
    reply, _ = ask(first, PROMPTS[0])
    files = wait_for_records(root, 2)
    stop_cleanly(first)
    # Sealed: a record holds a nonce and ciphertext, never the prompt's token ids in the clear.
    data = files[0].read_bytes()
    record = msgpack.unpackb(data[FRAME.size + int.from_bytes(data[6:8], "little") :])
    assert {"nonce", "ct"} <= set(record) and "tokens" not in record
    other_model = tiny_model_dir(seed=1)
    for kwargs in ({"model": other_model, "secret": SECRET_A}, {"secret": SECRET_B}, {}):
        server = serve(root, **kwargs)
        try:
            assert ask(server, PROMPTS[0])[1] == 0, kwargs
        finally:
            stop_cleanly(server)
    # The other deployments wrote their own records beside these; the first one's still hit.
    server = serve(root, secret=SECRET_A)
    try:
        again, cached = ask(server, PROMPTS[0])
        assert cached >= CHUNK and again == reply
    finally:
        stop_cleanly(server)


def test_truncated_flipped_and_swapped_files_are_misses_never_wrong_answers(tmp_path):
    root = tmp_path / "cache"
    first = serve(root)
    replies = [ask(first, p)[0] for p in PROMPTS]
    files = wait_for_records(root, 6)
    stop_cleanly(first)
    # Every file damaged, in turn truncated, bit-flipped or replaced by another key's whole file, so
    # the first record each lookup reads is damaged.
    originals = {p: p.read_bytes() for p in files}
    for i, path in enumerate(files):
        data = bytearray(originals[path])
        if i % 3 == 0:
            data = data[:-7]
        elif i % 3 == 1:
            data[len(data) // 2] ^= 0x10
        else:
            data = bytearray(originals[files[(i + 1) % len(files)]])
        path.write_bytes(bytes(data))
    damaged = {p: p.read_bytes() for p in files}
    second = serve(root)
    try:
        for prompt, reply in zip(PROMPTS, replies):
            assert ask(second, prompt)[0] == reply
        assert second.alive()
        time.sleep(2.0)  # the writer rewrites what the misses recomputed
    finally:
        stop_cleanly(second)
    # Each prompt's first damaged record was read, refused and deleted (then written again whole).
    repaired = [p for p in files if not p.exists() or p.read_bytes() != damaged[p]]
    assert len(repaired) >= len(PROMPTS), (len(repaired), len(files))


def test_a_full_disk_costs_writes_not_answers(tmp_path):
    # The kernel refuses any file past 24 KB (RLIMIT_FSIZE): every record (64 tokens of 512 bytes) is
    # larger, the server's log is not.
    if shutil.which("prlimit") is None:
        pytest.skip("prlimit is not installed")
    root = tmp_path / "cache"
    command = ["prlimit", "--fsize=24576", sys.executable, "-m", "kvblocks.cli.commands"]
    server = serve(root, command=command, chunk=64)
    try:
        reply, cached = ask(server, PROMPTS[0])
        assert cached == 0
        time.sleep(2.0)  # the writer has met the full disk
        assert records(root) == [] and not list(root.glob("??/.*.tmp"))
        again, cached = ask(server, PROMPTS[0])  # the device pool still serves it
        assert again == reply and cached > 0
        assert ask(server, PROMPTS[1])[0]
    finally:
        stop_cleanly(server)


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None, reason="root without setpriv")
def test_a_read_only_directory_still_serves_its_records(tmp_path):
    root = tmp_path / "cache"
    first = serve(root)
    reply, _ = ask(first, PROMPTS[0])
    wait_for_records(root, 2)
    stop_cleanly(first)
    tree = [root, *root.iterdir()]
    for path in tree:
        path.chmod(0o555)
    # root ignores a directory's mode: the server runs without the capabilities that let it
    command = (
        ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner"] if os.geteuid() == 0 else []
    )
    tmp_path.chmod(0o755)
    try:
        server = serve(root, command=[*command, sys.executable, "-m", "kvblocks.cli.commands"])
        try:
            again, cached = ask(server, PROMPTS[0])
            assert cached >= CHUNK and again == reply
            assert ask(server, PROMPTS[1])[0]  # a new prompt: its writes fail, its answer does not
        finally:
            stop_cleanly(server)
    finally:
        for path in tree:
            path.chmod(0o755)
