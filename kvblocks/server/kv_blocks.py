"""The OpenAI routes' KV-block extension: content parts and completion segments marked as blocks,
the request's `kv_mode`, and the usage fields that say what was blended.

Chat: a text part `{"type": "text", "text": ..., "kvblocks_block": true}`. Completions:
`prompt_blocks: [{"text": ...}, {"text": ..., "block": true}, {"token_ids": [...]}]` instead of
`prompt`. A prompt with blocks is tokenised segment by segment in every mode (a block alone, the
rest around it), so `exact`, `blend` and `concat` see the same ids and differ only in reuse.
"""

from __future__ import annotations

from dataclasses import replace

from kvblocks.blocks.segments import Block, chat_blocks, flatten, segments_of
from kvblocks.generate.params import GenerationParams, ParamError
from kvblocks.generate.text import PromptError
from kvblocks.server.errors import APIError
from kvblocks.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ExplainRequest,
    PromptSegment,
)
from kvblocks.server.state import Served

Segments = list[list[int] | Block]


def has_block_parts(body: ChatCompletionRequest | ExplainRequest) -> bool:
    return any(p.kvblocks_block for m in body.messages or [] for p in m.parts())


def chat_block_segments(s: Served, body: ChatCompletionRequest, messages: list[dict]) -> Segments:
    """The rendered chat as id segments, each `kvblocks_block` part a `Block` (tools are refused: their
    rendering is not the chat template's alone)."""
    if body.tools:
        raise APIError(
            400, "kvblocks_block parts cannot be combined with tools or tool turns", param="messages"
        )
    return marked_segments(s, body.messages, messages)


def marked_segments(s: Served, chat: list[ChatMessage], messages: list[dict]) -> Segments:
    """`chat` rendered by the chat template as id segments, each `kvblocks_block` part a `Block`;
    `messages` are the same turns as the template takes them (their roles are used)."""
    if any(m.role == "tool" or m.tool_calls for m in chat):
        raise APIError(
            400, "kvblocks_block parts cannot be combined with tools or tool turns", param="messages"
        )
    check_block_count(s, sum(bool(p.kvblocks_block) for m in chat for p in m.parts()), "messages")
    turns = [
        {
            "role": raw["role"],
            "content": [p.model_dump(include={"text", "kvblocks_block"}) for p in m.parts()],
        }
        if m.parts()
        else {"role": raw["role"], "content": m.text()}
        for m, raw in zip(chat, messages)
    ]
    if not getattr(s.engine.tokenizer, "chat_template", None):
        raise APIError(
            400, "this tokenizer has no chat template; use completions with prompt_blocks", param="messages"
        )
    try:
        return checked(s, chat_blocks(s.engine.tokenizer, turns), "messages")
    except PromptError as exc:
        raise APIError(400, str(exc), param="messages") from exc


def completion_block_segments(s: Served, body: CompletionRequest | ExplainRequest) -> Segments:
    """`prompt_blocks` as id segments: text tokenised per segment (special tokens only at the start).
    Without any `block: true` segment they are a plain prompt (one id segment)."""
    check_block_count(s, sum(p.block for p in body.prompt_blocks or []), "prompt_blocks")
    try:
        ids, spans = flatten(s.engine.tokenizer, [_segment(p) for p in body.prompt_blocks or []])
    except PromptError as exc:
        raise APIError(400, str(exc), param="prompt_blocks") from exc
    return checked(s, segments_of(ids, spans), "prompt_blocks")


def _segment(p: PromptSegment) -> str | list[int] | Block:
    content = p.text if p.text is not None else list(p.token_ids or [])
    return Block(content) if p.block else content


def checked(s: Served, segments: Segments, param: str) -> Segments:
    """`segments`, once their ids fit the vocabulary and the context (the generator's own checks) and
    their blocks' tokens the server's cap (`ServerConfig.max_block_tokens`)."""
    try:
        s.engine.encode(flat(segments))
    except ValueError as exc:
        raise APIError(400, str(exc), param=param) from exc
    cap = s.config.max_block_tokens or s.engine.max_context
    tokens = sum(len(seg.content) for seg in segments if isinstance(seg, Block))
    if cap is not None and tokens > cap:
        raise APIError(
            400,
            f"the KV blocks of one request hold at most {cap} tokens together on this server "
            f"(--max-block-tokens), these hold {tokens}",
            param=param,
        )
    return segments


def block_ids(s: Served, content: str | list[int], param: str) -> list[int]:
    """A block to store ahead of use (`POST /v1/blocks`) as ids: text tokenised on its own, as in a
    prompt; within the vocabulary, the context and `ServerConfig.max_block_tokens` (`checked`)."""
    try:
        ids, _ = flatten(s.engine.tokenizer, [Block(content)])
    except PromptError as exc:
        raise APIError(400, str(exc), param=param) from exc
    checked(s, [Block(ids)], param)
    return ids


def check_block_count(s: Served, count: int, param: str) -> None:
    """Refuse more KV blocks than `ServerConfig.max_blocks`, before anything is tokenised: each block
    is a forward of its own (its fill), and a promotion or blend runs them all for one request."""
    if count > s.config.max_blocks:
        raise APIError(
            400,
            f"a request marks at most {s.config.max_blocks} KV blocks on this server (--max-blocks), "
            f"this one marks {count}",
            param=param,
        )


def has_blocks(segments: Segments) -> bool:
    return any(isinstance(seg, Block) for seg in segments)


def flat(segments: Segments) -> list[int]:
    return [t for seg in segments for t in (seg.content if isinstance(seg, Block) else seg)]


def kv_mode_of(s: Served, body, blocks: bool) -> tuple[str, float]:
    """The request's (or the server's) kv_mode and blend_recompute; a prompt without blocks is exact."""
    mode = (body.kv_mode or s.config.kv_mode) if blocks else "exact"
    return mode, s.config.blend_recompute if body.blend_recompute is None else body.blend_recompute


def with_kv_mode(s: Served, params: GenerationParams, body, blocks: bool) -> GenerationParams:
    """`params` with the request's (or the server's) kv_mode (`kv_mode_of`)."""
    mode, share = kv_mode_of(s, body, blocks)
    try:
        return replace(params, kv_mode=mode, blend_recompute=share)
    except ParamError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc


def usage_details(results) -> dict[str, int]:
    """`prompt_tokens_details` beyond `cached_tokens` (the exact prefix), absent without blocks: the
    prompt positions whose block KV was reused (`blended_tokens`) or computed through all layers
    (`recomputed_tokens`; with `cached_tokens` they add up to `prompt_tokens`), and the other tokens
    the request computed: a blend's probe over the first two layers (`probe_tokens`) and the fills
    of blocks the store did not hold (`block_fill_tokens`)."""
    reports = [r.blocks for r in results if r.blocks is not None]
    if not reports:
        return {}
    return {
        "blended_tokens": sum(b.reused_tokens for b in reports),
        "recomputed_tokens": sum(b.recomputed_tokens for b in reports),
        "probe_tokens": sum(b.probe_tokens for b in reports),
        "block_fill_tokens": sum(b.block_fill_tokens for b in reports),
    }
