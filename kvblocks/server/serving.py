"""Running the app under uvicorn: bounded connections and a graceful drain.

Connections: a client must finish a request's headers within `header_timeout_s` of connecting
(or of the first byte after an idle keep-alive), an idle keep-alive connection is closed after
`keep_alive_s`, and at most `max_per_client` connections per client address and `max_total` in
all are served; one over a cap gets a 503 with `Retry-After` as soon as its headers arrive, and is
closed. uvicorn has no header timeout and arms its keep-alive timer only after a first response,
so `BoundedH11Protocol` adds both.

Drain: uvicorn's own handling closes the listening socket at once, may cut streams that outlast
its grace period, and re-raises the signal afterwards (the process then dies of SIGTERM instead
of exiting 0). Here the first SIGTERM or SIGINT starts the drain: admission stops, the requests in
flight run on for up to `drain_timeout_s`, then those still running are ended (a stream with an
error event and its terminator, see `guard.Admission.end_all`), and only then does uvicorn close
its sockets. A second signal ends the drain early.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from types import FrameType

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvblocks.server.guard import Admission, error_response

# After the drain, how long uvicorn may still wait for connections before it cancels them.
GRACE_AFTER_DRAIN_S = 5
# How long the requests ended by a drain that ran out of time have to send their last event.
END_GRACE_S = 2.0
# How long a connection over a cap may take to send the headers its 503 answers.
REFUSED_HEADER_TIMEOUT_S = 1.0
OVER_CAP_RETRY_AFTER_S = 1


@dataclass(slots=True)
class ConnectionLimits:
    """`kvblocks serve`'s connection bounds (0 for a cap: none), and the connections counted
    against them. Touched only on the event loop."""

    header_timeout_s: float = 10.0
    keep_alive_s: float = 30.0
    max_per_client: int = 256
    max_total: int = 1024
    open_by_client: Counter = field(default_factory=Counter)

    def over_cap(self, client: str) -> str | None:
        """Why a new connection from `client` is refused, or None."""
        if self.max_total and sum(self.open_by_client.values()) >= self.max_total:
            return f"the server has {self.max_total} connections open, its limit (--max-connections)"
        if self.max_per_client and self.open_by_client[client] >= self.max_per_client:
            return (
                f"this client address has {self.max_per_client} connections open, its limit "
                "(--max-connections-per-client)"
            )
        return None


class BoundedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a header timeout and connection caps (see the module)."""

    def __init__(self, *args, limits: ConnectionLimits, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.counted_as: str | None = None  # the client address this connection counts under
        self.header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        client = self.client[0] if self.client else ""
        refused = self.limits.over_cap(client)
        if refused is not None:
            self.app = partial(over_cap, refused)
            self._await_headers(min(REFUSED_HEADER_TIMEOUT_S, self.limits.header_timeout_s))
            return
        self.counted_as = client
        self.limits.open_by_client[client] += 1
        self._await_headers(self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.counted_as is not None:
            self.limits.open_by_client[self.counted_as] -= 1
            if not self.limits.open_by_client[self.counted_as]:
                del self.limits.open_by_client[self.counted_as]
            self.counted_as = None
        self._headers_arrived()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.header_timer is None and self._between_requests():
            self._await_headers(self.limits.header_timeout_s)  # a keep-alive's next request begins
        super().data_received(data)
        if not self._between_requests():
            self._headers_arrived()

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _await_headers(self, timeout_s: float) -> None:
        self.header_timer = self.loop.call_later(timeout_s, self._headers_late)

    def _headers_arrived(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _headers_late(self) -> None:
        self.header_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()


async def over_cap(reason: str, scope, receive, send) -> None:
    """The ASGI app a connection over a cap is served: a 503 that closes it."""
    reply = error_response(
        503, f"too many connections: {reason}; retry later", type_="server_error",
        code="too_many_connections",
        headers={"Retry-After": str(OVER_CAP_RETRY_AFTER_S), "Connection": "close"},
    )  # fmt: skip
    await reply(scope, receive, send)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, admission: Admission, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.admission = admission
        self.drain_timeout_s = drain_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Not recorded for re-raising, unlike uvicorn's: a drained server exits with status 0."""
        if self.admission.draining:
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        self.admission.draining = True
        threading.Thread(target=self._drain, name="kvblocks-drain", daemon=True).start()

    def _drain(self) -> None:
        """Wait (off the event loop, which serves the requests) until none is in flight or time is
        up; then end those still running, and give them a moment to send their last event."""
        self._wait_idle(self.drain_timeout_s)
        if self.admission.in_flight > 0 and self.loop is not None and not self.should_exit:
            self.loop.call_soon_threadsafe(self.admission.end_all)
            self._wait_idle(END_GRACE_S)
        self.should_exit = True

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.admission.in_flight > 0 and time.monotonic() < deadline and not self.should_exit:
            time.sleep(0.05)


def serve(app, sock: socket.socket, log_level: str, limits: ConnectionLimits) -> None:
    """Serve `app` (from `create_app`) on the bound `sock` until a signal, then drain and shut
    down in order."""
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=GRACE_AFTER_DRAIN_S,
        http=partial(BoundedH11Protocol, limits=limits),
        timeout_keep_alive=limits.keep_alive_s,
    )
    served = app.state.served
    DrainingServer(config, served.admission, served.config.drain_timeout_s).run(sockets=[sock])
