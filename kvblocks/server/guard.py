"""The server's front door, as plain ASGI middleware: who is calling, and how much they may send.

Before any route runs, a request must carry a known API key (when keys are configured), declare
and send at most `max_body_bytes`, and finish sending its body within `read_timeout_s`. The body
is read here and replayed to the app, so a slow or oversized sender costs no tokenisation, no
queue slot and no handler. After the body, `receive` passes through, so handlers still learn when
a client disconnects. While the server drains (SIGTERM), new work (any POST) gets a 503 with
`Retry-After`, and the guard counts the requests still in flight so the drain knows when to stop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvblocks.server.auth import OPEN, ApiKeys, Principal

PUBLIC_PATHS = frozenset({"/health", "/health_generate"})
DRAIN_RETRY_AFTER_S = 5


@dataclass(slots=True)
class Admission:
    """Whether the server still takes new work, how many HTTP requests are in flight (streams
    count until their last byte), and the engine requests running for them (anything with an
    `end()`: `openai_routes.Submitted`), which a drain that runs out of time ends. Touched only on
    the event loop, so plain fields suffice."""

    draining: bool = False
    in_flight: int = 0
    running: set = field(default_factory=set)
    ended: bool = False

    def track(self, request) -> None:
        """Count `request` as running until `untrack`; one that starts after `end_all` ends at once."""
        if self.ended:
            request.end()
        else:
            self.running.add(request)

    def untrack(self, request) -> None:
        self.running.discard(request)

    def end_all(self) -> None:
        """The drain ran out of time: end every running request now (streams send an error event
        and their terminator instead of being cut)."""
        self.ended = True
        for request in list(self.running):
            request.end()
        self.running.clear()


@dataclass(slots=True, frozen=True)
class GuardConfig:
    keys: ApiKeys | None = None
    max_body_bytes: int = 4 << 20
    read_timeout_s: float = 30.0
    admission: Admission = field(default_factory=Admission)


def error_response(
    status: int, message: str, type_: str = "invalid_request_error", param=None, code=None, headers=None
):
    """An OpenAI-style error body."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def draining_response() -> JSONResponse:
    """What new work gets while the server shuts down: try another replica, or this one later."""
    return error_response(
        503, "the server is shutting down and takes no new requests", type_="server_error",
        code="server_draining", headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)},
    )  # fmt: skip


def principal_of(scope: Scope) -> Principal:
    return scope.get("state", {}).get("principal", OPEN)


class RequestGuard:
    def __init__(self, app: ASGIApp, config: GuardConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        principal = self._authenticate(scope)
        if principal is None:
            reply = error_response(401, "invalid or missing API key", code="invalid_api_key")
            await reply(scope, receive, send)
            return
        scope.setdefault("state", {})["principal"] = principal
        admission = self.config.admission
        if admission.draining and scope["method"] == "POST":
            await draining_response()(scope, receive, send)
            return
        admission.in_flight += 1
        try:
            await self._serve(scope, receive, send)
        finally:
            admission.in_flight -= 1

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authenticate(self, scope: Scope) -> Principal | None:
        keys = self.config.keys
        if keys is None:
            return OPEN
        if scope["path"] in PUBLIC_PATHS:
            return Principal("")
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        return keys.principal(header)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None once an error was sent (or the client left)."""
        limit = self.config.max_body_bytes
        too_large = error_response(
            413, f"the request body is larger than {limit} bytes (the server's --max-body-bytes)",
            code="request_too_large",
        )  # fmt: skip
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await too_large(scope, receive, send)
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.read_timeout_s
        parts, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                slow = error_response(
                    408, f"the request body did not arrive within {self.config.read_timeout_s:g} s",
                    code="request_timeout",
                )  # fmt: skip
                await slow(scope, receive, send)
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await too_large(scope, receive, send)
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)
