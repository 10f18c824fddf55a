"""The `kvblocks bench blocks` workloads, generated from a seed: documents of invented facts and
questions answered by one of them (RAG, several documents per prompt in shuffled orders), and an
agent loop whose tool outputs are re-inserted at a new position every turn.

The facts are made up ("The code of Vendor Q7 is 4821"), so a model can only answer from the
prompt, and each answer is known for exact-match accuracy.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvblocks.blocks import Block

__all__ = ["Task", "agent_tasks", "rag_tasks"]

# SmolLM2's chat markers: the prompt is the template's text, written out so blocks sit inside it.
RAG_SYSTEM = (
    "<|im_start|>system\nYou answer questions using only the documents given.<|im_end|>\n"
    "<|im_start|>user\nDocuments:\n\n"
)
AGENT_SYSTEM = (
    "<|im_start|>system\nYou are an inventory agent. Tool outputs are shown as they arrive.<|im_end|>\n"
    "<|im_start|>user\nTask: audit the warehouse stock.\n\n"
)
CITIES = ("Oslo", "Lyon", "Porto", "Quito", "Dakar", "Perth", "Turin", "Hanoi", "Leeds", "Cusco")
FACTS_PER_DOC = 4


@dataclass(slots=True, frozen=True)
class Task:
    """One prompt (segments: plain text and `Block`s) and the answer it asks for."""

    kind: str
    segments: tuple[str | Block, ...]
    answer: str


def _vendor(rng: random.Random, used: set[str]) -> str:
    while True:
        name = f"{rng.choice('BCDFGHJKLMNPQRSTVWXZ')}{rng.randrange(10)}"
        if name not in used:
            used.add(name)
            return name


def _documents(rng: random.Random, count: int) -> list[tuple[str, dict[str, str]]]:
    """`count` documents, each with FACTS_PER_DOC vendors: (text, {vendor: code})."""
    used: set[str] = set()
    docs = []
    for d in range(count):
        facts = {_vendor(rng, used): str(rng.randrange(1000, 10000)) for _ in range(FACTS_PER_DOC)}
        lines = [f"Supplier register, page {d + 1}."]
        for vendor, code in facts.items():
            lines.append(
                f"Vendor {vendor} is based in {rng.choice(CITIES)} and ships every {rng.randrange(2, 9)} days. "
                f"The code of Vendor {vendor} is {code}."
            )
        docs.append(("\n".join(lines) + "\n\n", facts))
    return docs


def rag_tasks(questions: int, docs_per_prompt: int, seed: int) -> list[Task]:
    """Questions about one fact each, asked over `docs_per_prompt` documents in a shuffled order."""
    rng = random.Random(seed)
    docs = _documents(rng, max(2 * docs_per_prompt, 8))
    tasks = []
    for _ in range(questions):
        chosen = rng.sample(range(len(docs)), docs_per_prompt)
        facts = docs[chosen[0]][1]
        vendor = rng.choice(sorted(facts))
        rng.shuffle(chosen)
        question = (
            f"Question: what is the code of Vendor {vendor}?<|im_end|>\n"
            f"<|im_start|>assistant\nThe code of Vendor {vendor} is"
        )
        blocks = tuple(Block(docs[i][0]) for i in chosen)
        tasks.append(Task("rag", (RAG_SYSTEM, *blocks, question), facts[vendor]))
    return tasks


def agent_tasks(turns: int, window: int, seed: int) -> list[Task]:
    """An agent loop: turn t calls a tool whose output joins the last `window` outputs in the prompt
    (each output moves to a new offset turn after turn); the question is about one of them."""
    rng = random.Random(seed + 1)
    outputs = []
    for t in range(turns + window - 1):
        stock = {f"X{t}{k}": str(rng.randrange(100, 1000)) for k in range(3)}
        lines = [f"Tool output, stock_lookup call {t + 1}:"]
        lines += [
            f"item {item}: {n} units on shelf {rng.choice('ABCDEF')}{rng.randrange(1, 9)}"
            for item, n in stock.items()
        ]
        outputs.append(("\n".join(lines) + "\n\n", stock))
    tasks = []
    for t in range(turns):
        shown = outputs[t : t + window]
        stock = shown[rng.randrange(window)][1]
        item = rng.choice(sorted(stock))
        question = (
            f"How many units of item {item} are in stock?<|im_end|>\n<|im_start|>assistant\nItem {item} has"
        )
        tasks.append(Task("agent", (AGENT_SYSTEM, *(Block(o[0]) for o in shown), question), stock[item]))
    return tasks
