"""The vLLM + LMCache side of scripts/lmcache-interop: store and load KV the way a vLLM worker does.

Runs in a virtualenv with lmcache installed (never kvblocks' own). It drives LMCache's own vLLM
client classes (`LMCacheMPSchedulerAdapter` for lookups, `LMCacheMPWorkerAdapter` for stores and
retrieves) against a running `lmcache server`, with a vLLM-style paged KV cache on the CPU:
one `[2, num_blocks, block_size, kv_heads, head_dim]` tensor per layer, block 0 left unused as
vLLM's null block.

KV files are safetensors: `token_ids` `[n]` and `kv` `[layers, n, 2, kv_heads, head_dim]`.
Each command prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid

import torch
import zmq
from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
    ParallelStrategy,
)
from safetensors.torch import load_file, save_file

BLOCK = 16
ONE_WORKER = ParallelStrategy(
    mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1, n_servers=1
)


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def paged_cache(
    layers: int, tokens: int, heads: int, dim: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    blocks = 1 + -(-tokens // BLOCK)
    return {layer_name(i): torch.zeros(2, blocks, BLOCK, heads, dim, dtype=dtype) for i in range(layers)}


def block_ids(tokens: int) -> list[int]:
    return list(range(1, 1 + -(-tokens // BLOCK)))


def worker(args) -> LMCacheMPWorkerAdapter:
    return LMCacheMPWorkerAdapter(
        server_url=args.server,
        context=zmq.Context.instance(),
        model_name=args.model_name,
        vllm_block_size=BLOCK,
        parallel_strategy=ONE_WORKER,
        mq_timeout=args.timeout,
        extra_config={"lmcache.mp.mp_transfer_mode": "engine_driven"},
    )


def wait_finished(adapter: LMCacheMPWorkerAdapter, request_id: str, store: bool, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stores, retrieves = adapter.get_finished({request_id} if store else set())
        if request_id in ((stores if store else retrieves) or ()):
            return
        time.sleep(0.01)
    raise TimeoutError(f"LMCache never reported {request_id} finished")


def store(args) -> dict:
    data = load_file(args.kv)
    ids, kv = data["token_ids"].tolist(), data["kv"]
    layers, n, _, heads, dim = kv.shape
    caches = paged_cache(layers, n, heads, dim, kv.dtype)
    for i in range(layers):
        flat = caches[layer_name(i)][:, 1:].view(2, -1, heads, dim)
        flat[:, :n] = kv[i].transpose(0, 1)
    adapter = worker(args)
    try:
        adapter.register_kv_caches(caches, layout_hints={"kv_layout": "NHD"})
        request_id = f"store-{uuid.uuid4().hex}"
        full = n - n % args.chunk_tokens
        adapter.submit_store_request(
            request_id, LoadStoreOp(token_ids=ids, block_ids=[block_ids(n)], start=0, end=full), None
        )
        wait_finished(adapter, request_id, True, args.timeout)
    finally:
        adapter.shutdown()
    return {"stored_tokens": full}


def load(args) -> dict:
    data = load_file(args.kv)
    ids, kv = data["token_ids"].tolist(), data["kv"]
    layers, n, _, heads, dim = kv.shape
    request_id = f"load-{uuid.uuid4().hex}"
    scheduler = LMCacheMPSchedulerAdapter(
        server_urls=[args.server],
        context=zmq.Context.instance(),
        model_name=args.model_name,
        vllm_block_size=BLOCK,
        parallel_strategy=ONE_WORKER,
        mq_timeout=args.timeout,
    )
    adapter = worker(args)
    caches = paged_cache(layers, n, heads, dim, kv.dtype)
    try:
        # A vLLM worker registers its KV cache at startup; lookups need the layout it declares.
        adapter.register_kv_caches(caches, layout_hints={"kv_layout": "NHD"})
        scheduler.maybe_submit_lookup_request(request_id, ids)
        deadline = time.monotonic() + args.timeout
        hit = None
        while hit is None and time.monotonic() < deadline:
            hit = scheduler.check_lookup_result(request_id)
            time.sleep(0.01)
        if not hit:
            return {"hit_tokens": hit or 0}
        adapter.submit_retrieve_request(
            request_id, LoadStoreOp(token_ids=ids, block_ids=[block_ids(n)], start=0, end=hit), None
        )
        wait_finished(adapter, request_id, False, args.timeout)
        errors = adapter.get_block_ids_with_load_errors()
        got = torch.stack(
            [
                caches[layer_name(i)][:, 1:].view(2, -1, heads, dim)[:, :hit].transpose(0, 1)
                for i in range(layers)
            ]
        )
        save_file({"token_ids": data["token_ids"][:hit], "kv": got.contiguous()}, args.out)
        return {"hit_tokens": hit, "load_error_blocks": sorted(errors)}
    finally:
        scheduler.end_session(request_id)
        scheduler.shutdown()
        adapter.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["store", "load"])
    parser.add_argument("--server", required=True, help="LMCache request server, e.g. tcp://127.0.0.1:5555")
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--chunk-tokens", type=int, required=True)
    parser.add_argument("--kv", required=True, help="token ids (and, for store, their KV)")
    parser.add_argument("--out", help="load: where to write the KV LMCache returned")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    print(json.dumps(store(args) if args.command == "store" else load(args)), flush=True)


if __name__ == "__main__":
    main()
