"""Real Redis servers for the spill-tier tests: `kvblocks.launch.redis_server` (one server, or a 3-node
Redis Cluster), the rule that a test may skip for want of Redis on a developer's machine, never in CI,
and the one set of fixtures every test file uses (registered in conftest.py):
- `redis_server`: a server of the test's own, stopped after it;
- `module_redis_server`: one server shared by a test file;
- `redis_url`: `redis_server`'s URL.
A test that must fail without Redis, even outside CI, starts `RedisServer` itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvblocks.launch.ports import free_port
from kvblocks.launch.redis_server import LocalCluster, RedisServer
from kvblocks.launch.service import ServiceError as RedisUnavailable

__all__ = [
    "LocalCluster",
    "RedisServer",
    "RedisUnavailable",
    "free_port",
    "module_redis_server",
    "redis_server",
    "redis_url",
    "start_redis",
    "started",
    "unavailable",
]


def unavailable(reason: str):
    """Redis tests may skip on a developer's machine, never in CI."""
    if os.environ.get("KVBLOCKS_CI") == "1":
        pytest.fail(f"Redis server needed in CI (KVBLOCKS_CI=1) could not start: {reason}", pytrace=False)
    pytest.skip(f"no Redis server: {reason}")


def started(server: RedisServer | LocalCluster):
    """`server` started, or the test skipped (failed in CI) with the reason it could not start."""
    try:
        return server.start()
    except RedisUnavailable as exc:
        unavailable(str(exc))


def start_redis(workdir: Path, **options) -> RedisServer:
    """A started `RedisServer(workdir, **options)` (see `started`)."""
    return started(RedisServer(workdir, **options))


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = start_redis(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def module_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url
