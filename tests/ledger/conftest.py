"""The ledger tests' fixtures: ``make`` (a fresh ledger of each backend, SQLite and
Redis) and ``clock`` (a manual clock at 2025-12-01T00:00:00Z), defined in
``tests/ledger_backends.py``; ``cluster`` (a three-node Redis Cluster, per module) and
``server`` (a redis-server of the test's own, to pause, freeze or restart), from the
Redis tests' ``tests/redis_server.py``."""

import pytest
from ledger_backends import clock, make
from redis_server import RedisServer, cluster, own_redis

__all__ = ["clock", "cluster", "make", "own_redis", "server"]


@pytest.fixture
def server(own_redis: RedisServer) -> RedisServer:
    """A redis-server of this test's own (paused, frozen, flushed or restarted by it)."""
    return own_redis
