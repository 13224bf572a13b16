"""A cancelled ``hold_async`` whose read then fails (a read timeout behind a pause, a
stalled server) still ends as a cancel and leaves no hold standing, on the ledger's own
per-loop client and on the caller's (found in review: with redis-py 8 every asyncio
connection has a 5 s socket timeout by default, so a cancel swallowed by ``wait_for``
was then followed by a ``TimeoutError`` that skipped the ending)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ratequeue as rq
import redis
import redis.asyncio
from cancel_race import cancel_at_evalsha
from ledger_backends import T0
from ledger_blocking import given_back
from ratequeue.ledger import Plan, RedisLedger
from redis_server import RedisServer


def test_the_twin_keeps_the_timeout_and_sends_without_wait_for(server: RedisServer) -> None:
    from ratequeue.redis._connection import _SendWithoutWaitFor

    client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=120)
    led = RedisLedger(client, name="t", clock=rq.ManualClock(T0))

    async def main() -> Any:
        conn = led._aclient().connection_pool.make_connection()
        return conn.socket_timeout, isinstance(conn, _SendWithoutWaitFor)

    assert asyncio.run(main()) == (120, True), f"redis-py {redis.__version__}"


@pytest.mark.parametrize("client", ["twin", "given"])
def test_a_cancelled_hold_behind_a_pause_longer_than_the_read_timeout_is_given_back(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch, client: str
) -> None:
    blocking = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=120)
    given = None
    if client == "given":  # the caller's own client: a 1 s socket timeout
        given = redis.asyncio.Redis(host="127.0.0.1", port=server.port, socket_timeout=1)
    led = RedisLedger(blocking, name="t", clock=rq.ManualClock(T0), async_client=given)
    led.set_plan("acme", Plan("pro", tokens=1000, calls=100))
    admin = redis.Redis(host="127.0.0.1", port=server.port)
    state: dict[str, Any] = {}
    cancel_at_evalsha(monkeypatch, state)
    admin.execute_command("CLIENT", "PAUSE", 8_000, "WRITE")

    async def main() -> str:
        task = asyncio.ensure_future(led.hold_async("h", "acme", input_tokens=500))
        state["task"] = task
        try:
            await task
        except BaseException as e:
            return type(e).__name__
        return "returned"

    try:
        ended = asyncio.run(main())
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    monkeypatch.undo()
    # the hold ran on the server after the pause; its ending (if any) released it
    assert ended == "CancelledError"
    # the ending runs on a worker (the hold replayed, then released): wait for it, not
    # for "nothing held", which is also true before the replay
    assert given_back(led, "redis", "acme", "h")
    assert led.balance("acme").held["tokens"] == 0
    led.close()


@pytest.mark.parametrize("client", ["twin", "given"])
def test_a_cancelled_hold_on_a_stalled_server_is_never_left_standing(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch, client: str
) -> None:
    """The server stalls (SIGSTOP) with the hold's EVALSHA in its socket buffer; the
    twin's redis-py 8 read timeout (5 s) ends the call with TimeoutError, not the
    cancel, so no ending runs; the server then runs the buffered hold: it stands.
    ``given``: the caller's own client from ``ratequeue.redis.connect_async`` (socket
    timeout 1 s, no retries), any redis-py: the swallowed cancel is followed by the read
    timeout, which ``_adrive`` hands to the flow without its swallowed() check."""
    from ratequeue.redis import connect_async

    blocking = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=120)
    given = connect_async(server.url, timeout=1.0) if client == "given" else None
    led = RedisLedger(blocking, name="s", clock=rq.ManualClock(T0), async_client=given)
    led.set_plan("acme", Plan("pro", tokens=1000, calls=100))
    state: dict[str, Any] = {}

    async def main() -> str:
        await led.charge_async("warm", "acme", input_tokens=1)  # connected, script loaded
        cancel_at_evalsha(monkeypatch, state)
        server.pause()
        task = asyncio.ensure_future(led.hold_async("h", "acme", input_tokens=500))
        state["task"] = task
        try:
            await task
        except BaseException as e:
            return type(e).__name__
        finally:
            monkeypatch.undo()
            server.resume()
        return "returned"

    try:
        ended = asyncio.run(main())
    finally:
        server.resume()
    assert ended == "CancelledError"
    # the ending runs on a worker (the hold replayed, then released): wait for it, not
    # for "nothing held", which is also true before the replay
    assert given_back(led, "redis", "acme", "h")
    assert led.balance("acme").held["tokens"] == 0
    led.close()
