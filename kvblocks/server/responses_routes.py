"""The Responses API (`/v1/responses`), what agent SDKs speak by default, on top of the chat path.

A request becomes a chat completion: `instructions` a system message, `input` items messages
(`function_call` items an assistant turn's tool calls, `function_call_output` items tool results),
`tools` chat tools, `text.format` a response_format. Planning, sampling and running are the chat
route's own; this module only translates the request in and the result out (or into Responses
stream events).

`store` (the default) keeps the conversation, with the reply, under the response's id for the
caller's tenant (bounded, expiring, in `ResponseStore`). A follow-up naming it in
`previous_response_id` renders that conversation again before its own input, so its prompt
begins with the tokens the first request prefilled and generated: a trie hit by construction.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from kvblocks.generate.generator import GenerationResult
from kvblocks.server.cost import check_input_items
from kvblocks.server.errors import APIError, parse_request, validate
from kvblocks.server.openai_routes import (
    Branch,
    Call,
    bounded_plan_chat,
    budget,
    cancel_all,
    chat_choice,
    check_model,
    check_params,
    gather,
    keep_prefix,
    sampling,
    submit_all,
    usage,
)
from kvblocks.server.openapi import answers, json_body
from kvblocks.server.response_store import ResponseStore, as_json
from kvblocks.server.schemas import (
    RESPONSES_ACCEPTED_DEFAULTS,
    RESPONSES_REFUSED,
    ChatCompletionRequest,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    ResponsesRequest,
)
from kvblocks.server.state import Served, scope_of, served
from kvblocks.server.streams import ChoiceStream, EventStream

router = APIRouter()
ECHOED = {"instructions", "metadata", "tools", "text", "user"}  # request fields a response repeats


def store_of(request: Request) -> ResponseStore:
    return served(request).response_store()


# ---- routes ----------------------------------------------------------------------------------


@router.post(
    "/v1/responses",
    openapi_extra=json_body(ResponsesRequest),
    responses=answers(400, 404, 429, 500, stream=True),
)
async def create_response(request: Request):
    s = served(request)
    body = await parse_request(
        request, ResponsesRequest, s.config.lenient, RESPONSES_REFUSED, RESPONSES_ACCEPTED_DEFAULTS
    )
    check_model(s, body.model)
    items = input_count(s, body)
    salt = scope_of(request, None)
    history = (
        store_of(request).get(salt.tenant, body.previous_response_id).messages
        if body.previous_response_id
        else []
    )
    conversation = history + input_messages(body)
    if body.store:  # what its entry holds before any output (the response echoes these): over budget, a 400
        echoed = body.model_dump(include=ECHOED, by_alias=True, exclude_none=True)
        store_of(request).check_fits(len(as_json(conversation)) + len(as_json(echoed)))
    chat = as_chat(body, conversation, s.config.lenient)
    plan = await bounded_plan_chat(s, chat, "text.format", tenant=salt.tenant, param="input", items=items)
    params = sampling(s, chat, budget(s, plan.ids, body.max_output_tokens))
    params = replace(params, constraint=plan.constraint_within(params.max_new_tokens))
    check_params(s, params)
    call = Call(request, "resp", chat=True, plan=plan, salt=salt)
    call.id = f"resp_{uuid.uuid4().hex}"
    branch = Branch(0, plan.ids, params)
    if body.stream:
        running = submit_all(s, call, [branch])
        return StreamingResponse(
            events(s, call, branch, running, body, conversation),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(cancel_all, running),
        )
    (result,) = await gather(s, call, [branch])
    return finish(s, call, branch, result, body, conversation)


@router.get("/v1/responses/{response_id}", responses=answers(404))
async def get_response(response_id: str, request: Request):
    return store_of(request).get(scope_of(request, None).tenant, response_id).response


@router.get("/v1/responses/{response_id}/input_items", responses=answers(400, 404))
async def list_input_items(
    response_id: str,
    request: Request,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
    include: Annotated[list[str] | None, Query()] = None,
):
    """What went into a stored response, earlier turns' inputs and outputs first (OpenAI's list:
    newest first by default, `after` an item id to page from)."""
    if include:
        raise APIError(400, "no extra input item fields can be included here", param="include")
    stored = store_of(request).get(scope_of(request, None).tenant, response_id)
    items = input_items(stored.messages[:-1], response_id.removeprefix("resp_"))
    items = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        start = next((k + 1 for k, item in enumerate(items) if item["id"] == after), None)
        if start is None:
            raise APIError(400, f"response '{response_id}' has no input item '{after}'", param="after")
    page = items[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(items),
    }


@router.delete("/v1/responses/{response_id}", responses=answers(404))
async def delete_response(response_id: str, request: Request):
    store_of(request).delete(scope_of(request, None).tenant, response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


# ---- translating in --------------------------------------------------------------------------


def input_count(s: Served, body: ResponsesRequest) -> int:
    """The request's input items, refused beyond the server's caps before they are translated."""
    if isinstance(body.input, str):
        return 1
    contents = [
        item.output if isinstance(item, FunctionCallOutputItem) else getattr(item, "content", "")
        for item in body.input
    ]
    parts = sum(len(c) for c in contents if isinstance(c, list))
    check_input_items(s.config.caps, len(body.input), parts)
    return len(body.input)


def input_messages(body: ResponsesRequest) -> list[dict]:
    """`input` as chat messages; consecutive function calls join one assistant turn."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict] = []
    for item in body.input:
        if isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        else:
            out.append({"role": item.role, "content": item.text()})
    return out


def as_chat(body: ResponsesRequest, conversation: list[dict], lenient: bool) -> ChatCompletionRequest:
    """The chat completion this request asks for; `instructions` apply to this turn only."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fmt = body.text.format if body.text is not None else None
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    chat = {
        "messages": system + conversation,
        "tools": [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
            for t in body.tools or []
        ]
        or None,
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "temperature": body.temperature,
        "top_p": body.top_p,
    }
    if chat["tool_choice"] is not None and not chat["tools"]:
        raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
    if fmt is not None and fmt.type == "json_schema":
        spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {k: v for k, v in spec.items() if v is not None},
        }
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    return validate(ChatCompletionRequest, {k: v for k, v in chat.items() if v is not None}, lenient)


# ---- translating out -------------------------------------------------------------------------


def input_items(messages: list[dict], tag: str) -> list[dict]:
    """Chat messages as the Responses items they came from: a message item per message (an
    assistant turn's text, when it has some), a function_call per tool call, a
    function_call_output per tool result. Ids are derived from the response (`tag`) and the
    position, so pagination by `after` sees the same ids on every read."""
    out: list[dict] = []
    for k, m in enumerate(messages):
        if m["role"] == "tool":
            out.append(
                {
                    "type": "function_call_output",
                    "id": f"fco_{tag}_{k}",
                    "call_id": m["tool_call_id"],
                    "output": m["content"],
                    "status": "completed",
                }
            )
            continue
        if m.get("content") or not m.get("tool_calls"):
            kind = "output_text" if m["role"] == "assistant" else "input_text"
            part = {"type": kind, "text": m.get("content") or ""}
            out.append(
                {
                    "type": "message",
                    "id": f"msg_{tag}_{k}",
                    "role": m["role"],
                    "status": "completed",
                    "content": [part],
                }
            )
        for j, c in enumerate(m.get("tool_calls") or []):
            fn = c["function"]
            out.append(call_item(f"fc_{tag}_{k}_{j}", c["id"], fn["name"], fn["arguments"], "completed"))
    return out


def output_items(call: Call, choice: dict) -> list[dict]:
    """The chat choice's message as Responses output items: a message, then one item per call."""
    message, items = choice["message"], []
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    if message.get("content"):
        items.append(message_item(f"msg_{call.id[5:]}", message["content"], status))
    for c in message.get("tool_calls") or []:
        fn = c["function"]
        items.append(call_item(f"fc_{c['id']}", c["id"], fn["name"], fn["arguments"], "completed"))
    return items


def message_item(item_id: str, text: str, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": [part]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_object(
    s: Served,
    call: Call,
    body: ResponsesRequest,
    status: str,
    output: list[dict],
    result: GenerationResult | None,
) -> dict:
    fmt = (
        body.text.format.model_dump(by_alias=True, exclude_none=True)
        if body.text and body.text.format
        else {"type": "text"}
    )
    out = {
        "id": call.id,
        "object": "response",
        "created_at": call.created,
        "status": status,
        "model": s.config.model_name,
        **s.config.labels(),
        "output": output,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "metadata": body.metadata or {},
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "tool_choice": body.tool_choice.model_dump()
        if body.tool_choice and not isinstance(body.tool_choice, str)
        else (body.tool_choice or "auto"),
        "parallel_tool_calls": bool(body.parallel_tool_calls),
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "store": bool(body.store),
        "text": {"format": fmt},
        "truncation": "disabled",
        "reasoning": None,
        "user": body.user,
        "usage": None,
    }
    if result is not None:
        u = usage([result])
        out["usage"] = {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"],
        }
    return out


def finish(
    s: Served,
    call: Call,
    branch: Branch,
    result: GenerationResult,
    body: ResponsesRequest,
    conversation: list[dict],
    call_ids: list[str] = (),
) -> dict:
    """The final response object, stored with the conversation when `store`; `call_ids` are the
    ids a stream already gave its calls."""
    choice = chat_choice(s, call, branch, result)
    for c, call_id in zip(choice["message"].get("tool_calls") or [], call_ids):
        c["id"] = call_id
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    response = response_object(s, call, body, status, output_items(call, choice), result)
    if body.store:
        reply = {k: v for k, v in choice["message"].items() if v is not None}
        if reply.get("content") is None and not reply.get("tool_calls"):
            reply["content"] = ""
        messages = [*conversation, reply]
        if not store_of(call.request).put(call.salt.tenant, call.id, messages, response):
            response["store"] = False  # larger than the tenant's budget: said, counted and logged
    return response


# ---- streaming -------------------------------------------------------------------------------


async def events(
    s: Served, call: Call, branch: Branch, running: list, body: ResponsesRequest, conversation: list[dict]
) -> AsyncIterator[str]:
    """The Responses stream: created, then each output item opened, filled by deltas and closed
    as the text arrives, then completed (or incomplete) with the same response object a
    non-streamed request returns."""
    event = EventStream().event
    choice = ChoiceStream(call.plan.parser)
    opened: dict[str, int] = {}  # item id -> output_index
    msg_id, text = f"msg_{call.id[5:]}", ""
    calls: dict[int, dict] = {}  # streamed call index -> its item
    try:
        yield event("response.created", {"response": response_object(s, call, body, "in_progress", [], None)})
        yield event(
            "response.in_progress", {"response": response_object(s, call, body, "in_progress", [], None)}
        )
        result = None
        async for piece in running[0].events():
            added = choice.feed(piece)
            content, deltas = added.text, added.calls
            if content:
                if msg_id not in opened:
                    opened[msg_id] = len(opened)
                    item = message_item(msg_id, "", "in_progress") | {"content": []}
                    yield event("response.output_item.added", {"output_index": opened[msg_id], "item": item})
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    yield event(
                        "response.content_part.added",
                        {"item_id": msg_id, "output_index": opened[msg_id], "content_index": 0, "part": part},
                    )
                text += content
                yield event(
                    "response.output_text.delta",
                    {
                        "item_id": msg_id,
                        "output_index": opened[msg_id],
                        "content_index": 0,
                        "delta": content,
                        "logprobs": [],
                    },
                )
            for d in deltas:
                if d["index"] not in calls:
                    cid = d.get("id") or f"call_{uuid.uuid4().hex[:24]}"
                    item = call_item(f"fc_{cid}", cid, d["function"]["name"], "", "in_progress")
                    calls[d["index"]] = item
                    opened[item["id"]] = len(opened)
                    yield event(
                        "response.output_item.added", {"output_index": opened[item["id"]], "item": item}
                    )
                item = calls[d["index"]]
                fragment = d["function"].get("arguments", "")
                if fragment:
                    item["arguments"] += fragment
                    yield event(
                        "response.function_call_arguments.delta",
                        {"item_id": item["id"], "output_index": opened[item["id"]], "delta": fragment},
                    )
            result = piece.result
        if result is None:
            return  # the client left
        keep_prefix(s, call)
        final = finish(s, call, branch, result, body, conversation, [it["call_id"] for it in calls.values()])
        status, done_items = final["status"], {item["id"]: item for item in final["output"]}
        unfinished = [it | {"status": "incomplete"} for it in calls.values() if it["id"] not in done_items]
        if unfinished:  # the cut left a streamed call unfinished: the response still lists it
            done_items |= {it["id"]: it for it in unfinished}
            final["output"] = sorted(done_items.values(), key=lambda it: opened.get(it["id"], len(opened)))
        if msg_id in opened:
            where = {"item_id": msg_id, "output_index": opened[msg_id], "content_index": 0}
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            yield event("response.output_text.done", where | {"text": text, "logprobs": []})
            yield event("response.content_part.done", where | {"part": part})
            item = message_item(msg_id, text, status)
            yield event("response.output_item.done", {"output_index": opened[msg_id], "item": item})
        for streamed in calls.values():
            item = done_items[streamed["id"]]
            where = {"item_id": item["id"], "output_index": opened[item["id"]]}
            args = {"name": item["name"], "arguments": item["arguments"]}
            yield event("response.function_call_arguments.done", where | args)
            yield event("response.output_item.done", {"output_index": opened[item["id"]], "item": item})
        yield event(f"response.{status}", {"response": final})
    except APIError as exc:
        yield event("error", {"code": exc.code, "message": exc.message, "param": exc.param})
    finally:  # no awaits here: when the client left, this runs inside a cancelled scope
        cancel_all(running)
