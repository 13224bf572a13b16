"""Both ledger backends behind one fixture: SQLite in a temp dir, Redis on a private
redis-server (these tests fail, never skip, without redis-server or the redis package)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ratequeue as rq
from ratequeue.ledger import LedgerBase, RedisLedger, SqliteLedger
from redis_server import RedisServer, server_binary

#: 2025-12-01T00:00:00Z: tests start at a month boundary on a manual clock.
T0 = 1_764_547_200.0

_server: RedisServer | None = None
_names = itertools.count()


def shared_redis() -> RedisServer:
    """The module's redis-server (started once); fails when redis-server is missing."""
    global _server
    binary = server_binary()
    if binary is None:
        pytest.fail("redis-server not found: the ledger's Redis tests need it (never skipped)")
    if _server is None:
        _server = RedisServer(binary)
        _server.start()
    return _server


def stop_shared_redis() -> None:
    global _server
    if _server is not None:
        _server.cleanup()
        _server = None


Factory = Callable[..., LedgerBase]


@pytest.fixture(params=["sqlite", "redis"])
def make(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Factory]:
    """``make(clock=..., **kw)`` -> a fresh ledger of the parametrized backend; ledgers
    made by one test share storage (like several processes). ``redis_timeout`` is the
    Redis client's socket timeout (s)."""
    made: list[LedgerBase] = []
    name = f"t{next(_names)}-{os.getpid()}"
    backend = request.param

    def factory(clock: Any = None, *, redis_timeout: float = 5.0, **kw: Any) -> LedgerBase:
        led: LedgerBase
        if backend == "sqlite":
            led = SqliteLedger(tmp_path / "ledger.db", clock=clock, **kw)
        else:
            client = shared_redis().client(timeout=redis_timeout)
            led = RedisLedger(client, name=name, clock=clock, **kw)
        made.append(led)
        return led

    factory.backend = backend  # type: ignore[attr-defined]
    yield factory
    for led in made:
        led.close()


@pytest.fixture
def clock() -> rq.ManualClock:
    """A manual clock at 2025-12-01T00:00:00Z."""
    return rq.ManualClock(T0)
