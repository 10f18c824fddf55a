"""OpenAI-style errors, and turning a raw request body into a validated request or a clear 4xx."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvblocks.server.guard import error_response, principal_of
from kvblocks.server.schemas import ACCEPTED_DEFAULTS, ECHOED_EMPTY, REFUSED, ROUTER_DEFAULTS

log = logging.getLogger("kvblocks.server")
M = TypeVar("M", bound=BaseModel)

MEDIA_PARTS = {"image_url", "input_image", "input_audio", "audio_url", "file", "video_url"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# What pydantic puts in an error location besides field names: the union member it tried.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal", "tagged-union", "union"}
MAX_JSON_DEPTH = 64
# A lone surrogate can only reach a decoded string through a \uD800-\uDFFF escape (raw UTF-8 cannot
# carry one): bodies without such an escape skip the walk that finds the field.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class APIError(Exception):
    """An OpenAI-style error: status, message, type, param, code."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self):
        return error_response(self.status, self.message, self.type, self.param, self.code)

    def __reduce__(self):
        """All five fields, not the message only: a body-parsing worker (`parsing`) sends it back."""
        return APIError, (self.status, self.message, self.type, self.param, self.code)


async def parse_request(
    request: Request,
    model: type[M],
    lenient: bool,
    refused: dict[str, str] = REFUSED,
    accepted: dict[str, list] = ACCEPTED_DEFAULTS,
) -> M:
    """The body as a validated `model`, or an APIError that names what is wrong. `refused` names
    the route's parameters that cannot be honoured, `accepted` their values that ask for nothing.
    A large body is parsed off the event loop (`parsing.BodyParser`, where the app has one)."""
    raw = await request.body()
    content_type = request.headers.get("content-type", "")
    parser = getattr(request.app.state, "body_parser", None)
    if parser is None:
        return parse_body(raw, content_type, model, lenient, refused, accepted)
    tenant = principal_of(request.scope).tenant
    return await parser.parse(tenant, raw, content_type, model, lenient, refused, accepted)


def parse_body(
    raw: bytes,
    content_type: str,
    model: type[M],
    lenient: bool,
    refused: dict[str, str] = REFUSED,
    accepted: dict[str, list] = ACCEPTED_DEFAULTS,
) -> M:
    """`parse_request`'s work on the bytes: no I/O, so it can run in a worker process."""
    if content_type and "json" not in content_type.split(";")[0].lower():
        raise APIError(
            400, f"the request body must be JSON sent as Content-Type: application/json, got '{content_type}'"
        )
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise APIError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels") from exc
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    surrogates = _SURROGATE_ESCAPE.search(raw) is not None
    if surrogates or raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:  # else neither can be there
        check_structure(data, surrogates)
    data = screen(data, model, lenient, refused, accepted)
    return validate(model, data, lenient)


def validate(model: type[M], data: dict, lenient: bool) -> M:
    """`model` from `data`. Nested keys the model does not know are dropped when they are an echoed
    message's empty fields (ECHOED_EMPTY), or any of them when `lenient`; otherwise refused by path.

    Dropping works on pydantic's own locations, so it reaches every level (messages, content parts,
    tool calls, Responses items) without a second description of the schema.
    """
    for _ in range(MAX_JSON_DEPTH):
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
        extras = [e for e in errors if e["type"] == "extra_forbidden"]
        droppable = [e for e in extras if lenient or _echoed_empty(e)]
        if not droppable or not any(_drop(data, e["loc"]) for e in droppable):
            raise validation_error(errors)
        if lenient:
            for e in droppable:
                log.warning(
                    "kvblocks: ignoring unknown request argument '%s' (--lenient)", location(e["loc"])
                )
    raise APIError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels")


def _echoed_empty(error: dict) -> bool:
    return error["loc"][-1] in ECHOED_EMPTY and error.get("input") in (None, [], "")


def _drop(data, loc: tuple) -> bool:
    """Remove the key at pydantic location `loc` from `data`, skipping the union tags pydantic adds
    that the data does not have; False when the key is not there."""
    node = data
    for part in loc[:-1]:
        in_dict = isinstance(node, dict) and part in node
        if in_dict or (isinstance(node, list) and isinstance(part, int) and part < len(node)):
            node = node[part]
    if isinstance(node, dict) and loc[-1] in node:
        del node[loc[-1]]
        return True
    return False


def check_structure(data: dict, surrogates: bool) -> None:
    """Refuse (400, naming the field) containers nested deeper than MAX_JSON_DEPTH, which would
    exhaust the stack of any recursive validator, and, when `surrogates`, strings holding a lone
    surrogate, which no encoder downstream (tokenizer, Redis keys, logs) can write.

    Lists of scalars are skipped at C speed; bodies with few brackets and no surrogate escape are not
    walked at all.
    """
    stack: list[tuple[object, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if _LONE_SURROGATE.search(value):
                where = path or "body"
                raise APIError(
                    400, f"{where}: the string holds a lone surrogate (invalid Unicode)", param=where
                )
            continue
        if depth >= MAX_JSON_DEPTH:
            where = path if len(path) < 80 else path[:76] + "..."
            raise APIError(400, f"{where}: nested deeper than {MAX_JSON_DEPTH} levels", param=where)
        if isinstance(value, dict):
            items = [(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()]
            if surrogates:
                items += [(k, f"{path}.<key>" if path else "<key>") for k in value]
        else:
            kinds = set(map(type, value))
            if not (kinds & {list, dict} or (surrogates and str in kinds)):
                continue
            items = [(v, f"{path}[{i}]") for i, v in enumerate(value)]
        stack.extend(
            (v, where, depth + 1)
            for v, where in items
            if isinstance(v, list | dict) or (surrogates and isinstance(v, str))
        )


def screen(
    data: dict,
    model: type[BaseModel],
    lenient: bool,
    refused: dict[str, str] = REFUSED,
    accepted: dict[str, list] = ACCEPTED_DEFAULTS,
) -> dict:
    """Refuse parameters this server cannot honour, and unknown ones (dropped with a warning when
    lenient); refuse media content parts with a message that says why."""
    known = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    out = {}
    for key, value in data.items():
        if key in refused and value not in accepted.get(key, [None]):
            raise APIError(
                400, f"'{key}' is not supported: {refused[key]}", param=key, code="unsupported_parameter"
            )
        if key in ROUTER_DEFAULTS and key not in known:
            if value in ROUTER_DEFAULTS[key]:
                continue
            raise APIError(
                400,
                f"'{key}' = {json.dumps(value)} is not supported: kvblocks only honours "
                f"{' or '.join(json.dumps(v) for v in ROUTER_DEFAULTS[key])} here",
                param=key,
                code="unsupported_parameter",
            )
        if key not in known:
            if lenient:
                log.warning("kvblocks: ignoring unknown request argument '%s' (--lenient)", key)
                continue
            raise APIError(400, f"Unrecognized request argument supplied: {key}", param=key)
        out[key] = value
    messages = out.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        parts = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(parts if isinstance(parts, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and not isinstance(kind, str):
                where = f"messages[{i}].content[{j}].type"
                raise APIError(400, f"{where}: must be a string such as 'text'", param=where)
            if kind in MEDIA_PARTS:
                raise APIError(
                    400,
                    f"this model is text-only: messages[{i}].content[{j}] is an '{kind}' part; send text parts only",
                    param=f"messages[{i}].content[{j}]",
                    code="unsupported_content",
                )
    return out


def validation_error(errors: Sequence[dict]) -> APIError:
    """The first error, its location written as a parameter path without pydantic's union tags."""
    if not errors:
        return APIError(400, "invalid request")
    extras = [e for e in errors if e["type"] == "extra_forbidden"]
    first = extras[0] if extras else errors[0]  # an unknown key says more than the union's other misses
    path = location(first["loc"])
    same_place = [e for e in errors if location(e["loc"]) == path]
    if len(same_place) > 1 and first["type"] not in ("missing", "extra_forbidden"):
        message = f"{path}: has the wrong type or value ({_plain(first)})"
    elif first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {path}"
    else:
        message = f"{path}: {_plain(first)}" if path else _plain(first)
    return APIError(400, message, param=path or None)


def location(loc: tuple) -> str:
    out = ""
    if loc and loc[0] in ("body", "query", "path"):
        loc = loc[1:]
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and _NAME.match(part) and part.lower() not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out


def _plain(error: dict) -> str:
    message = error.get("msg", "invalid value")
    return message.removeprefix("Value error, ")
