"""Running the app under uvicorn with a graceful drain: a shutdown signal first stops admission,
then waits for the requests in flight, and only then lets uvicorn close its sockets.

uvicorn's own handling closes the listening socket at once, may cut streams that outlast its
grace period, and re-raises the signal afterwards (the process then dies of SIGTERM instead of
exiting 0). Here the first SIGTERM or SIGINT starts the drain; a second one ends it early.
"""

from __future__ import annotations

import socket
import threading
import time
from types import FrameType

import uvicorn

from kvblocks.server.guard import Admission

# After the drain, how long uvicorn may still wait for connections before it cancels them.
GRACE_AFTER_DRAIN_S = 5


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, admission: Admission, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.admission = admission
        self.drain_timeout_s = drain_timeout_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Not recorded for re-raising, unlike uvicorn's: a drained server exits with status 0."""
        if self.admission.draining:
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        self.admission.draining = True
        threading.Thread(target=self._drain, name="kvblocks-drain", daemon=True).start()

    def _drain(self) -> None:
        """Wait (off the event loop, which serves the requests) until none is in flight or time is up."""
        deadline = time.monotonic() + self.drain_timeout_s
        while self.admission.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.should_exit = True


def serve(app, sock: socket.socket, log_level: str) -> None:
    """Serve `app` (from `create_app`) on the bound `sock` until a signal, then drain and shut
    down in order."""
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=GRACE_AFTER_DRAIN_S
    )
    served = app.state.served
    DrainingServer(config, served.admission, served.config.drain_timeout_s).run(sockets=[sock])
