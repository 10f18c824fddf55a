"""`kvblocks serve`: the OpenAI-compatible HTTP server (see `app`)."""

from kvblocks.server.app import create_app, freeze_startup_objects
from kvblocks.server.state import ServerConfig

__all__ = ["ServerConfig", "create_app", "freeze_startup_objects"]
