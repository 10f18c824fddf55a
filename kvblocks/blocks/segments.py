"""Segmented prompts: explicit `Block`s whose KV may be reused at any position, and plain segments.

Block boundaries are explicit, never guessed from text: matching cached content by substring
gives accidental hits, and a block tokenised inside a longer prompt may not give its own ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

import numpy as np

from kvblocks.generate.text import PromptError

__all__ = [
    "Block",
    "BlockSpan",
    "SegmentedPrompt",
    "block_marker",
    "chat_blocks",
    "chat_segments",
    "flatten",
    "is_segmented",
    "segments_of",
]


@dataclass(slots=True, frozen=True)
class Block:
    """A reusable part of a prompt (a document, a tool output): token ids, or text the generator
    tokenises on its own (without special tokens). Its identity is its ids, not its position."""

    content: tuple[int, ...] | str

    def __init__(self, content: Sequence[int] | np.ndarray | str) -> None:
        if not isinstance(content, str):
            content = tuple(int(t) for t in np.asarray(content).reshape(-1))
        if not content:
            raise PromptError("a Block must not be empty")
        object.__setattr__(self, "content", content)


Segment = Block | str | Sequence[int]
SegmentedPrompt = Sequence[Segment]


@dataclass(slots=True, frozen=True)
class BlockSpan:
    """Where one block lands in the flattened prompt: its first `length` tokens (all of them unless
    the prompt's last token, which is always computed, cuts it) at [start, start + length)."""

    start: int
    ids: tuple[int, ...]
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


def is_segmented(prompt: object) -> TypeGuard[SegmentedPrompt]:
    """Whether `prompt` is a list of segments with at least one `Block` (anything else is a plain prompt)."""
    return isinstance(prompt, list | tuple) and any(isinstance(s, Block) for s in prompt)


def flatten(tokenizer, prompt: SegmentedPrompt) -> tuple[list[int], list[BlockSpan]]:
    """The prompt's token ids and where its blocks are. A string segment is tokenised alone, with
    special tokens (BOS) only when it opens the prompt, as a plain string prompt would be."""
    ids: list[int] = []
    spans: list[BlockSpan] = []
    for segment in prompt:
        if isinstance(segment, Block):
            block_ids = _ids(tokenizer, segment.content, special=False)
            if not block_ids:
                raise PromptError(f"a Block must not be empty (its text {segment.content!r} gives no tokens)")
            spans.append(BlockSpan(len(ids), tuple(block_ids), len(block_ids)))
            ids.extend(block_ids)
        elif isinstance(segment, str | list | tuple | np.ndarray):
            ids.extend(_ids(tokenizer, segment, special=not ids))
        else:
            raise PromptError(
                f"a prompt segment must be a Block, a string or token ids, got {type(segment).__name__}"
            )
    if not ids:
        raise PromptError("prompt is empty")
    return ids, spans


def _ids(tokenizer, content: str | Sequence[int], special: bool) -> list[int]:
    if isinstance(content, str):
        return list(tokenizer(content, add_special_tokens=special)["input_ids"])
    if not all(isinstance(t, int | np.integer) for t in content):
        raise PromptError("a token-id segment must hold ints only")
    return [int(t) for t in content]


def segments_of(ids: list[int], spans: list[BlockSpan]) -> list[list[int] | Block]:
    """`flatten`'s result as id segments again (plain runs and `Block`s), to hand on without retokenising."""
    out: list[list[int] | Block] = []
    at = 0
    for span in spans:
        if span.start > at:
            out.append(ids[at : span.start])
        out.append(Block(span.ids))
        at = span.end
    if at < len(ids):
        out.append(ids[at:])
    return out


def chat_blocks(tokenizer, messages: list[dict]) -> list[list[int] | Block]:
    """Chat `messages` rendered by the tokenizer's chat template as a segmented prompt: a content part
    `{"type": "text", "text": ..., "kvblocks_block": True}` becomes a `Block` (tokenised alone), the
    template's text around it id segments, ready for `CachedGenerator.generate` in any `kv_mode`.
    A string content, and unmarked text parts, render as usual (the server renders chat requests so)."""
    blocks: list[str] = []
    marked = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list | tuple):
            pieces = []
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                if not isinstance(text, str):
                    raise PromptError(
                        f"a content part must be a text part with a 'text' string, got {part!r}"
                    )
                if part.get("kvblocks_block"):
                    pieces.append(block_marker(len(blocks)))
                    blocks.append(text)
                else:
                    pieces.append(text)
            content = "".join(pieces)
        marked.append({**message, "content": content})
    return chat_segments(tokenizer, marked, blocks)


def chat_segments(tokenizer, messages: list[dict], blocks: list[str]) -> list[list[int] | Block]:
    """The chat template's rendering of `messages`, whose contents hold `block_marker(i)` where block
    `i` goes, as id segments: each block tokenised alone, the template's text around it as usual."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out: list[list[int] | Block] = []
    for i, block in enumerate(blocks):
        before, marker, text = text.partition(block_marker(i))
        if not marker or block_marker(i) in text:
            raise PromptError("the chat template changed a kvblocks_block part; send it as plain text")
        if before:
            out.append(list(tokenizer(before, add_special_tokens=False)["input_ids"]))
        out.append(Block(list(tokenizer(block, add_special_tokens=False)["input_ids"])))
    if text:
        out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


def block_marker(i: int) -> str:
    """What stands for block `i` in a message while the chat template renders (no template changes it)."""
    return f"\ue000kvblocks-block-{i}\ue001"
