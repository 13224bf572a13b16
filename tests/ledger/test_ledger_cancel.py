"""Cancelling an asyncio caller never loses a correction: against both backends, each
async twin is cancelled while its call waits behind a blocked writer (SQLite: a
transaction of another thread; Redis: ``CLIENT PAUSE WRITE``). A settle or release
then still runs to completion; a charge completes or provably counted nothing; a hold
is never left standing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import ratequeue as rq
from ledger_backends import Factory
from ledger_blocking import (
    CLIENT_TIMEOUT,
    cancel_while_blocked,
    eventually,
    given_back,
)
from ratequeue.ledger import LedgerBase, Plan

PRO = Plan("pro", tokens=1000, calls=100)


def setup(make: Factory, clock: rq.ManualClock) -> LedgerBase:
    led = make(clock, redis_timeout=CLIENT_TIMEOUT)
    led.set_plan("acme", PRO)
    return led


def test_a_cancelled_settle_still_settles(make: Factory, clock: rq.ManualClock) -> None:
    led = setup(make, clock)
    led.hold("h", "acme", input_tokens=500)
    cancel_while_blocked(
        led, make.backend, lambda: led.settle_async("h", input_tokens=20, output_tokens=10)
    )
    assert eventually(lambda: led.balance("acme").held["tokens"] == 0)
    b = led.balance("acme")
    assert b.used == {"tokens": 30, "calls": 1}
    assert led.settle("h", input_tokens=20, output_tokens=10).replay


def test_a_cancelled_settle_without_a_hold_still_charges(
    make: Factory, clock: rq.ManualClock
) -> None:
    led = setup(make, clock)
    cancel_while_blocked(
        led,
        make.backend,
        lambda: led.settle_async("s", input_tokens=7, output_tokens=0, account="acme"),
    )
    assert eventually(lambda: led.balance("acme").used["tokens"] == 7)
    assert led.settle("s", input_tokens=7, output_tokens=0, account="acme").replay


def test_a_cancelled_release_still_gives_back(make: Factory, clock: rq.ManualClock) -> None:
    led = setup(make, clock)
    led.hold("h", "acme", input_tokens=500)
    cancel_while_blocked(led, make.backend, lambda: led.release_async("h"))
    assert eventually(lambda: led.balance("acme").held["tokens"] == 0)
    assert led.balance("acme").used == {"tokens": 0, "calls": 0}


def test_a_cancelled_charge_counts_once_or_not_at_all(make: Factory, clock: rq.ManualClock) -> None:
    led = setup(make, clock)
    cancel_while_blocked(led, make.backend, lambda: led.charge_async("c", "acme", input_tokens=5))
    # it either completes (a retry is a replay) or provably counted nothing (a retry
    # counts it for the first time); in both cases exactly once after the retry
    time.sleep(0.2)
    again = led.charge("c", "acme", input_tokens=5)
    assert eventually(lambda: led.balance("acme").used == {"tokens": 5, "calls": 1})
    assert led.charge("c", "acme", input_tokens=5).replay
    assert again.tokens == 5


def test_a_cancelled_hold_is_never_left_standing(make: Factory, clock: rq.ManualClock) -> None:
    led = setup(make, clock)
    cancel_while_blocked(led, make.backend, lambda: led.hold_async("h", "acme", input_tokens=500))
    assert given_back(led, make.backend, "acme", "h")
    assert led.balance("acme").held == {"tokens": 0, "calls": 0}
    assert led.balance("acme").used == {"tokens": 0, "calls": 0}


def test_a_settle_cancelled_on_a_loop_that_then_closes_never_hangs(
    make: Factory, clock: rq.ManualClock
) -> None:
    led = setup(make, clock)
    for i in range(5):
        led.hold(f"h{i}", "acme", input_tokens=100)

    def settle_all() -> Coroutine[Any, Any, Any]:
        async def run() -> None:
            await asyncio.gather(
                *(led.settle_async(f"h{i}", input_tokens=1, output_tokens=1) for i in range(5))
            )

        return run()

    cancel_while_blocked(led, make.backend, settle_all)
    assert eventually(lambda: led.balance("acme").held["tokens"] == 0)
    assert led.balance("acme").used == {"tokens": 10, "calls": 5}
