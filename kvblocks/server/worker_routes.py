"""Worker endpoints for routers in front of several replicas, in the formats they read.

sglang-router registers a worker through `/server_info` and `/model_info` (or their `/get_`
aliases), balances `power_of_two` on `/get_load` and fans `/flush_cache` out to every worker.
vllm-router's `cache_aware` policy asks each worker for the token ids of every request
(`/v1/chat/completions/render`, `/v1/completions/render`, `/tokenize`) and hashes those. The
render and tokenize routes therefore run the chat and completion routes' own planning code: the
ids a router hashes are exactly the ids this server prefills and its cache matches.
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool

from kvblocks import __version__
from kvblocks.generate.params import GenerationParams
from kvblocks.server import kv_blocks
from kvblocks.server.bounds import check_chars, tokenizing
from kvblocks.server.errors import APIError, parse_request
from kvblocks.server.openai_routes import (
    bounded_plan_chat,
    budget,
    check_model,
    check_params,
    encode_prompts,
    sampling,
)
from kvblocks.server.openapi import answers, json_body
from kvblocks.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvblocks.server.state import Served, caller, require_engine_view, served

router = APIRouter()


# ---- registration and load --------------------------------------------------------------------


@router.get("/server_info", responses=answers(403))
@router.get("/get_server_info", responses=answers(403))
async def server_info(request: Request):
    """sglang's server info: the model's identity plus the limits a router may schedule by."""
    require_engine_view(request)
    s = served(request)
    stats = None if s.engine.cache is None else await run_in_threadpool(s.engine.cache.stats)
    spill = None if s.engine.cache is None else s.engine.cache.spill
    return identity(s) | {
        "version": __version__,
        "dp_size": 1,
        "context_length": s.engine.max_context,
        "max_running_requests": s.engine.max_active,
        "max_total_tokens": None if stats is None else stats["capacity_tokens"],
        "prefix_cache": None
        if stats is None
        else {
            "capacity_tokens": stats["capacity_tokens"],
            "resident_tokens": stats["resident_tokens"],
            "spill_tier": None if spill is None else {"chunk_tokens": spill.chunk_tokens},
        },
    }


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request):
    s = served(request)
    info = s.engine.info
    return identity(s) | {
        "is_generation": True,
        "model_type": info.model_type,
        "architectures": list(info.architectures),
        "max_model_len": s.engine.max_context,
    }


def identity(s: Served) -> dict:
    """The name clients send as `model`, where the weights and the tokenizer were loaded from, and
    the dtype the model runs in (`--dtype auto` decides it per machine)."""
    info = s.engine.info
    return {
        "served_model_name": s.config.model_name,
        "model_path": info.path,
        "tokenizer_path": info.tokenizer_path,
        "dtype": info.dtype,
        "quantization": s.config.quantization,
    }


@router.get("/get_load", responses=answers(403))
async def get_load(request: Request):
    """sglang's load report, one entry per data-parallel rank (here one): requests running and
    waiting, and the tokens they hold (prompt plus generated so far)."""
    require_engine_view(request)
    load = served(request).engine.load()
    return [
        {
            "dp_rank": 0,
            "num_reqs": load.running + load.waiting,
            "num_running_reqs": load.running,
            "num_waiting_reqs": load.waiting,
            "num_tokens": load.tokens,
        }
    ]


@router.post("/flush_cache", responses=answers(400, 403, 503))
async def flush_cache(
    request: Request, spill: bool = False, tier: Annotated[str | None, Query(max_length=32)] = None
):
    """Admin only. Empties the device cache except what running requests hold and what is pinned;
    with `?spill=true` also deletes every record under the spill tiers' key prefix (Redis is read by
    every replica sharing it); with `?tier=NAME` (`host`, `disk`, `redis`) only that tier's records
    go, and the device cache is left as it is."""
    s = served(request)
    if not caller(request).admin:
        raise APIError(
            403, "flushing the cache needs an admin key", type_="permission_error", code="admin_only"
        )
    if s.engine.cache is None:
        raise APIError(400, "this server runs without a prefix cache")
    stack = s.engine.cache.spill
    if (spill or tier is not None) and stack is None:
        param = "spill" if tier is None else "tier"
        raise APIError(400, "this server has no spill tier to flush (it runs without --redis)", param=param)
    if tier is not None and tier not in [t.name for t in stack.tiers]:
        names = ", ".join(t.name for t in stack.tiers)
        raise APIError(400, f"this server has no spill tier named {tier!r} (it has: {names})", param="tier")
    flushed = 0 if tier is not None else await run_in_threadpool(s.engine.full_cache.clear)
    deleted = None
    if spill or tier is not None:
        try:
            deleted = await run_in_threadpool(lambda: stack.clear(tier))
        except ValueError as exc:
            raise APIError(400, str(exc), param="spill" if tier is None else "tier") from exc
        except RuntimeError as exc:
            raise APIError(503, str(exc), type_="server_error", code="spill_unavailable") from exc
    stats = await run_in_threadpool(s.engine.cache.stats)
    where = "spill" if tier is None else tier
    return {
        "message": f"flushed {flushed} tokens"
        + ("" if deleted is None else f" and {deleted} {where} records"),
        "flushed_tokens": flushed,
        "kept_tokens": stats["resident_tokens"],  # locked by running requests, or pinned
        "spill_deleted_records": deleted,
        "spill_tier": tier,
    }


# ---- token ids --------------------------------------------------------------------------------


@router.post("/tokenize", openapi_extra=json_body(TokenizeRequest), responses=answers(400, 404))
async def tokenize(request: Request):
    """vLLM's `/tokenize`. A prompt is encoded as `/v1/completions` encodes it and messages are
    rendered as `/v1/chat/completions` renders them, tools included, so a prompt those routes
    refuse (too long for the context) is refused here the same way."""
    s = served(request)
    body = await parse_request(request, TokenizeRequest, s.config.lenient)
    check_model(s, body.model)
    if body.messages is None:
        if body.add_special_tokens is False:
            check_chars(s.prompt_chars, len(body.prompt), s.engine.max_context, "prompt")
            ids = await tokenizing(
                s.tokenize_gate,
                caller(request).tenant,
                lambda: s.engine.tokenizer(body.prompt, add_special_tokens=False)["input_ids"],
            )
        else:
            ids = (await encode_prompts(s, body.prompt, caller(request).tenant))[0]
    else:
        refuse_chat_options(body)
        chat = ChatCompletionRequest(messages=body.messages, tools=body.tools)
        ids = (await bounded_plan_chat(s, chat, tenant=caller(request).tenant)).ids
    strs = s.engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": s.engine.max_context, "tokens": ids, "token_strs": strs}


def refuse_chat_options(body: TokenizeRequest) -> None:
    """Options that would give ids the chat route never prefills: refused rather than ignored."""
    if not body.add_generation_prompt or body.continue_final_message:
        raise APIError(
            400,
            "kvblocks always renders the generation prompt after the last message: "
            "'add_generation_prompt' false and 'continue_final_message' true are not supported",
            param="add_generation_prompt" if not body.add_generation_prompt else "continue_final_message",
        )
    if body.add_special_tokens:
        raise APIError(
            400, "kvblocks adds no special tokens on top of the chat template", param="add_special_tokens"
        )
    if body.chat_template is not None or body.chat_template_kwargs:
        where = "chat_template" if body.chat_template is not None else "chat_template_kwargs"
        raise APIError(
            400, f"'{where}' is not supported: kvblocks renders the model's own chat template", param=where
        )


@router.post("/detokenize", openapi_extra=json_body(DetokenizeRequest), responses=answers(400, 404))
async def detokenize(request: Request):
    s = served(request)
    body = await parse_request(request, DetokenizeRequest, s.config.lenient)
    check_model(s, body.model)
    bad = next((t for t in body.tokens if t >= s.engine.vocab_size), None)
    if bad is not None:
        raise APIError(
            400, f"token id {bad} is outside the vocabulary [0, {s.engine.vocab_size})", param="tokens"
        )
    return {"prompt": await run_in_threadpool(s.engine.tokenizer.decode, body.tokens)}


@router.post(
    "/v1/chat/completions/render", openapi_extra=json_body(ChatCompletionRequest), responses=answers(400, 404)
)
async def render_chat(request: Request):
    """vLLM's render: the request as the token ids `/v1/chat/completions` would prefill for it,
    refused with the same 4xx that route would give."""
    s = served(request)
    body = await parse_request(request, ChatCompletionRequest, s.config.lenient)
    check_model(s, body.model)
    plan = await bounded_plan_chat(s, body, tenant=caller(request).tenant)
    params = sampling(s, body, budget(s, plan.ids, body.max_completion_tokens or body.max_tokens))
    check_params(s, params)
    return generate_request(s, plan.ids, params, body)


@router.post(
    "/v1/completions/render", openapi_extra=json_body(CompletionRequest), responses=answers(400, 404)
)
async def render_completion(request: Request):
    """vLLM's render of a completion request: one entry per prompt; `prompt_blocks` are one prompt,
    their segments' ids in order (what `/v1/completions` prefills, refused by the same caps)."""
    s = served(request)
    body = await parse_request(request, CompletionRequest, s.config.lenient)
    check_model(s, body.model)
    if body.prompt_blocks is not None:
        segments = await tokenizing(
            s.tokenize_gate, caller(request).tenant, kv_blocks.completion_block_segments, s, body
        )
        prompts = [kv_blocks.flat(segments)]
    else:
        prompts = await encode_prompts(s, body.prompt, caller(request).tenant)
    rendered = []
    for ids in prompts:
        params = sampling(s, body, budget(s, ids, body.max_tokens, none_is_all=True))
        check_params(s, params)
        rendered.append(generate_request(s, ids, params, body))
    return rendered


def generate_request(s: Served, ids: list[int], params: GenerationParams, body) -> dict:
    """vLLM's `GenerateRequest`: the prompt's token ids and the sampling parameters by vLLM's names."""
    return {
        "request_id": f"render-{uuid.uuid4().hex}",
        "token_ids": ids,
        "features": None,
        "sampling_params": {
            "n": body.n or 1,
            "max_tokens": params.max_new_tokens,
            "min_tokens": params.min_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "min_p": params.min_p,
            "seed": params.seed,
            "stop": list(params.stop),
            "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty,
            "repetition_penalty": params.repetition_penalty,
            "logit_bias": params.logit_bias or None,
            "ignore_eos": params.ignore_eos,
        },
        "model": s.config.model_name,
        "stream": bool(body.stream),
        "stream_options": None if body.stream_options is None else body.stream_options.model_dump(),
        "cache_salt": body.cache_salt,
        "priority": 0,
        "kv_transfer_params": None,
    }
