"""LMCache interop: KV chunks in LMCache's Redis format, written by one side and read by the other.

Shows `kvblocks.adapters.lmcache` (docs/LMCACHE.md) against a real Redis, with no LMCache install:
the program plays the vLLM + LMCache fleet itself with the adapter's format functions.

A. fleet -> kvblocks: the "fleet" computes a prompt's KV with one plain forward pass and stores
   each full chunk as LMCache does: key `{model_name}@{kv_rank:08x}@{group}@{blake3 chain hash}`,
   value a raw `[2, layers, chunk, heads * head_dim]` tensor. A kvblocks cache over an
   `LMCacheRedisTier` then generates from that prompt: the chunks come from Redis into its trie,
   and the tokens equal a run without any cache.
B. kvblocks -> fleet: kvblocks generates from another prompt, writing its chunks through to Redis.
   The "fleet" computes the LMCache keys on its own, reads the values and unpacks them: they are
   bit-exact the KV of a plain forward pass.
C. kvblocks -> kvblocks: a second, empty kvblocks cache (another process or machine would do the
   same) generates from B's prompt and finds its full chunks in Redis.

LMCache values carry no checksum or tag, so kvblocks checks only their size and finiteness; the
tier refuses to start unless `redis_is_trusted=True` says nothing untrusted can write to Redis.
Each run starts its prompts with a random tag, so a rerun against the same Redis starts cold.

Run (needs a Redis server and blake3, the `lmcache` extra; default model SmolLM2-135M-Instruct
with LMCache's default chunk of 256 tokens; --model PATH for a local folder):

    redis-server --port 6379 --save '' &
    python examples/lmcache_interop.py --redis redis://127.0.0.1:6379/0
    python examples/lmcache_interop.py --redis redis://127.0.0.1:6379/0 --chunk-tokens 64   # quicker

Output (abbreviated):

    A: the fleet stored 2 chunks (512 of 584 tokens), e.g. key HuggingFaceTB/SmolLM2-135M-Instruct@01000100@0@c794057f...
    A: kvblocks took 512 of 584 prompt tokens from Redis into its trie (cached_tokens 512)
    A: same 16 tokens as without a cache: yes
    B: kvblocks wrote 2 chunks in LMCache's format
    B: chunk 0 at key HuggingFaceTB/SmolLM2-135M-Instruct@01000100@0@eb34bb5f...: bit-exact
    B: chunk 1 at key HuggingFaceTB/SmolLM2-135M-Instruct@01000100@0@8fdb3e52...: bit-exact
    C: a second cache found 512 of 583 prompt tokens in Redis (cached_tokens 512, 2 chunk hits)
    C: same tokens as the first cache: yes
"""

from __future__ import annotations

import argparse
import uuid

import redis
import torch

import kvblocks
from kvblocks import models
from kvblocks.adapters.lmcache import LMCacheRedisTier, chunk_hashes, from_lmcache, object_key, to_lmcache

FACTS = [
    "The warehouse in Lyon opens at seven and closes at nineteen.",
    "Parcels heavier than thirty kilograms travel by freight.",
    "Every courier scans a parcel at pickup and again at delivery.",
    "Returns are inspected within two days of arriving at the warehouse.",
    "Express parcels leave on the first truck of the morning.",
    "Customs forms are printed for every parcel leaving the union.",
]


def prompt_ids(tokenizer, tag: str, topic: str, min_tokens: int) -> list[int]:
    """Token ids of a plain-text prompt of at least `min_tokens` tokens."""
    lines = [f"[{tag}] Notes about {topic}:"]
    while True:
        ids = tokenizer(" ".join(lines), add_special_tokens=False)["input_ids"]
        if len(ids) >= min_tokens:
            return list(ids)
        lines.append(f"{len(lines)}. {FACTS[len(lines) % len(FACTS)]}")


def plain_kv(model, ids: list[int], end: int) -> list[torch.Tensor]:
    """Per-layer `[end, 2, H, D]` KV of `ids[:end]` from one plain transformers forward pass.

    transformers keeps each layer's keys and values as `[batch, heads, tokens, head_dim]`
    (`past_key_values.layers[i].keys`); LMCache's layout wants tokens first.
    """
    with torch.inference_mode():
        past = model(torch.tensor([ids]), use_cache=True).past_key_values
    return [
        torch.stack((layer.keys[0, :, :end], layer.values[0, :, :end]), dim=0).permute(2, 0, 1, 3)
        for layer in past.layers
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", required=True, help="Redis URL, e.g. redis://127.0.0.1:6379/0")
    parser.add_argument("--model", default=None, help="local model folder (default SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--model-name",
        default="HuggingFaceTB/SmolLM2-135M-Instruct",
        help="the model name in LMCache's keys: what the vLLM fleet serves as --model",
    )
    parser.add_argument("--chunk-tokens", type=int, default=256, help="the fleet's LMCache --chunk-size")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate")
    args = parser.parse_args()
    torch.set_num_threads(1)

    model, tokenizer = models.load(args.model)
    c = args.chunk_tokens
    tag = uuid.uuid4().hex[:8]
    fleet = redis.Redis.from_url(args.redis)  # the fleet's own view of Redis: plain GET and SET

    # ---- A: the fleet stores a prompt's KV; kvblocks reads it into its trie ------------------
    ids_a = prompt_ids(tokenizer, tag, "the warehouse", 2 * c + c // 4)
    hashes = chunk_hashes(ids_a, c)
    kv = plain_kv(model, ids_a, len(hashes) * c)
    keys = []
    for i, h in enumerate(hashes):
        blob = to_lmcache([layer[i * c : (i + 1) * c] for layer in kv])
        keys.append(object_key(args.model_name, h))
        # LMCache itself sets no expiry; an hour keeps this demo from leaving keys behind for good
        fleet.set(keys[-1], blob.view(torch.uint8).numpy().tobytes(), ex=3600)
    print(
        f"A: the fleet stored {len(keys)} chunks ({len(keys) * c} of {len(ids_a)} tokens), "
        f"e.g. key {keys[0][:70]}..."
    )

    tier = LMCacheRedisTier(args.redis, model_name=args.model_name, chunk_tokens=c, redis_is_trusted=True)
    cache = kvblocks.KVCacheTrie.for_model(model, capacity_tokens=8 * c, spill=tier)
    gen = kvblocks.CachedGenerator(model, tokenizer, cache)
    r = gen.generate(ids_a, max_new_tokens=args.max_tokens, temperature=0.0)
    print(
        f"A: kvblocks took {cache.stats()['spill_hit_tokens']} of {r.prompt_tokens} prompt tokens from "
        f"Redis into its trie (cached_tokens {r.cached_tokens})"
    )
    plain = kvblocks.CachedGenerator(model, tokenizer, None).generate(
        ids_a, max_new_tokens=args.max_tokens, temperature=0.0
    )
    same = plain.token_ids == r.token_ids
    print(f"A: same {len(r.token_ids)} tokens as without a cache: {'yes' if same else 'NO'}")

    # ---- B: kvblocks writes a prompt's KV; the fleet reads it back ---------------------------
    ids_b = prompt_ids(tokenizer, tag, "returns", 2 * c + c // 4)
    tier.flush()
    before = tier.stats()["redis_written_chunks"]
    r_b = gen.generate(ids_b, max_new_tokens=args.max_tokens, temperature=0.0)
    tier.flush()  # writes run in the background
    written = tier.stats()["redis_written_chunks"] - before
    print(f"B: kvblocks wrote {written} chunks in LMCache's format")
    hashes = chunk_hashes(ids_b, c)
    expected = plain_kv(model, ids_b, len(hashes) * c)
    for i, h in enumerate(hashes):
        key = object_key(args.model_name, h)
        raw = fleet.get(key)
        if raw is None:
            print(f"B: chunk {i} at key {key[:70]}...: missing")
            continue
        _, _, heads, dim = expected[0].shape
        blob = torch.frombuffer(bytearray(raw), dtype=expected[0].dtype).view(
            2, len(expected), c, heads * dim
        )
        exact = all(
            torch.equal(got, want[i * c : (i + 1) * c])
            for got, want in zip(from_lmcache(blob, heads, dim), expected)
        )
        print(f"B: chunk {i} at key {key[:70]}...: {'bit-exact' if exact else 'DIFFERENT'}")
    cache.close()  # flushes queued writes, then closes the connection

    # ---- C: a second kvblocks cache reads what the first one wrote ---------------------------
    # Another process or machine would do the same: a fresh trie over the same Redis finds B's
    # prompt there and prefills only the tokens after its last full chunk.
    tier2 = LMCacheRedisTier(args.redis, model_name=args.model_name, chunk_tokens=c, redis_is_trusted=True)
    cache2 = kvblocks.KVCacheTrie.for_model(model, capacity_tokens=8 * c, spill=tier2)
    r2 = kvblocks.CachedGenerator(model, tokenizer, cache2).generate(
        ids_b, max_new_tokens=args.max_tokens, temperature=0.0
    )
    s2 = cache2.stats()
    print(
        f"C: a second cache found {s2['spill_hit_tokens']} of {r2.prompt_tokens} prompt tokens in Redis "
        f"(cached_tokens {r2.cached_tokens}, {tier2.stats()['redis_hit_chunks']} chunk hits)"
    )
    print(f"C: same tokens as the first cache: {'yes' if r2.token_ids == r_b.token_ids else 'NO'}")
    cache2.close()
    fleet.close()


if __name__ == "__main__":
    main()
