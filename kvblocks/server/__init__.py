"""`kvblocks serve`: the OpenAI-compatible HTTP server (see `app`).

The names below load the app (torch, transformers, the routes) on first use, so that a light module
of this package (`auth`, reading a keys file) can be imported in a moment: `kvblocks serve` checks
its arguments before it pays for the rest."""

__all__ = ["ServerConfig", "create_app", "freeze_startup_objects"]


def __getattr__(name: str):
    if name in ("create_app", "freeze_startup_objects"):
        from kvblocks.server import app

        return getattr(app, name)
    if name == "ServerConfig":
        from kvblocks.server.state import ServerConfig

        return ServerConfig
    raise AttributeError(f"module 'kvblocks.server' has no attribute '{name}'")
