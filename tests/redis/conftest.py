"""The Redis tests' fixtures: a private redis-server on loopback (``redis_server``, shared
by the session), one of a test's own (``own_redis``, to stop or freeze), a client on
an empty database (``r``) and a three-node Redis Cluster (``cluster``, per module).
Defined in ``tests/redis_server.py``, which tests outside this directory import them
from."""

from redis_server import cluster, own_redis, r, redis_server

__all__ = ["cluster", "own_redis", "r", "redis_server"]
