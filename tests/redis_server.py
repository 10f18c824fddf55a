"""Real Redis servers for the spill-tier tests: `kvblocks.launch.redis_server` (one server, or a 3-node
Redis Cluster), plus the rule that a test may skip for want of Redis on a developer's machine, never in CI.
"""

from __future__ import annotations

import os

from kvblocks.launch.ports import free_port
from kvblocks.launch.redis_server import LocalCluster, RedisServer
from kvblocks.launch.service import ServiceError as RedisUnavailable

__all__ = ["LocalCluster", "RedisServer", "RedisUnavailable", "free_port", "unavailable"]


def unavailable(reason: str):
    """Redis tests may skip on a developer's machine, never in CI."""
    import pytest

    if os.environ.get("KVBLOCKS_CI") == "1":
        pytest.fail(f"Redis server needed in CI (KVBLOCKS_CI=1) could not start: {reason}", pytrace=False)
    pytest.skip(f"no Redis server: {reason}")
