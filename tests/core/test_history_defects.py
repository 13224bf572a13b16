"""Defects the history checker found after issue 10's other work landed.

1. Queued reservations on a multi-rate Limiter were promised times closer than the
   rates allow (each rate's backlog predicted separately), and a reservation could be
   debited before its promised time when a waiter ahead left.
2. ``retry_after`` / ``predicted_wait`` with two rates were too short.
3. Cancelling (or timing out) the head waiter of a Concurrency or KeyedConcurrency did
   not grant the next waiter, though a permit was free.
"""

from __future__ import annotations

import asyncio

import pytest
import ratequeue as rq
from ratequeue._ratequeue import Channel


def two_rates(clock: rq.ManualClock) -> rq.Limiter:
    return rq.Limiter(
        rq.Rate(5, per=2, burst=1),
        rq.Rate(100, per=1, burst=100, unit="tokens"),
        clock=clock,
    )


def test_two_rate_reservations_are_at_least_one_request_interval_apart() -> None:
    c = rq.ManualClock()
    lim = two_rates(c)
    ch = Channel()
    assert lim.try_acquire(requests=1, tokens=80)
    assert isinstance(lim.submit(ch, requests=1, tokens=63), int)
    assert isinstance(lim.submit(ch, requests=1, tokens=26, timeout=1.0), int)
    r1 = lim.reserve(requests=1, tokens=68)
    c.advance(0.012)
    r2 = lim.reserve(requests=1, tokens=8)
    assert r1.at == pytest.approx(1.37, abs=1e-6)
    assert r2.at - r1.at >= 0.4 - 1e-6
    assert r2.at == pytest.approx(1.77, abs=1e-6)
    lim.run_until(3.0)
    assert lim.waiting == 0


def test_a_reservation_is_not_debited_before_its_promised_time() -> None:
    c = rq.ManualClock()
    lim = two_rates(c)
    ch = Channel()
    assert lim.try_acquire(requests=1, tokens=100)
    lim.submit(ch, requests=1, tokens=50)  # granted at 0.5 s
    # Due at 0.9 s by the joint schedule, so it times out at 0.85 s.
    lim.submit(ch, requests=1, tokens=1, timeout=0.85)
    r = lim.reserve(requests=1, tokens=1)
    assert r.at == pytest.approx(1.3, abs=1e-6)
    lim.run_until(r.at)
    assert lim.waiting == 0
    # The reservation is used at r.at: nothing else may be admitted in its slot.
    assert not lim.try_acquire(requests=1, tokens=1)
    assert lim.retry_after(requests=1, tokens=1) == pytest.approx(0.4, abs=1e-6)


def test_two_rate_retry_after_is_a_time_after_which_try_acquire_is_admitted() -> None:
    c = rq.ManualClock()
    lim = two_rates(c)
    ch = Channel()
    assert lim.try_acquire(requests=1, tokens=25)
    assert isinstance(lim.submit(ch, requests=1, tokens=87), int)
    retry = lim.retry_after(requests=1, tokens=96)
    assert retry == pytest.approx(1.23, abs=1e-6)
    assert lim.predicted_wait(requests=1, tokens=96) == pytest.approx(retry)
    lim.run_until(retry)
    assert lim.waiting == 0
    assert lim.try_acquire(requests=1, tokens=96)


async def _next_waiter_after_head_leaves(clock, level, acquire, cancel_head: bool) -> None:
    """On a ManualClock (no driver): only the queue's own decisions can grant."""
    head = asyncio.ensure_future(acquire(2, timeout=None if cancel_head else 0.2))
    await asyncio.sleep(0.01)
    nxt = asyncio.ensure_future(acquire(1, timeout=10))
    await asyncio.sleep(0.01)
    assert not nxt.done()
    if cancel_head:
        head.cancel()
    else:
        clock.advance(0.2)
        level.poll()
    permit = await asyncio.wait_for(nxt, 5)
    permit.release()
    if cancel_head:
        with pytest.raises(asyncio.CancelledError):
            await head
    else:
        with pytest.raises(rq.WaitTimeout):
            await head


@pytest.mark.parametrize("cancel_head", [True, False], ids=["cancelled", "timed-out"])
def test_concurrency_head_leaving_grants_the_next_waiter(cancel_head: bool) -> None:
    clock = rq.ManualClock()
    c = rq.Concurrency(2, clock=clock)
    held = c.try_acquire(1)
    assert held is not None

    async def acquire(n, timeout):
        return await c.acquire_async(n, timeout=timeout)

    asyncio.run(_next_waiter_after_head_leaves(clock, c, acquire, cancel_head))
    held.release()
    assert c.in_use == 0
    assert c.waiting == 0


@pytest.mark.parametrize("cancel_head", [True, False], ids=["cancelled", "timed-out"])
def test_keyed_concurrency_head_leaving_grants_the_next_waiter(cancel_head: bool) -> None:
    clock = rq.ManualClock()
    c = rq.KeyedConcurrency(2, clock=clock)
    held = c.try_acquire("k", 1)
    assert held is not None

    async def acquire(n, timeout):
        return await c.acquire_async("k", n, timeout=timeout)

    asyncio.run(_next_waiter_after_head_leaves(clock, c, acquire, cancel_head))
    held.release()
    assert c.in_use("k") == 0
