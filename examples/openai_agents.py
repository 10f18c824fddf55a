"""Several agents on one `kvblocks serve`, through the openai client, sharing a system prompt.

Shows: `usage.prompt_tokens_details.cached_tokens` of every request. Each agent is a thread that
holds a conversation (same system prompt, its own questions) with the server. The first agent's
first request runs alone and fills the cache with the system prompt; then all agents talk at
once and find it cached, and each later turn finds its whole conversation so far cached.

Run (start the server first; any OpenAI-compatible client works the same way):

    kvblocks serve &                                   # SmolLM2-135M-Instruct on 127.0.0.1:8000
    python examples/openai_agents.py
    python examples/openai_agents.py --base-url http://127.0.0.1:8000/v1 --agents 2 --turns 1 --max-tokens 4

Output (abbreviated; lines of concurrent agents interleave):

    server model: SmolLM2-135M-Instruct
    agent 1 turn 1: 163 prompt tokens,   0 cached | 'To return a parcel, you can simply send a return a'
    agent 1 turn 2: 212 prompt tokens, 194 cached | 'The return label is free for members and costs 4 e'
    agent 2 turn 1: 162 prompt tokens, 150 cached | 'The order will ship within 2 business days of the '
    agent 3 turn 1: 164 prompt tokens, 150 cached | "If you have a damaged parcel, I'm sorry for any in"
    agent 4 turn 1: 162 prompt tokens, 151 cached | 'Express delivery is 10 euros.\\n\\nThis is a refund po'
    agent 2 turn 2: 212 prompt tokens, 193 cached | 'Yes, you can change the address anytime. You can c'
    ...
    8 requests: 1504 prompt tokens, 1231 cached (81.8%)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import threading
from dataclasses import dataclass, field

from openai import OpenAI

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


@dataclass
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, prompt_tokens: int, cached_tokens: int) -> None:
        with self.lock:
            self.requests += 1
            self.prompt_tokens += prompt_tokens
            self.cached_tokens += cached_tokens


def ask(
    client: OpenAI, model: str, max_tokens: int, agent: int, turn: int, messages: list[dict], totals: Totals
) -> None:
    """One turn of one agent: send the conversation so far, print the usage, keep the reply."""
    messages.append({"role": "user", "content": QUESTIONS[agent][turn]})
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    reply = r.choices[0].message.content or ""
    messages.append({"role": "assistant", "content": reply})
    cached = r.usage.prompt_tokens_details.cached_tokens
    print(
        f"agent {agent + 1} turn {turn + 1}: {r.usage.prompt_tokens:3d} prompt tokens, "
        f"{cached:3d} cached | {reply.strip()[:50]!r}",
        flush=True,
    )
    totals.add(r.usage.prompt_tokens, cached)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("KVBLOCKS_API_KEY", "unused"),
        help="the server's API key, if it has one (default $KVBLOCKS_API_KEY)",
    )
    parser.add_argument("--agents", type=int, default=4, help=f"concurrent agents, 1..{len(QUESTIONS)}")
    parser.add_argument("--turns", type=int, default=2, choices=(1, 2), help="turns per agent")
    parser.add_argument("--max-tokens", type=int, default=32, help="reply length limit per turn")
    args = parser.parse_args()
    if not 1 <= args.agents <= len(QUESTIONS):
        parser.error(f"--agents must be in 1..{len(QUESTIONS)}")

    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    print(f"server model: {model}")
    totals = Totals()
    conversations = [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in range(args.agents)]
    ask(client, model, args.max_tokens, 0, 0, conversations[0], totals)  # alone: it caches the system prompt

    def talk(agent: int) -> None:
        for turn in range(1 if agent == 0 else 0, args.turns):
            ask(client, model, args.max_tokens, agent, turn, conversations[agent], totals)

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.agents) as pool:
        for done in [pool.submit(talk, agent) for agent in range(args.agents)]:
            done.result()  # re-raises an agent's error here
    share = totals.cached_tokens / totals.prompt_tokens
    print(
        f"{totals.requests} requests: {totals.prompt_tokens} prompt tokens, "
        f"{totals.cached_tokens} cached ({share:.1%})"
    )
    client.close()


if __name__ == "__main__":
    main()
