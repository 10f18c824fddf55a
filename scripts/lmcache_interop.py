"""End-to-end LMCache interoperability check (run it with scripts/lmcache-interop; see docs/LMCACHE.md).

Starts a real Redis and a real `lmcache server` (CPU, Redis as its L2), then checks both ways:

A. LMCache -> kvblocks: the fleet side (scripts/lmcache_fleet.py, in lmcache's own venv) stores a
   prompt's KV through LMCache's vLLM worker client; kvblocks finds exactly LMCache's keys, reads
   the chunks back bit-exact and generates exactly what it generates without any cache.
B. kvblocks -> LMCache: kvblocks generates from another prompt (writing through to Redis); LMCache's
   scheduler lookup reports the full chunks as hits and its worker retrieve returns them bit-exact.

Prints one line per check and exits non-zero on the first failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import redis
import torch
from safetensors.torch import load_file, save_file

from kvblocks import CachedGenerator, KVCacheTrie
from kvblocks.adapters import hf
from kvblocks.adapters.lmcache import LMCacheRedisTier

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from conftest import IdTokenizer, tiny_llama  # noqa: E402
from redis_server import RedisServer, free_port  # noqa: E402

from kvblocks.launch.service import terminate  # noqa: E402

NEW_TOKENS = 16


class Failed(AssertionError):
    pass


def check(ok: bool, what: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {what}", flush=True)
    if not ok:
        raise Failed(what)


def load_model(name: str):
    """(model, tokenizer, LMCache model name) in float32 on the CPU."""
    if name == "tiny":
        return (
            tiny_llama(vocab_size=512, max_position_embeddings=4096),
            IdTokenizer(),
            "kvblocks-interop/tiny-llama",
        )
    from kvblocks import models

    model, tokenizer = models.load(None, "float32", "cpu")
    return model, tokenizer, "HuggingFaceTB/SmolLM2-135M-Instruct"  # what vLLM would serve it as


def prompt_ids(model, seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, n).tolist()


def stacked(layers: list[tuple[torch.Tensor, torch.Tensor] | None]) -> torch.Tensor:
    """hf.extract's per-layer (K, V) `[n, H, D]` -> `[layers, n, 2, H, D]`."""
    return torch.stack([torch.stack(kv, dim=1) for kv in layers]).contiguous()


def reference_kv(model, ids: list[int]) -> torch.Tensor:
    """The prompt's KV from one plain forward pass (what a vLLM worker would have computed)."""
    with torch.inference_mode():
        past = model(torch.tensor([ids]), use_cache=True).past_key_values
    return stacked(hf.extract(past, hf.describe_layers(model), 0, len(ids)))


class LMCacheServer:
    """`lmcache server` on CPU with the Redis at `redis_port` as its only L2."""

    def __init__(self, lmcache_bin: Path, redis_port: int, chunk_tokens: int, log: Path) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        l2 = {"type": "resp", "host": "127.0.0.1", "port": redis_port, "num_workers": 2}
        cmd = [
            str(lmcache_bin), "server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
            "--chunk-size", str(chunk_tokens),
            "--l1-size-gb", "0.5", "--no-l1-use-lazy",
            "--supported-transfer-mode", "engine_driven",
            "--eviction-policy", "LRU",
            "--l2-adapter", json.dumps(l2),
        ]  # fmt: skip
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=lmcache_env())

    def wait_ready(self, timeout_s: float = 180.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise Failed(f"lmcache server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/config", timeout=1) as r:
                    return json.load(r)["mp"]
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        raise Failed(f"lmcache server not ready after {timeout_s:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        terminate(self.proc, 20.0)
        self.log.close()


def lmcache_env() -> dict[str, str]:
    return os.environ | {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"}


def fleet(python: Path, command: str, server: LMCacheServer, args, kv: Path, out: Path | None = None) -> dict:
    """Run scripts/lmcache_fleet.py in lmcache's venv; its last stdout line is a JSON result."""
    cmd = [str(python), str(ROOT / "scripts" / "lmcache_fleet.py"), command, "--server", server.url]
    cmd += ["--model-name", args.model_name, "--chunk-tokens", str(args.chunk_tokens), "--kv", str(kv)]
    cmd += ["--out", str(out)] if out is not None else []
    done = subprocess.run(cmd, capture_output=True, text=True, env=lmcache_env(), timeout=300)
    if done.returncode != 0:
        raise Failed(f"lmcache_fleet.py {command} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def wait_for_keys(client: redis.Redis, pattern: str, count: int, timeout_s: float = 60.0) -> set[str]:
    """LMCache writes L2 in the background after acknowledging a store."""
    deadline = time.monotonic() + timeout_s
    keys: set[str] = set()
    while time.monotonic() < deadline:
        keys = {k.decode() for k in client.scan_iter(match=pattern)}
        if len(keys) >= count:
            break
        time.sleep(0.2)
    return keys


def lmcache_to_kvblocks(model, tok, args, server, redis_server, work: Path) -> None:
    c = args.chunk_tokens
    ids = prompt_ids(model, 1, 2 * c + c // 2 + 3)
    full = len(ids) // c * c
    kv = reference_kv(model, ids)
    save_file({"token_ids": torch.tensor(ids), "kv": kv}, work / "a.safetensors")
    stored = fleet(args.lmcache_python, "store", server, args, work / "a.safetensors")
    check(
        stored["stored_tokens"] == full, f"A: LMCache stored {stored['stored_tokens']} of {len(ids)} tokens"
    )

    tier = LMCacheRedisTier(
        redis_server.url, model_name=args.model_name, chunk_tokens=c, redis_is_trusted=True
    )
    cache = KVCacheTrie.for_model(model, capacity_tokens=4 * len(ids), spill=tier)
    ns = cache.namespace.key
    expected = {tier.key(ns, h) for h in tier.codec.chunk_hashes(ns, np.array(ids), c)}
    found = wait_for_keys(redis_server.client(), f"{args.model_name}@*", len(expected))
    check(
        found == expected, f"A: Redis holds exactly the {len(expected)} keys kvblocks computes for the prompt"
    )

    with cache.match(ids) as hit:
        check(hit.length == full, f"A: kvblocks matched {hit.length} tokens from LMCache's chunks")
        got = stacked(hf.extract(hit.to_hf_cache(), cache.specs, 0, hit.length))
    check(torch.equal(got.view(torch.uint8), kv[:, :full].view(torch.uint8)), "A: KV read back is bit-exact")
    cache.close()

    plain = CachedGenerator(model, tok, None).generate(ids, max_new_tokens=NEW_TOKENS)
    tier = LMCacheRedisTier(
        redis_server.url, model_name=args.model_name, chunk_tokens=c, redis_is_trusted=True
    )
    cache = KVCacheTrie.for_model(model, capacity_tokens=4 * len(ids), spill=tier)
    cached = CachedGenerator(model, tok, cache).generate(ids, max_new_tokens=NEW_TOKENS)
    stats = cache.stats()
    cache.close()
    check(
        stats["spill_hit_tokens"] == full, f"A: generation took {stats['spill_hit_tokens']} tokens from Redis"
    )
    check(cached.token_ids == plain.token_ids, f"A: {NEW_TOKENS} greedy tokens equal the no-cache run")


def kvblocks_to_lmcache(model, tok, args, server, redis_server, work: Path) -> None:
    c = args.chunk_tokens
    ids = prompt_ids(model, 2, 2 * c + c // 2 + 5)
    full = len(ids) // c * c
    tier = LMCacheRedisTier(
        redis_server.url, model_name=args.model_name, chunk_tokens=c, redis_is_trusted=True
    )
    cache = KVCacheTrie.for_model(model, capacity_tokens=4 * len(ids), spill=tier)
    CachedGenerator(model, tok, cache).generate(ids, max_new_tokens=NEW_TOKENS)
    check(tier.flush(60.0), "B: kvblocks' background writes finished")
    with cache.match(ids) as hit:
        written = stacked(hf.extract(hit.to_hf_cache(), cache.specs, 0, full))
    written_chunks = cache.stats()["redis_written_chunks"]
    cache.close()
    check(written_chunks >= full // c, f"B: kvblocks wrote {written_chunks} chunks in LMCache's format")

    save_file({"token_ids": torch.tensor(ids), "kv": written}, work / "b.safetensors")
    loaded = fleet(
        args.lmcache_python, "load", server, args, work / "b.safetensors", work / "b-loaded.safetensors"
    )
    check(loaded["hit_tokens"] == full, f"B: LMCache lookup reports {loaded['hit_tokens']} hit tokens")
    check(not loaded["load_error_blocks"], "B: LMCache retrieve reports no load errors")
    got = load_file(work / "b-loaded.safetensors")["kv"]
    check(torch.equal(got.view(torch.uint8), written.view(torch.uint8)), "B: KV LMCache returns is bit-exact")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lmcache-python", type=Path, required=True, help="python of a venv with lmcache")
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="LMCache's --chunk-size")
    args = parser.parse_args()
    torch.set_num_threads(1)
    version = subprocess.run(
        [str(args.lmcache_python), "-c", "import importlib.metadata as m; print(m.version('lmcache'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    model, tok, args.model_name = load_model(args.model)
    print(f"lmcache {version}, model {args.model_name}, chunk {args.chunk_tokens} tokens, float32 on CPU")
    with tempfile.TemporaryDirectory(prefix="kvblocks-lmcache-") as tmp:
        work = Path(tmp)
        redis_server = RedisServer(work / "redis").start()
        server = LMCacheServer(
            args.lmcache_python.parent / "lmcache", redis_server.port, args.chunk_tokens, work / "lmcache.log"
        )
        try:
            config = server.wait_ready()
            check(config["hash_algorithm"] == "blake3", "lmcache server is up, hashing with blake3")
            lmcache_to_kvblocks(model, tok, args, server, redis_server, work)
            kvblocks_to_lmcache(model, tok, args, server, redis_server, work)
        except Failed:
            print(Path(server.log.name).read_text()[-4000:], file=sys.stderr)
            return 1
        finally:
            server.stop()
            redis_server.stop()
    print("all interop checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
