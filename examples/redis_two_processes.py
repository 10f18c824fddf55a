"""Two processes sharing a prefix through Redis.

Shows: a first process computes a prompt (a long system prompt and a question) and its KV is
written to Redis in the background (`RedisTier`, write-through, chunks of --chunk-tokens tokens).
A second, fresh process with an empty device cache asks the same prompt: its chunks come from
Redis, are verified and re-attached, and only the rest is prefilled. Its second request (another
question after the same system prompt) then hits the device cache. Each request prints its cached
tokens by tier; the end checks that both processes generated the same tokens.

With --secret-file (or $KVBLOCKS_REDIS_SECRET; 16+ bytes, the same for every process of a
deployment, `kvblocks serve --redis-secret-file` included) keys are keyed hashes and values are
sealed with AES-256-GCM; without it Redis is trusted (a warning says so).
Every run uses a fresh cache salt, so the first process always starts cold even when the Redis
already holds an earlier run's chunks.

Run (needs a Redis or Valkey server; default model SmolLM2-135M-Instruct, or --model PATH):

    redis-server --port 6379 --save '' &
    python examples/redis_two_processes.py --redis redis://127.0.0.1:6379/0
    head -c 32 /dev/urandom > secret && python examples/redis_two_processes.py --redis redis://127.0.0.1:6379/0 --secret-file secret

Output (abbreviated):

    process 1 (pid 14729): 'Where is my order?': 161 prompt tokens, 0 cached (0 device, 0 Redis)
    process 1: 2 chunk(s) written to Redis (sealed)
    process 2 (pid 14772): 'Where is my order?': 161 prompt tokens, 128 cached (0 device, 128 Redis)
    process 2 (pid 14772): 'How do I return a parcel?': 163 prompt tokens, 150 cached (150 device, 0 Redis)
    outputs match: yes (16 tokens: "I'm sorry for any confusion, but as a customer support agent")
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import uuid

SYSTEM_PROMPT = (
    "You are the customer support agent of ACME Parcels. Answer in one or two short sentences. "
    "Policies: parcels ship within two business days of the order. Returns are accepted within 30 "
    "days of delivery; the return label is free for members and costs 4 euros otherwise. Damaged "
    "parcels are replaced at no cost once the customer sends a photo of the damage. Express "
    "delivery costs 9 euros and arrives the next business day if ordered before noon. Customers "
    "can change the delivery address until the parcel leaves the warehouse. Refunds reach the "
    "original payment method within five business days of the return being scanned. Never "
    "promise anything these policies do not say; if unsure, offer to open a ticket."
)
QUESTIONS = ["Where is my order?", "How do I return a parcel?"]


def run_process(role: int, args: argparse.Namespace, salt: str) -> dict:
    """One process's work, in a fresh interpreter: load the model, build a cache over Redis, ask."""
    import torch

    import kvblocks
    from kvblocks import models
    from kvblocks.spill.sealing import read_secret

    torch.set_num_threads(1)
    # As `kvblocks serve` reads it: the file's bytes (whitespace stripped), else $KVBLOCKS_REDIS_SECRET
    secret = read_secret(args.secret_file)
    model, tokenizer = models.load(args.model)
    tier = kvblocks.RedisTier(args.redis, chunk_tokens=args.chunk_tokens, secret=secret)
    cache = kvblocks.KVCacheTrie.for_model(model, capacity_tokens=8192, spill=tier)
    gen = kvblocks.CachedGenerator(model, tokenizer, cache)
    results = []
    for question in QUESTIONS[:role]:  # process 1 asks one question, process 2 both
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        before = cache.stats()["spill_hit_tokens"]
        r = gen.generate(messages, max_new_tokens=args.max_tokens, temperature=0.0, salt=salt)
        from_redis = cache.stats()["spill_hit_tokens"] - before
        print(
            f"process {role} (pid {os.getpid()}): {question!r}: {r.prompt_tokens} prompt tokens, "
            f"{r.cached_tokens} cached ({r.cached_tokens - from_redis} device, {from_redis} Redis)",
            flush=True,
        )
        results.append({"token_ids": r.token_ids, "text": r.text})
    tier.flush()  # background writes done before the process ends
    written = tier.stats()["redis_written_chunks"]
    if written:
        mode = "sealed" if secret else "trusted Redis, not sealed"
        print(f"process {role}: {written} chunk(s) written to Redis ({mode})", flush=True)
    cache.close()
    return results[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", required=True, help="Redis URL, e.g. redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--secret-file",
        "--redis-secret-file",
        default=None,
        help="file holding a 16+ byte secret (default $KVBLOCKS_REDIS_SECRET, else none)",
    )
    parser.add_argument("--model", default=None, help="local model folder (default SmolLM2-135M-Instruct)")
    parser.add_argument("--chunk-tokens", type=int, default=64, help="tokens per Redis chunk")
    parser.add_argument("--max-tokens", type=int, default=16, help="reply length limit")
    args = parser.parse_args()

    salt = f"example-{uuid.uuid4().hex[:12]}"
    # "spawn" starts each process from scratch: nothing is inherited but the arguments.
    spawn = multiprocessing.get_context("spawn")
    outputs = []
    for role in (1, 2):
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
            outputs.append(pool.submit(run_process, role, args, salt).result())
    first, second = outputs
    same = first["token_ids"] == second["token_ids"]
    print(
        f"outputs match: {'yes' if same else 'NO'} "
        f"({len(first['token_ids'])} tokens: {first['text'].strip()[:60]!r})"
    )


if __name__ == "__main__":
    main()
