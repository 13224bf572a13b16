"""A cancel that arrives the moment the Redis command has been written is never lost.

On Python 3.10 and 3.11, ``asyncio.wait_for`` returns its inner result when the outer
task is cancelled just as the inner one finishes, swallowing the cancel; redis-py's
asyncio connection sends every command through ``wait_for`` when the client has a
``socket_timeout``. A ledger call cancelled right after its EVALSHA went out then went on
waiting for the reply (behind ``CLIENT PAUSE WRITE``: the whole pause) and returned a
hold to a cancelled caller. These tests cancel at exactly that moment, deterministically,
on a real redis-server: the call must end with ``CancelledError`` at once and leave
nothing standing."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import ratequeue as rq
import redis
import redis.asyncio
from cancel_race import cancel_when_written
from ledger_backends import T0
from ledger_blocking import PAUSE_MS, given_back
from ratequeue.ledger import Plan, RedisLedger
from redis_server import RedisServer

TIMEOUT = 2 * PAUSE_MS / 1000  # the socket timeout outlasts the pause


def ledger(server: RedisServer, *, async_client: Any = None) -> Any:
    client = redis.Redis(
        host="127.0.0.1", port=server.port, socket_timeout=TIMEOUT, socket_connect_timeout=5
    )
    led = RedisLedger(client, name="c", clock=rq.ManualClock(T0), async_client=async_client)
    led.set_plan("acme", Plan("pro", tokens=1000, calls=100))
    return led


@pytest.mark.parametrize("client", ["twin", "given"])
def test_a_hold_cancelled_as_its_command_is_written_ends_at_once(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch, client: str
) -> None:
    given = None
    if client == "given":  # the caller's own asyncio client, socket timeout and all
        given = redis.asyncio.Redis(host="127.0.0.1", port=server.port, socket_timeout=TIMEOUT)
    led = ledger(server, async_client=given)
    admin = redis.Redis(host="127.0.0.1", port=server.port)
    # the twin must end at once, within a long pause; a given client's cancel is only
    # noticed with the reply, so its pause is short
    admin.execute_command("CLIENT", "PAUSE", PAUSE_MS if client == "twin" else 1_000, "WRITE")
    try:
        took = cancel_when_written(
            monkeypatch, lambda: led.hold_async("h", "acme", input_tokens=500)
        )
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    if client == "twin":
        assert took < TIMEOUT / 4, f"the cancelled hold waited {took:.1f} s for its reply"
    assert given_back(led, "redis", "acme", "h")  # finished without the loop
    assert led.balance("acme").held == {"tokens": 0, "calls": 0}
    assert led.balance("acme").used == {"tokens": 0, "calls": 0}
    led.close()


def test_a_charge_cancelled_as_its_command_is_written_counts_once_or_not_at_all(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    led = ledger(server)
    cancel_when_written(monkeypatch, lambda: led.charge_async("c1", "acme", input_tokens=7))
    # a cancelled charge may have counted (it was sent); once at most, and a retry of the
    # same id is a replay
    used = led.balance("acme").used["tokens"]
    assert used in (0, 7)
    assert led.charge("c1", "acme", input_tokens=7).tokens == 7
    assert led.balance("acme").used["tokens"] == 7
    led.close()


def test_the_twin_still_times_out_on_a_frozen_server(server: RedisServer) -> None:
    # the twin has no socket timeout of its own (no wait_for); the ledger's bound holds
    client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=0.5)
    led = RedisLedger(client, name="f", clock=rq.ManualClock(T0))
    led.set_plan("acme", Plan("pro", tokens=1000, calls=100))

    async def main() -> None:
        assert (await led.charge_async("a", "acme", input_tokens=1)).tokens == 1
        server.pause()
        try:
            t0 = time.monotonic()
            with pytest.raises(redis.exceptions.TimeoutError):
                await led.charge_async("b", "acme", input_tokens=1)
            assert time.monotonic() - t0 < 10
        finally:
            server.resume()
        assert (await led.charge_async("b", "acme", input_tokens=1)).tokens == 1
        await led.aclose()

    asyncio.run(main())
    assert led.balance("acme").used["tokens"] == 2
    led.close()
