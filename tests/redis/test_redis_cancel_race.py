"""Async Redis limiter calls cancelled the moment their command is written end with
``CancelledError``: on ratequeue's own clients (``connect_async``: sends without
``asyncio.wait_for``) the cancel comes in while the reply is awaited; on a plain
``redis.asyncio`` client with a ``socket_timeout`` redis-py sends through ``wait_for``,
which on Python 3.10/3.11 swallows it, and the limiter notices (``ratequeue._cancel``)
and gives back what the reply says it took. A refusal raises the cancel, not
``Overloaded``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import ratequeue as rq
import redis.asyncio
from cancel_race import cancel_when_written
from ratequeue.redis import AsyncRedisKeyedLimiter, AsyncRedisLimiter, AsyncRedisPolicy
from redis_server import RedisServer

ONE = rq.Rate(1, per=60, burst=1)  # one slot; a reservation takes it at once


def limiter(c: Any) -> dict[str, Callable[[], Any]]:
    lim = AsyncRedisLimiter(c, ONE, name="race")
    return {"try": lim.try_acquire, "reserve": lim.reserve, "acquire": lim.acquire}


def keyed(c: Any) -> dict[str, Callable[[], Any]]:
    lim = AsyncRedisKeyedLimiter(c, ONE, name="race-k")
    return {
        "try": lambda **kw: lim.try_acquire("a"),
        "reserve": lambda **kw: lim.reserve("a", **kw),
        "acquire": lambda **kw: lim.acquire("a", **kw),
    }


def policy(c: Any) -> dict[str, Callable[[], Any]]:
    p = AsyncRedisPolicy(c, {"user": rq.KeyedLimiter(ONE)}, name="race-p")

    async def take() -> bool:
        return await p.try_acquire(user="a") is not None

    return {
        "try": take,
        "reserve": lambda **kw: p.reserve(user="a", **kw),
        "acquire": lambda **kw: p.acquire(user="a", **kw),
    }


def client(server: RedisServer, kind: str) -> Any:
    if kind == "ours":
        return server.async_client(timeout=30.0)
    return redis.asyncio.Redis(host="127.0.0.1", port=server.port, socket_timeout=30.0)


def race(
    server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    make: Any,
    kind: str,
    call: Callable[[dict[str, Callable[..., Any]]], Any],
    before: Callable[[dict[str, Callable[..., Any]]], Any] | None = None,
) -> bool:
    """Runs ``call`` cancelled as its command is written (after ``before``, not
    cancelled); then returns whether the one slot is free."""
    made: list[Any] = []
    armed = [False]

    async def main() -> Any:
        c = client(server, kind)
        made.append(c)
        await c.flushdb()
        await AsyncRedisLimiter(c, ONE, name="warm").try_acquire()  # the script loaded
        calls = make(c)
        ctx = await before(calls) if before is not None else None
        armed[0] = True
        return await call(calls) if ctx is None else await call(ctx)

    cancel_when_written(monkeypatch, main, armed=lambda: armed[0])

    async def free() -> bool:
        c = server.async_client()
        ok = bool(await make(c)["try"]())
        await c.aclose()
        with contextlib.suppress(Exception):  # made on the closed loop
            await made[0].aclose()
        return ok

    return asyncio.run(free())


KINDS = ["ours", "raw"]
MAKES = [limiter, keyed, policy]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("make", MAKES)
@pytest.mark.parametrize("what", ["acquire", "reserve"])
def test_a_reservation_cancelled_as_its_command_is_written_ends_cancelled(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, make: Any, kind: str, what: str
) -> None:
    free = race(redis_server, monkeypatch, make, kind, lambda calls: calls[what]())
    # a plain client's swallowed cancel is noticed with the reply in hand: given back;
    # on ours the cancel ends the wait for the reply, so (like any cancel during the
    # round trip) whether the script ran is unknown and its slot drains at the rate
    assert free or kind == "ours"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("make", MAKES)
def test_a_refused_acquire_cancelled_as_its_command_is_written_raises_the_cancel(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, make: Any, kind: str
) -> None:
    async def take_the_slot(calls: dict[str, Callable[..., Any]]) -> None:
        assert await calls["try"]()

    # cancel_when_written fails unless CancelledError (not Overloaded) ended the call
    race(
        redis_server,
        monkeypatch,
        make,
        kind,
        lambda calls: calls["acquire"](timeout=0),
        before=lambda calls: take_the_slot(calls),
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("make", MAKES)
def test_a_try_acquire_cancelled_as_its_command_is_written_raises_the_cancel(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, make: Any, kind: str
) -> None:
    # what it took is not known to a caller that gets the cancel: like a cancel that
    # comes in while the reply is awaited, the slot stays taken
    race(redis_server, monkeypatch, make, kind, lambda calls: calls["try"]())


@pytest.mark.parametrize("kind", KINDS)
def test_a_reservation_cancel_async_cancelled_as_it_is_written_still_gives_back(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    async def reserve(calls: dict[str, Callable[..., Any]]) -> Any:
        return await calls["reserve"]()

    # the give-back is applied and counted, then the caller's cancel raised
    assert race(
        redis_server,
        monkeypatch,
        limiter,
        kind,
        lambda r: r.cancel_async(),
        before=reserve,
    )
