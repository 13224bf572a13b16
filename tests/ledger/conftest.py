"""The ledger tests' fixtures: ``make`` (a fresh ledger of each backend, SQLite and
Redis) and ``clock`` (a manual clock at 2025-12-01T00:00:00Z), defined in
``tests/ledger_backends.py``; ``cluster`` (a three-node Redis Cluster, per module), the
Redis tests' own, defined in ``tests/redis_server.py``."""

from ledger_backends import clock, make
from redis_server import cluster

__all__ = ["clock", "cluster", "make"]
