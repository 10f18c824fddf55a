"""`POST /v1/blocks` (kvblocks extension): store a KV block, a document, in the caller tenant's block
store ahead of the first request that uses it, so that request finds it (`kvblocks.blocks`).

The block is tokenised at the tokenising gate and bounded as a request's blocks are (its tokens
within `--max-block-tokens` and the context); its fill runs in the engine as a request of the
tenant's (queued in its line, a forward of at most the step budget per engine step, charged to
it), never on the event loop. Stored under the tenant and `cache_salt`: another tenant never finds it.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from kvblocks.blocks.report import StoredBlock
from kvblocks.engine.admission import QueueFullError
from kvblocks.generate.params import ParamError
from kvblocks.server import kv_blocks
from kvblocks.server.bounds import check_chars, tokenizing
from kvblocks.server.errors import APIError, parse_request
from kvblocks.server.openai_routes import (
    SHUTTING_DOWN,
    RetryLater,
    Submitted,
    cancel_on_disconnect,
    check_model,
    engine_failure,
    shut_down_before,
)
from kvblocks.server.openapi import answers, json_body
from kvblocks.server.schemas import StoreBlockRequest
from kvblocks.server.state import Served, scope_of, served

router = APIRouter()


@router.post("/v1/blocks", openapi_extra=json_body(StoreBlockRequest), responses=answers(400, 404, 429, 500))
async def store_block(request: Request):
    """Compute and store the block's KV (a lookup when the store holds it already); answers its
    length, how many of its tokens were computed now and whether it was stored already."""
    s = served(request)
    body = await parse_request(request, StoreBlockRequest, s.config.lenient)
    check_model(s, body.model)
    param = "text" if body.text is not None else "token_ids"
    if s.engine.encoder_decoder or s.engine.cache is None:
        why = "an encoder-decoder model" if s.engine.encoder_decoder else "a server without a prefix cache"
        raise APIError(400, f"KV blocks cannot be stored on {why}", param=param)
    try:
        s.engine.block_prefill()
    except ParamError as exc:
        raise APIError(400, str(exc), param=param) from exc
    if body.text is not None:
        check_chars(s.prompt_chars, len(body.text), s.engine.max_context, param)
    salt = scope_of(request, body.cache_salt)
    content = body.text if body.text is not None else body.token_ids
    ids = await tokenizing(s.tokenize_gate, salt.tenant, kv_blocks.block_ids, s, content, param)
    stored = await run_stored(s, request, ids, salt)
    return {
        "object": "kvblocks.block",
        "model": s.config.model_name,
        "tokens": stored.tokens,
        "computed_tokens": stored.tokens - stored.held,
        "already_stored": stored.already_stored,
    }


async def run_stored(s: Served, request: Request, ids: list[int], salt) -> StoredBlock:
    """The block's fill queued in the engine as a request of the caller's tenant; its `StoredBlock`."""
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()
    try:
        handle = s.engine.submit(
            ids,
            lambda item: loop.call_soon_threadsafe(inbox.put_nowait, item),
            tenant=salt.tenant,
            salt=salt,
            store_block=True,
        )
    except QueueFullError as exc:
        raise RetryLater(exc) from exc
    running = Submitted(handle, inbox, s.admission)
    s.admission.track(running)
    watcher = asyncio.create_task(cancel_on_disconnect(request, [running]))
    try:
        item = await inbox.get()
    finally:
        watcher.cancel()
        running.cancel()
    if item is None:  # the client went away; nobody reads this
        raise APIError(499, "client closed the request", code="client_closed_request")
    if item is SHUTTING_DOWN:
        raise shut_down_before("this block was stored")
    if isinstance(item, BaseException):
        raise engine_failure(item)
    return item
