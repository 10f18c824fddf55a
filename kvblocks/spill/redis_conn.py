"""The Redis tier's connection: one client for lookups (a short timeout: they hold up a request),
one for writes (a longer one: they run on the writer thread), both made on first use and dropped
after a failure, so the next use reconnects. Redis, Redis Cluster and Valkey."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvblocks.spill.tier import TierUnavailable

# What an unreachable or failing Redis raises. RedisClusterException is not a RedisError: a
# RedisCluster client raises it when no startup node answers.
REDIS_FAILURES = (redis.RedisError, redis.exceptions.RedisClusterException)

Client = redis.Redis | redis.RedisCluster


class RedisConnection:
    """Clients by role ("read", "write"); `run` turns any Redis failure into TierUnavailable."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        fetch_timeout_s: float,
        connect_timeout_s: float,
        cluster: bool | None = None,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        self.url = url
        self.cluster = (
            cluster if cluster is not None else url.startswith(("redis+cluster://", "rediss+cluster://"))
        )

        def factory(socket_timeout: float) -> Callable[[], Client]:
            kwargs = dict(
                socket_timeout=socket_timeout,
                socket_connect_timeout=connect_timeout_s,
                retry=Retry(NoBackoff(), 0),
            ) | dict(client_options or {})
            if self.cluster:
                return lambda: redis.RedisCluster.from_url(url.replace("+cluster", ""), **kwargs)
            return lambda: redis.Redis.from_url(url, **kwargs)

        self._factories = {"read": factory(fetch_timeout_s), "write": factory(timeout_s)}
        self._clients: dict[str, Client | None] = {"read": None, "write": None}

    def client(self, role: str = "write") -> Client:
        client = self._clients[role]
        if client is None:
            client = self._clients[role] = self._factories[role]()
        return client

    def run(self, role: str, work: Callable[[Client], Any]) -> Any:
        """`work(client)`; a Redis failure drops the clients and raises TierUnavailable."""
        try:
            return work(self.client(role))
        except REDIS_FAILURES as exc:
            self.drop()
            raise TierUnavailable(f"Redis at {self.url}: {exc}") from exc

    def pipeline(self, role: str, calls: list[tuple[Any, ...]]) -> list[Any]:
        """Run `calls` in one pipeline; a WRONGTYPE reply comes back in place of its result (it is
        that key's problem), any other failure raises TierUnavailable (it is the tier's)."""

        def work(client: Client) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name, *args in calls:
                getattr(pipe, name)(*args)
            replies = pipe.execute(raise_on_error=False)
            for reply in replies:
                if isinstance(reply, Exception) and not wrong_type(reply):
                    raise reply
            return replies

        return self.run(role, work) if calls else []

    def drop(self) -> None:
        # Drop the clients without closing them: another thread (the writer, or a concurrent
        # request) may be mid-command on one, and closing its sockets under that thread raises
        # errors redis-py does not wrap (ValueError). Each closes once its last user lets go.
        self._clients = {"read": None, "write": None}

    def close(self) -> None:
        for client in self._clients.values():
            if client is not None:
                client.close()


def wrong_type(reply: object) -> bool:
    return isinstance(reply, redis.ResponseError) and str(reply).startswith("WRONGTYPE")
