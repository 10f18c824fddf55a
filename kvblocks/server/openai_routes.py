"""The OpenAI API: models, chat completions and completions, streamed (SSE) or not.

A request becomes one or more engine requests (`n` choices, `best_of` candidates, several
prompts), each a `GenerationParams` plus the token ids to prefill. Choice i of a request with a
`seed` uses seed + i, so every choice can be reproduced alone. The first branch to prefill a
prompt commits its KV; the others hit it in the trie instead of prefilling it again.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import APIRouter, Request
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from kvblocks.engine.admission import QueueFullError
from kvblocks.generate import grammar, tools
from kvblocks.generate.generator import GenerationResult, Piece
from kvblocks.generate.params import ConstraintError, GenerationParams, ParamError
from kvblocks.generate.sampling import TokenLogprob
from kvblocks.server import kv_blocks
from kvblocks.server.bounds import check_chars, tokenizing
from kvblocks.server.cost import Estimate, chat_estimate
from kvblocks.server.errors import APIError, parse_request
from kvblocks.server.guard import Admission
from kvblocks.server.openapi import answers, json_body
from kvblocks.server.schemas import ChatCompletionRequest, CompletionRequest
from kvblocks.server.state import Served, caller, scope_of, served
from kvblocks.server.streams import DONE, ChoiceStream, data_event

router = APIRouter()
SEED_SPACE = 1 << 64
SHUTTING_DOWN = object()  # put in a branch's inbox by `Submitted.end`


def shut_down_before(what: str) -> APIError:
    """What a request the drain ended gets (its stream, an error event)."""
    return APIError(
        503, f"the server shut down before {what} (its --drain-timeout ran out)",
        type_="server_error", code="server_shutting_down",
    )  # fmt: skip


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [model_card(served(request))]}


@router.get("/v1/models/{model_id:path}", responses=answers(404))
async def get_model(model_id: str, request: Request):
    s = served(request)
    check_model(s, model_id)
    return model_card(s)


@router.post(
    "/v1/chat/completions",
    openapi_extra=json_body(ChatCompletionRequest),
    responses=answers(400, 404, 429, 500, stream=True),
)
async def chat_completions(request: Request):
    s = served(request)
    body = await parse_request(request, ChatCompletionRequest, s.config.lenient)
    check_model(s, body.model)
    plan = await bounded_plan_chat(s, body, tenant=caller(request).tenant)
    params = sampling(s, body, budget(s, plan.ids, body.max_completion_tokens or body.max_tokens))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    params = replace(params, logprobs=logprobs, constraint=plan.constraint_within(params.max_new_tokens))
    params = kv_blocks.with_kv_mode(s, params, body, plan.segments is not None)
    check_params(s, params)
    check_fanout(s, 1, body.n or 1)
    branches = [Branch(i, plan.ids, with_seed(params, i), segments=plan.segments) for i in range(body.n or 1)]
    call = Call(request, "chatcmpl", chat=True, plan=plan, salt=scope_of(request, body.cache_salt))
    if body.stream:
        return stream(s, call, branches, body.stream_options)
    results = await gather(s, call, branches)
    return call.response(s, [chat_choice(s, call, b, r) for b, r in zip(branches, results)], results)


@router.post(
    "/v1/completions",
    openapi_extra=json_body(CompletionRequest),
    responses=answers(400, 404, 429, 500, stream=True),
)
async def completions(request: Request):
    s = served(request)
    body = await parse_request(request, CompletionRequest, s.config.lenient)
    check_model(s, body.model)
    n, best_of = body.n or 1, body.best_of or body.n or 1
    if best_of < n:
        raise APIError(400, f"best_of ({best_of}) must be at least n ({n})", param="best_of")
    if best_of > n and body.stream:
        raise APIError(400, "best_of cannot be used with stream", param="best_of")
    echo = bool(body.echo)
    if echo and body.logprobs is not None and body.stream:
        raise APIError(400, "echo with logprobs is not supported when streaming", param="echo")
    segments = None
    decoder = decoder_prompt(s, body)
    if decoder is not None and (echo or body.prompt_blocks is not None):
        what = "echo" if echo else "prompt_blocks"
        raise APIError(
            400,
            f"{what} is not supported for an encoder-decoder model (the prompt is its source)",
            param=what,
        )
    if body.prompt_blocks is not None:
        check_fanout(s, 1, best_of)
        segments = await tokenizing(
            s.tokenize_gate, caller(request).tenant, kv_blocks.completion_block_segments, s, body
        )
        prompts = [kv_blocks.flat(segments)]
        if not kv_blocks.has_blocks(segments):  # no `block: true` segment: a plain prompt
            segments = None
    else:
        check_fanout(s, len(split_prompts(body.prompt)), best_of)
        encode = s.engine.encode_source if decoder is not None else None
        prompts = await encode_prompts(s, body.prompt, caller(request).tenant, encode)
    base = kv_blocks.with_kv_mode(s, sampling(s, body, 1), body, segments is not None)
    logprobs = body.logprobs
    if best_of > n:  # candidates are ranked by their cumulative log-probability
        logprobs = 0 if logprobs is None else logprobs
    prompt_logprobs = body.logprobs if echo and body.logprobs is not None else None
    branches = []
    for p, ids in enumerate(prompts):
        limit = budget(
            s, ids if decoder is None else [s.engine.start_id, *decoder], body.max_tokens, none_is_all=True
        )
        params = replace(base, max_new_tokens=limit, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        check_params(s, params)
        branches += [
            Branch(p * n + i, ids, with_seed(params, i), p, decoder, segments) for i in range(best_of)
        ]
    call = Call(
        request, "cmpl", chat=False, echo=echo, report_logprobs=body.logprobs is not None,
        salt=scope_of(request, body.cache_salt),
    )  # fmt: skip
    if body.stream:
        return stream(s, call, branches, body.stream_options)
    results = await gather(s, call, branches)
    if best_of > n:
        branches, results = best_candidates(branches, results, n)
    choices = [completion_choice(s, call, b, r) for b, r in zip(branches, results)]
    return call.response(s, choices, results, prompts_counted=len(prompts))


# ---- planning --------------------------------------------------------------------------------


@dataclass(slots=True)
class ChatPlan:
    """A chat request's prompt ids, its tool-call parser (None: no tools) and its constraint."""

    ids: list[int]
    parser: tools.ToolParser | None = None
    constraint: Any = None
    keep: tuple[int, float] | None = None  # `cache_control`: (prefix tokens, seconds) to pin
    segments: list | None = None  # `kvblocks_block` parts: the prompt as id segments (`kv_blocks`)
    estimate: Estimate | None = None  # what `cost.chat_estimate` said before it was rendered
    call_reserve: int | None = None  # parallel calls under a grammar: the shortest next call's tokens

    def constraint_within(self, budget: int):
        """The constraint for a reply of at most `budget` tokens: parallel calls under a grammar
        also close after the last call that leaves room for no other (`tools.ClosingCalls`)."""
        if self.call_reserve is None:
            return self.constraint
        return tools.ClosingCalls(self.constraint, budget, self.call_reserve)


def plan_chat(s: Served, body: ChatCompletionRequest, format_param: str = "response_format") -> ChatPlan:
    """Render the messages (and tools) to ids; compile the constraint that tool_choice or
    response_format asks for. Runs in a worker thread: templates and grammars take a while.

    `tool_choice` "none" renders the tool history but not the tools, and parses no calls;
    "required" or a named function decode under a grammar of the tools' schemas, so the call
    always parses and validates; "auto" lets the model choose and parses what it wrote. With a
    JSON response_format, "auto" decodes under one grammar of (tool calls | the JSON answer):
    the model calls tools or gives its final answer in the format, as OpenAI allows; a forced
    call leaves the format to the final message of a later turn. `format_param` is what the
    route calls response_format (`text.format` on /v1/responses), for its errors.
    """
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    tool_defs = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice if isinstance(body.tool_choice, str | None) else body.tool_choice.model_dump()
    if choice is not None and not tool_defs:
        raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
    tokenizer, vocab = s.engine.tokenizer, s.engine.vocab_size
    parser = tools.get_parser(s.config.tool_parser or tools.detect_parser(tokenizer))
    offered = tool_defs if choice != "none" else []
    check_tool_schemas(offered, s.config.grammar, TOOL_PARAMETERS[format_param])  # before any work

    def render(upto: int) -> list[int]:
        try:
            return s.engine.encode(tools.render_messages(tokenizer, messages[:upto], offered or None, parser))
        except tools.ToolError as exc:
            raise APIError(400, str(exc), param="tools") from exc
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from exc

    segments = kv_blocks.chat_block_segments(s, body, messages) if kv_blocks.has_block_parts(body) else None
    ids = render(len(messages)) if segments is None else kv_blocks.flat(segments)
    keep = None
    marked = [
        (i, p.cache_control.seconds)
        for i, m in enumerate(body.messages)
        for p in m.parts()
        if p.cache_control
    ]
    if marked:  # the prefix through the last marked message: where its rendering stops agreeing
        last = max(i for i, _ in marked)
        head = ids if last == len(messages) - 1 else render(last + 1)
        agree = next((k for k, (a, b) in enumerate(zip(ids, head)) if a != b), min(len(ids), len(head)))
        keep = (agree, max(t for _, t in marked))
    fmt = answer_format(body.response_format)
    limits = s.config.grammar
    with compile_errors(format_param):  # compiled alone also when tools come first: refused now
        answer = (
            None
            if fmt is None
            else grammar.json_schema_constraint(tokenizer, vocab, *fmt, limits, param=format_param)
        )
    try:
        forced = tools.tool_call_grammar(
            offered,
            choice,
            parser,
            parallel_tool_calls=bool(body.parallel_tool_calls),
            tokenizer=tokenizer,
            answer=None if fmt is None else grammar.json_schema_rule(*fmt),
        )
    except tools.ToolError as exc:
        raise APIError(400, str(exc), param="tool_choice") from exc
    with compile_errors("tools"):
        constraint = grammar.lark_constraint(tokenizer, vocab, forced, limits, "tools") if forced else answer
    reserve = (
        tools.next_call_tokens(tokenizer, parser, offered) if forced and body.parallel_tool_calls else None
    )
    return ChatPlan(ids, parser if offered else None, constraint, keep, segments, call_reserve=reserve)


# Where a tool's parameters schema is in a request, by the route's name for response_format.
TOOL_PARAMETERS = {
    "response_format": "tools[{i}].function.parameters",
    "text.format": "tools[{i}].parameters",
}


def check_tool_schemas(offered: list[dict], limits: grammar.GrammarLimits, where: str) -> None:
    """The offered tools' parameter schemas, which a tool_choice grammar embeds, each within
    `limits` (a 400 naming it by `where`) and all of them together within its size."""
    schemas = [t["function"].get("parameters") or {} for t in offered]
    for i, schema in enumerate(schemas):
        with compile_errors(where.format(i=i)):
            grammar.check_schema(schema, limits)
    total = sum(len(json.dumps(schema)) for schema in schemas)
    if total > limits.max_bytes:
        raise APIError(
            400,
            f"the tools' parameter schemas are {total} bytes together, over this server's limit of "
            f"{limits.max_bytes}",
            param="tools",
        )


@contextmanager
def compile_errors(param: str) -> Iterator[None]:
    """A schema or grammar that cannot be compiled (or is over a limit) is a 400 naming `param`;
    compilers all held by runaway compiles are a 503."""
    try:
        yield
    except grammar.GrammarBusy as exc:
        raise APIError(503, str(exc), type_="server_error", code="grammar_compiler_busy") from exc
    except grammar.GrammarError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from exc


def answer_format(response_format) -> tuple[dict, bool] | None:
    """The JSON schema a response_format asks the final message to follow, and whether strictly;
    None for free text."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object"}, True
    spec = response_format.json_schema
    return spec.schema_ or {}, bool(spec.strict)


def split_prompts(prompt) -> list:
    """The prompts a completions `prompt` holds: a string or one id list is one prompt; a list of
    strings or of id lists is several."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def check_fanout(s: Served, prompts: int, per_prompt: int) -> None:
    """One request may not become more engine requests than the server allows, before any work."""
    if prompts > s.config.max_prompts:
        raise APIError(
            400,
            f"prompt holds {prompts} prompts; this server takes at most {s.config.max_prompts} per request",
            param="prompt",
        )
    if prompts * per_prompt > s.config.max_branches:
        raise APIError(
            400,
            f"{prompts} prompt(s) x best_of/n {per_prompt} = {prompts * per_prompt} generations; this "
            f"server runs at most {s.config.max_branches} per request",
            param="best_of" if prompts == 1 else "prompt",
        )


async def bounded_plan_chat(
    s: Served,
    body: ChatCompletionRequest,
    format_param: str = "response_format",
    *,
    tenant: str,
    param: str = "messages",
    items: int = 0,
) -> ChatPlan:
    """`plan_chat` once the messages could fit the context (`cost.chat_estimate`, which names
    `param`) and the tokenising gate gives `tenant` a place; `items`: the Responses input items."""
    if s.engine.encoder_decoder:
        raise APIError(
            400,
            f"'{s.config.model_name}' is an encoder-decoder model: it serves /v1/completions (prompt = the "
            "source, decoder_prompt = the decoder's prefix), not chat",
            param="messages",
        )
    estimate = chat_estimate(s, body, param, items)
    plan = await tokenizing(s.tokenize_gate, tenant, plan_chat, s, body, format_param)
    plan.estimate = estimate
    return plan


def decoder_prompt(s: Served, body: CompletionRequest) -> list[int] | None:
    """An encoder-decoder model's decoder prefix ids (`decoder_prompt`, checked; [] when not given);
    None for a decoder-only model, which refuses the field."""
    if not s.engine.encoder_decoder:
        if body.decoder_prompt is not None:
            raise APIError(400, "decoder_prompt is for encoder-decoder models only", param="decoder_prompt")
        return None
    try:
        return s.engine.encode(s.engine.decoder_ids(body.decoder_prompt or []))[1:]
    except ValueError as exc:
        raise APIError(400, f"decoder_prompt: {exc}", param="decoder_prompt") from exc


async def encode_prompts(s: Served, prompt, tenant: str, encode=None) -> list[list[int]]:
    """Completions accept a string, a list of strings, a list of ids or a list of id lists. Every
    prompt is checked against the length bound before any is tokenised (by `encode`, in `tenant`'s
    places of the tokenising gate)."""
    prompts = split_prompts(prompt)
    if not prompts:
        raise APIError(400, "prompt is empty", param="prompt")
    where = ["prompt" if len(prompts) == 1 else f"prompt[{i}]" for i in range(len(prompts))]
    for p, name in zip(prompts, where):
        if isinstance(p, str):
            check_chars(s.prompt_chars, len(p), s.engine.max_context, name)
    out = []
    for p, name in zip(prompts, where):
        try:
            out.append(await tokenizing(s.tokenize_gate, tenant, encode or s.engine.encode, p))
        except ValueError as exc:
            raise APIError(400, f"{name}: {exc}", param=name) from exc
    return out


def sampling(s: Served, body, limit: int) -> GenerationParams:
    """The sampling options shared by chat and completions."""
    bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    return params_or_400(
        max_new_tokens=limit,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        min_p=body.min_p or 0.0,
        stop=stop,
        seed=body.seed,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=bias,
        min_tokens=body.min_tokens or 0,
        ignore_eos=bool(body.ignore_eos),
    )


def params_or_400(**fields) -> GenerationParams:
    try:
        return GenerationParams(**fields)
    except ParamError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc


def check_params(s: Served, params: GenerationParams) -> None:
    """What this generator cannot honour (a speculative one: penalties), or ids outside the vocabulary."""
    try:
        s.engine.check_params(params)
    except ParamError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc


def with_seed(params: GenerationParams, i: int) -> GenerationParams:
    return params if params.seed is None or i == 0 else replace(params, seed=(params.seed + i) % SEED_SPACE)


def budget(s: Served, ids: list[int], requested: int | None, none_is_all: bool = False) -> int:
    """Tokens a choice may generate: what was asked for, never past the model's context. None
    means up to the context limit (completions) or the server's default (chat)."""
    room = (s.engine.max_context or 1 << 30) - len(ids)
    if requested is None:
        return max(
            1, room if none_is_all and s.engine.max_context else min(room, s.config.default_max_tokens)
        )
    if requested > room:
        raise APIError(
            400,
            f"max_tokens is {requested} but the prompt has {len(ids)} tokens and the model's context is "
            f"{s.engine.max_context}; at most {room} tokens can be generated",
            param="max_tokens",
        )
    return requested


# What a request that names no model means: the served model. sglang-router forwards such requests
# with the placeholder "unknown" in `model`.
NO_MODEL = (None, "unknown")


def check_model(s: Served, name: str | None) -> None:
    if name not in NO_MODEL and name != s.config.model_name:
        raise APIError(
            404,
            f"the model '{name}' does not exist; this server serves '{s.config.model_name}'",
            param="model",
            code="model_not_found",
        )


def model_card(s: Served) -> dict:
    card = {"id": s.config.model_name, "object": "model", "created": int(s.started), "owned_by": "kvblocks"}
    card |= s.config.labels()
    if s.engine.max_context:
        card["max_model_len"] = s.engine.max_context
    return card


# ---- running ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Branch:
    """One engine request: choice `index` of prompt `prompt`."""

    index: int
    ids: list[int]  # an encoder-decoder model's source
    params: GenerationParams
    prompt: int = 0
    decoder: list[int] | None = None  # an encoder-decoder model's decoder prompt
    segments: list | None = None  # the prompt as id segments with KV blocks (`kv_blocks`)


@dataclass(slots=True)
class Call:
    """What one HTTP request shares across its branches."""

    request: Request
    kind: str
    chat: bool
    plan: ChatPlan | None = None
    echo: bool = False
    report_logprobs: bool = False
    salt: Any = None
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = f"{self.kind}-{uuid.uuid4().hex[:24]}"

    @property
    def object(self) -> str:
        if self.chat:
            return "chat.completion"
        return "text_completion"

    def response(
        self, s: Served, choices: list[dict], results: list[GenerationResult], prompts_counted: int = 1
    ):
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": s.config.model_name,
            "system_fingerprint": s.system_fingerprint(),
            "choices": sorted(choices, key=lambda c: c["index"]),
            "usage": usage(results, prompts_counted),
        } | s.config.labels()


@dataclass(slots=True, eq=False)
class Submitted:
    """One branch in the engine: its pieces arrive in `inbox`; `cancel` stops it at the next step,
    `end` too, its events then raising `server_shutting_down` (a drain that ran out of time)."""

    handle: Any
    inbox: asyncio.Queue
    admission: Admission

    def cancel(self) -> None:
        self.handle.cancelled.set()  # a no-op once finished; frees the slot and its locks otherwise
        self.inbox.put_nowait(None)
        self.admission.untrack(self)

    def end(self) -> None:
        self.handle.cancelled.set()
        self.inbox.put_nowait(SHUTTING_DOWN)

    async def events(self) -> AsyncIterator[Piece]:
        try:
            while True:
                item = await self.inbox.get()
                if item is None:  # cancelled: the client went away
                    return
                if item is SHUTTING_DOWN:
                    raise shut_down_before("this request finished")
                if isinstance(item, BaseException):
                    raise engine_failure(item)
                yield item
                if item.result is not None:
                    return
        finally:
            self.handle.cancelled.set()


def engine_failure(exc: BaseException) -> APIError:
    """What a failed branch answers: a 400 naming the field when its constraint gave out (a grammar
    that hit its limits while decoding), else a 500."""
    cause = getattr(exc, "cause", exc)
    if isinstance(cause, ConstraintError):
        return APIError(400, str(cause), param=cause.param, code="grammar_limit")
    return APIError(500, f"generation failed: {exc}", type_="server_error")


class RetryLater(APIError):
    """429 with `Retry-After`: the tenant's line or the server's waiting room is full."""

    def __init__(self, full: QueueFullError) -> None:
        super().__init__(429, str(full), type_="rate_limit_error", code="queue_full")
        self.retry_after_s = full.retry_after_s

    def response(self):
        reply = super().response()
        reply.headers["Retry-After"] = str(self.retry_after_s)
        return reply


def submit_all(s: Served, call: Call, branches: list[Branch]) -> list[Submitted]:
    """Queue every branch of the call, or none of them (RetryLater when they cannot wait)."""
    loop = asyncio.get_running_loop()
    inboxes = [asyncio.Queue() for _ in branches]

    def emitter(inbox: asyncio.Queue):
        return lambda item: loop.call_soon_threadsafe(inbox.put_nowait, item)

    items = [
        (prompt_of(b), emitter(inbox), {"params": b.params, "salt": call.salt})
        for b, inbox in zip(branches, inboxes)
    ]
    try:
        handles = s.engine.submit_all(items, tenant=call.salt.tenant)
    except QueueFullError as exc:
        raise RetryLater(exc) from exc
    running = [Submitted(handle, inbox, s.admission) for handle, inbox in zip(handles, inboxes)]
    for r in running:
        s.admission.track(r)
    return running


def prompt_of(b: Branch):
    """What the engine prefills: the id segments where the client marked KV blocks (reused in
    `blend` / `concat`, promoted to the block store in `exact`), a (source, decoder prompt) request
    for an encoder-decoder model, else the flat ids."""
    if b.decoder is not None:
        from kvblocks.seq2seq.generator import Seq2SeqPrompt

        return Seq2SeqPrompt(b.ids, b.decoder)
    return b.segments if b.segments is not None else b.ids


def cancel_all(running: list[Submitted]) -> None:
    for r in running:
        r.cancel()


async def cancel_on_disconnect(request: Request, running: list[Submitted]) -> None:
    """The body was read already: the next message a request receives is its disconnect.
    Non-streaming requests need this; a stream learns it when a write fails."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for r in running:
        r.cancel()


async def gather(s: Served, call: Call, branches: list[Branch]) -> list[GenerationResult]:
    """Run every branch to its result (non-streaming); a client that leaves cancels them all."""
    running = submit_all(s, call, branches)

    async def result_of(r: Submitted) -> GenerationResult | None:
        result = None
        async for piece in r.events():
            result = piece.result
        return result

    watcher = asyncio.create_task(cancel_on_disconnect(call.request, running))
    try:
        results = await asyncio.gather(*(result_of(r) for r in running))
    finally:
        watcher.cancel()
        cancel_all(running)
    if any(r is None for r in results):  # the client went away; nobody reads this
        raise APIError(499, "client closed the request", code="client_closed_request")
    keep_prefix(s, call)
    return results


def keep_prefix(s: Served, call: Call) -> None:
    """Honour `cache_control`: pin the marked prefix, now that the request has put it in the trie."""
    pins = s.prefix_pins()
    if call.plan is not None and call.plan.keep is not None and pins is not None:
        length, seconds = call.plan.keep
        pins.keep(call.plan.ids[:length], call.salt, call.salt.tenant, seconds)


def best_candidates(branches: list[Branch], results: list[GenerationResult], n: int):
    """Per prompt, the n candidates with the highest cumulative log-probability, re-indexed."""
    kept_b, kept_r = [], []
    by_prompt: dict[int, list[tuple[Branch, GenerationResult]]] = {}
    for b, r in zip(branches, results):
        by_prompt.setdefault(b.prompt, []).append((b, r))
    for p, pairs in sorted(by_prompt.items()):
        pairs.sort(key=lambda br: -sum(t.logprob for t in br[1].logprobs or []))
        for i, (b, r) in enumerate(pairs[:n]):
            kept_b.append(replace(b, index=p * n + i))
            kept_r.append(r)
    return kept_b, kept_r


# ---- shaping results -------------------------------------------------------------------------


def token_text(s: Served, token: int) -> str:
    return s.engine.tokenizer.decode([token], skip_special_tokens=False)


def chat_logprobs(s: Served, entries: list[TokenLogprob]) -> dict:
    def item(token: int, logprob: float) -> dict:
        text = token_text(s, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            item(e.token, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries
        ]
    }


def completion_logprobs(s: Served, entries: list[TokenLogprob | None], offset: int) -> dict:
    """OpenAI's legacy shape; `None` entries (the first prompt token) have no log-probability."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for e in entries:
        text = token_text(s, e.token) if e is not None else ""
        tokens.append(text)
        token_logprobs.append(None if e is None else e.logprob)
        tops.append(None if e is None else {token_text(s, t): lp for t, lp in e.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_choice(s: Served, call: Call, branch: Branch, r: GenerationResult) -> dict:
    """A reply cut by max_tokens says "length" and carries every call it completed: the half call
    it was writing is not a call, and its markup is not content."""
    message: dict[str, Any] = {"role": "assistant", "content": r.text}
    finish = r.finish_reason
    parser = call.plan.parser if call.plan is not None else None
    if parser is not None:
        cut = finish == "length"
        content, calls = parser.parse_cut(r.text) if cut else parser.parse(r.text)
        if calls or cut:
            message["content"] = content
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
            finish = finish if cut else "tool_calls"
    choice = {"index": branch.index, "message": message, "finish_reason": finish, "logprobs": None}
    if branch.params.logprobs is not None:
        choice["logprobs"] = chat_logprobs(s, r.logprobs or [])
    return choice


def completion_choice(s: Served, call: Call, branch: Branch, r: GenerationResult) -> dict:
    prompt_text = s.engine.tokenizer.decode(r.prompt_ids, skip_special_tokens=False) if call.echo else ""
    choice = {
        "index": branch.index,
        "text": prompt_text + r.text,
        "finish_reason": r.finish_reason,
        "logprobs": None,
    }
    if call.report_logprobs:
        entries: list[TokenLogprob | None] = list(r.prompt_logprobs or []) if call.echo else []
        choice["logprobs"] = completion_logprobs(s, entries + list(r.logprobs or []), 0)
    return choice


def usage(results: list[GenerationResult], prompts_counted: int = 1) -> dict:
    """Prompt tokens count once per distinct prompt (its branches share its prefill)."""
    per_prompt = len(results) // max(1, prompts_counted)
    firsts = results[::per_prompt] if per_prompt else results
    prompt = sum(r.prompt_tokens + r.encoder_tokens for r in firsts)
    completion = sum(len(r.token_ids) for r in results)
    details = {"cached_tokens": sum(r.cached_tokens + r.encoder_cached_tokens for r in firsts)}
    if any(r.encoder_tokens for r in firsts):  # an encoder-decoder model: source and decoder reuse apart
        details["encoder_cached_tokens"] = sum(r.encoder_cached_tokens for r in firsts)
        details["decoder_cached_tokens"] = sum(r.cached_tokens for r in firsts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": details | kv_blocks.usage_details(firsts),
    }


# ---- streaming -------------------------------------------------------------------------------


def stream(s: Served, call: Call, branches: list[Branch], options) -> StreamingResponse:
    """Branches are queued before the response starts, so a full queue is still a 429; the
    background task cancels them also when the client left before the first chunk."""
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    running = submit_all(s, call, branches)
    return StreamingResponse(
        sse(s, call, branches, running, include_usage, continuous),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
        background=BackgroundTask(cancel_all, running),
    )


async def sse(
    s: Served,
    call: Call,
    branches: list[Branch],
    running: list[Submitted],
    include_usage: bool,
    continuous: bool = False,
) -> AsyncIterator[str]:
    """Pieces of every branch as they come, each chunk tagged with its choice index; with
    `continuous` (vLLM's `continuous_usage_stats`) every chunk carries the usage so far."""
    base = {
        "id": call.id,
        "created": call.created,
        "model": s.config.model_name,
        "system_fingerprint": s.system_fingerprint(),
    } | s.config.labels()
    obj = "chat.completion.chunk" if call.chat else "text_completion"
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for piece in running[i].events():
                await queue.put((i, piece))
        except APIError as exc:
            await queue.put((i, exc))
        finally:
            await queue.put((i, None))

    prompt_ids = {b.prompt: len(b.ids) for b in branches}
    generated = [0] * len(branches)

    def data(payload: dict) -> str:
        if continuous and "usage" not in payload and "error" not in payload:
            prompt, completion = sum(prompt_ids.values()), sum(generated)
            payload["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
        return data_event(payload)

    tasks = [asyncio.create_task(pump(i)) for i in range(len(branches))]
    choices = [ChoiceStream(call.plan.parser if call.chat else None) for _ in branches]
    results: list[GenerationResult | None] = [None] * len(branches)
    try:
        for b in branches:
            if call.chat:
                yield data(
                    base
                    | {
                        "object": obj,
                        "choices": [chunk_choice(b.index, {"role": "assistant", "content": ""})],
                    }
                )
            elif call.echo:
                prompt_text = s.engine.tokenizer.decode(b.ids, skip_special_tokens=False)
                yield data(base | {"object": obj, "choices": [text_choice(b.index, prompt_text)]})
        open_streams = len(branches)
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
                continue
            if isinstance(item, APIError):
                error = {"message": item.message, "type": item.type, "param": item.param, "code": item.code}
                yield data({"error": error})
                continue
            b = branches[i]
            piece: Piece = item
            generated[i] += len(piece.token_ids)
            added = choices[i].feed(piece)
            finish = added.finish
            logprobs = None
            if b.params.logprobs is not None and piece.logprobs:
                logprobs = (
                    chat_logprobs(s, piece.logprobs)
                    if call.chat
                    else completion_logprobs(s, piece.logprobs, 0)
                )
            if call.chat:
                delta: dict[str, Any] = {}
                if added.calls:
                    delta["tool_calls"] = added.calls
                if added.text:
                    delta["content"] = added.text
                if "tool_calls" in delta and finish:  # the calls' last arguments, then the finish
                    yield data(
                        base | {"object": obj, "choices": [chunk_choice(b.index, delta, None, logprobs)]}
                    )
                    delta, logprobs = {}, None
                if delta or finish or logprobs:
                    yield data(
                        base | {"object": obj, "choices": [chunk_choice(b.index, delta, finish, logprobs)]}
                    )
            elif added.text or finish or logprobs:
                yield data(
                    base | {"object": obj, "choices": [text_choice(b.index, added.text, finish, logprobs)]}
                )
            if piece.result is not None:
                results[i] = piece.result
        if all(r is not None for r in results):
            keep_prefix(s, call)
        if include_usage and all(r is not None for r in results):
            prompts = len({b.prompt for b in branches})
            yield data(base | {"object": obj, "choices": [], "usage": usage(results, prompts)})
        yield DONE
    finally:  # no awaits here: when the client left, this runs inside a cancelled scope
        cancel_all(running)
        for t in tasks:
            t.cancel()


def chunk_choice(index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}


def text_choice(index: int, text: str, finish: str | None = None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
