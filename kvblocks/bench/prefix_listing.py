"""`kvblocks bench inspection`: does a large `/v1/cache/prefixes` stall the server?

A `kvblocks serve` app in a child process holds a trie of about 100k nodes (a tiny model, so the
KV fits in a few MB). The parent measures `/health` latency idle and while another client asks
for the largest prefix listing and tree the endpoint allows, back to back.
"""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time

import httpx
import numpy as np

from kvblocks.bench.harness import BenchOptions, Check, Option, Report, add_suite
from kvblocks.cli.argtypes import positive_int

PREFIXES = "/v1/cache/prefixes?limit=1000&tree=true&max_nodes=5000"


OPTIONS = (
    Option("--nodes", positive_int, 100_000, "trie nodes to build (default 100000)"),
    Option("--probes", positive_int, 400, "/health requests per phase (default 400)"),
)


def add_parser(suites: argparse._SubParsersAction) -> None:
    add_suite(
        suites,
        "inspection",
        run,
        help="/health latency while /v1/cache/prefixes lists a 100k-node trie",
        description="Server responsiveness while the cache inspection endpoints work on a large trie.",
        options=OPTIONS,
    )


def run(args: argparse.Namespace, opts: BenchOptions) -> list[Report]:
    return [bench_health_under_inspection(args.nodes, args.probes, opts)]


def serve_big_trie(port: int, nodes: int, ready) -> None:
    """Child process: a tiny model's server whose trie holds about `nodes` nodes."""
    import torch
    import uvicorn
    from transformers import AutoTokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM

    from kvblocks import CachedGenerator, KVCacheTrie, models
    from kvblocks.engine.frontend import Frontend
    from kvblocks.engine.loop import Engine
    from kvblocks.server import ServerConfig, create_app, freeze_startup_objects

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(models.default_model_dir())
    config = LlamaConfig(
        hidden_size=8, head_dim=8, num_attention_heads=1, num_key_value_heads=1, num_hidden_layers=1,
        intermediate_size=16, vocab_size=len(tokenizer),
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    cache = KVCacheTrie.for_model(model, capacity_tokens=2_000_000)
    freeze_startup_objects()  # what `kvblocks serve` does before it serves: the trie is built after
    length = 24
    kv = [(torch.randn(1, 1, length, 8), torch.randn(1, 1, length, 8))]
    past = DynamicCache(ddp_cache_data=kv, config=config)
    rng = np.random.default_rng(0)
    alphabet = np.array(tokenizer.convert_tokens_to_ids(["Ġthe", "Ġa", "Ġcat", "Ġdog"]))
    while cache.stats()["nodes"] < nodes:  # random paths over 4 words: every insert branches
        for _ in range(1000):
            cache.insert(alphabet[rng.integers(0, 4, length)], past)
    engine = Engine(CachedGenerator(model, tokenizer, cache)).start()
    app = create_app(Frontend(engine), ServerConfig("tiny"))
    ready.set()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def bench_health_under_inspection(nodes: int, probes: int, opts: BenchOptions) -> Report:
    from kvblocks.launch.ports import free_port

    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=serve_big_trie, args=(port, nodes, ready), daemon=True)
    child.start()
    try:
        if not ready.wait(timeout=600):
            raise RuntimeError("the inspection server did not build its trie in 10 minutes")
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=60) as client:
            _wait_health(client)
            stats = client.get("/v1/cache/stats").json()["cache"]
            idle = _probe(client, probes)
            listing, busy = _probe_while_listing(url, client, probes)
    finally:
        child.kill()
        child.join()
    params = {"nodes": stats["nodes"], "resident_tokens": stats["resident_tokens"], "probes": probes}
    samples = {"health idle": idle, "health during prefixes": busy}
    samples["prefixes (limit 1000, tree 5000)"] = listing
    title = "/health while /v1/cache/prefixes lists a large trie"
    report = Report("inspection-health", title, params, samples)
    p99 = float(np.percentile(busy, 99))
    report.checks.append(Check("/health p99 during prefixes", p99 * 1e3, "ms", 50.0))
    report.checks.append(Check("prefixes median", float(np.median(listing)) * 1e3, "ms"))
    report.notes.append(f"{len(listing)} listings ran while {probes} /health requests were timed")
    return report


def _wait_health(client: httpx.Client) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def _probe(client: httpx.Client, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.get("/health").raise_for_status()
        out.append(time.perf_counter() - t0)
        time.sleep(0.005)
    return out


def _probe_while_listing(url: str, client: httpx.Client, n: int) -> tuple[list[float], list[float]]:
    stop = threading.Event()
    listing: list[float] = []

    def lister() -> None:
        with httpx.Client(base_url=url, timeout=120) as other:
            while not stop.is_set():
                t0 = time.perf_counter()
                other.get(PREFIXES).raise_for_status()
                listing.append(time.perf_counter() - t0)

    thread = threading.Thread(target=lister, daemon=True)
    thread.start()
    try:
        while not listing:  # the first listing warms the tokenizer's decode path
            time.sleep(0.05)
        busy = _probe(client, n)
    finally:
        stop.set()
        thread.join()
    return listing, busy
