"""An awaited Redis acquire cancelled the moment its command is written ends with
``CancelledError`` and gives its reservation back, even on a client whose
``socket_timeout`` makes redis-py send through ``asyncio.wait_for`` (which swallows a
cancel at exactly that moment on Python 3.10/3.11; see ``ratequeue._cancel``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import ratequeue as rq
from cancel_race import cancel_when_written
from ratequeue.redis import AsyncRedisKeyedLimiter, AsyncRedisLimiter, AsyncRedisPolicy
from redis_server import RedisServer

ONE = rq.Rate(1, per=60, burst=1)  # one slot; the acquire takes it at once


def limiter(c: Any) -> tuple[Callable[[], Any], Callable[[], Any]]:
    lim = AsyncRedisLimiter(c, ONE, name="race")
    return (lambda: lim.try_acquire()), (lambda: lim.acquire())


def keyed(c: Any) -> tuple[Callable[[], Any], Callable[[], Any]]:
    lim = AsyncRedisKeyedLimiter(c, ONE, name="race-k")
    return (lambda: lim.try_acquire("a")), (lambda: lim.acquire("a"))


def policy(c: Any) -> tuple[Callable[[], Any], Callable[[], Any]]:
    p = AsyncRedisPolicy(c, {"user": rq.KeyedLimiter(ONE)}, name="race-p")

    async def take() -> bool:
        return await p.try_acquire(user="a") is not None

    return take, (lambda: p.acquire(user="a"))


@pytest.mark.parametrize("make", [limiter, keyed, policy])
def test_an_acquire_cancelled_as_its_command_is_written_gives_back(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, make: Any
) -> None:
    clients: list[Any] = []
    armed = [False]

    async def call() -> Any:
        c = redis_server.async_client(timeout=30.0)  # a socket timeout: sends via wait_for
        clients.append(c)
        await c.flushdb()
        await AsyncRedisLimiter(c, ONE, name="warm").try_acquire()  # the script loaded
        _, acquire = make(c)
        armed[0] = True
        return await acquire()

    cancel_when_written(monkeypatch, call, armed=lambda: armed[0])

    async def after() -> None:
        c = redis_server.async_client()
        take, _ = make(c)
        assert await take()  # given back: the one slot is free again
        await c.aclose()
        with contextlib.suppress(Exception):  # made on the closed loop
            await clients[0].aclose()

    asyncio.run(after())
