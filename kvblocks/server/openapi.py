"""The published OpenAPI document (`/openapi.json`), built from what the routes really do.

Routes parse their bodies themselves (so a 400 can name the field), which hides the bodies from
FastAPI: each route declares its body with `json_body(Model)`, naming the model it validates with,
and its error answers with `answers(...)`. `install` then adds what every route shares: the guard's
answers (401, 408, 413, 503), the bearer scheme when keys are configured, and no 422 (query
errors are 400s here, see `app.invalid_request`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvblocks.server.guard import PUBLIC_PATHS

REF = "#/components/schemas/{model}"
# What each error status means on this server (the body is always ErrorBody).
MEANING = {
    400: "The request is malformed or asks for something this server cannot honour; `param` names it",
    401: "Missing or unknown API key",
    403: "The key's tenant may not use this route (router or admin keys only)",
    404: "No such model or stored response",
    408: "The request body did not arrive within the server's read timeout",
    413: "The request body is larger than --max-body-bytes",
    429: "The tenant's queue or the server's waiting room is full; retry after `Retry-After` seconds",
    500: "Generation failed inside the engine",
    503: "The server is shutting down or its engine cannot serve",
}
RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before retrying (with every 429, and with 503 while the server drains)",
        "schema": {"type": "integer"},
    }
}
_BODIES: dict[str, type[BaseModel]] = {}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error shape, which every non-2xx answer of this server has."""

    error: ErrorDetail


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` declaring `model` as the route's JSON body (the route validates with it too)."""
    _BODIES[model.__name__] = model
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


# One server-sent event, as clients (and schemathesis) parse it: `data` is a JSON text or `[DONE]`.
SSE_EVENT = {
    "type": "object",
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
    "required": ["data"],
}


def answers(*statuses: int, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """`responses` for a route that answers `statuses` besides 200; `stream`: its 200 may be SSE."""
    out: dict[int | str, dict[str, Any]] = {status: error_answer(status) for status in statuses}
    if stream:
        sse = {"text/event-stream": {"schema": SSE_EVENT}}
        out[200] = {
            "description": "A JSON object, or server-sent events when `stream` is true",
            "content": sse,
        }
    return out


def error_answer(status: int) -> dict[str, Any]:
    """An error status as the document lists it: what it means here, OpenAI's error body."""
    schema = {"$ref": REF.format(model=ErrorBody.__name__)}
    answer: dict[str, Any] = {
        "description": MEANING[status],
        "content": {"application/json": {"schema": schema}},
    }
    if status in (429, 503):
        answer["headers"] = RETRY_AFTER
    return answer


def install(app: FastAPI, keyed: bool, model_name: str) -> None:
    """Serve `document(...)` as the app's OpenAPI document (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(app, keyed, model_name)
        return app.openapi_schema

    app.openapi = openapi


def document(app: FastAPI, keyed: bool, model_name: str) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    models = [ErrorBody, *_BODIES.values()]
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    schemas.update(defs.get("$defs", {}))
    if keyed:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            add_guard_answers(operation, method, path in PUBLIC_PATHS, keyed)
            for parameter in operation.get("parameters", []):
                if parameter["name"] == "model_id":  # the one id that exists
                    parameter["example"] = model_name
    return doc


def add_guard_answers(operation: dict, method: str, public: bool, keyed: bool) -> None:
    """The guard's answers, which come before any route runs."""
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    statuses = [408, 413] + ([503] if method == "post" else [])
    if keyed and not public:
        operation["security"] = [{"bearer": []}]
        statuses.append(401)
    for status in statuses:
        responses.setdefault(str(status), error_answer(status))
