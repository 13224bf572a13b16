"""Defects the history checker (tests/history.py) found outside Policy paths (issue 10).

Each was a failing test first. Timing on a ManualClock (virtual time).
"""

from __future__ import annotations

import asyncio
import threading

import ratequeue as rq
from ratequeue._ratequeue import Channel

NS = 10**9


# ---------------------------------------------------------------------------------------
# Permit.granted_at_ns: the grant's schedule time, as the library dated it. A blocking
# acquire releases the GIL before it queues, so a caller's own clock reading can be older
# than the arrival the queue saw (the threaded checker dated grants that way and reported
# over-admissions that were not).


def test_an_immediate_grant_is_dated_at_the_clock_of_the_call() -> None:
    clock = rq.ManualClock(3.25)
    lim = rq.Limiter(rq.Rate(10, burst=1), clock=clock)
    p = lim.acquire()
    assert (p.granted_at_ns, p.waited) == (clock.now_ns(), 0.0)
    kl = rq.KeyedLimiter(rq.Rate(10, burst=1), clock=clock)
    assert kl.acquire("a").granted_at_ns == clock.now_ns()
    c = rq.Concurrency(1, clock=clock)
    tp = c.try_acquire()
    assert tp is not None and tp.granted_at_ns == clock.now_ns()
    kc = rq.KeyedConcurrency(1, clock=clock)
    kp = kc.try_acquire("t")
    assert kp is not None and kp.granted_at_ns == clock.now_ns()


def test_a_queued_thread_grant_is_dated_at_its_schedule_time() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, burst=1), clock=clock)
    assert lim.try_acquire()
    got: list[rq.Permit] = []
    t = threading.Thread(target=lambda: got.append(lim.acquire(timeout=5)))
    t.start()
    while lim.waiting == 0:
        t.join(0.001)
    clock.advance(0.05)  # after the arrival, before the due time
    lim.run_until(0.35)  # the driver wakes late
    t.join(5)
    (p,) = got
    assert p.granted_at_ns == NS // 10
    assert p.granted_at_ns - round(p.waited * NS) == 0  # arrived at 0


def test_a_queued_task_grant_is_dated_at_its_schedule_time() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, burst=1), clock=clock)
    kl = rq.KeyedLimiter(rq.Rate(10, burst=1), clock=clock)

    async def main() -> tuple[rq.Permit, rq.Permit]:
        assert lim.try_acquire() and kl.try_acquire("k")
        a = asyncio.ensure_future(lim.acquire_async())
        b = asyncio.ensure_future(kl.acquire_async("k"))
        await asyncio.sleep(0)
        clock.advance(0.05)
        lim.run_until(0.3)
        kl.run_until(0.3)
        return await a, await b

    for p in asyncio.run(main()):
        assert p.granted_at_ns == NS // 10
        assert p.granted_at_ns - round(p.waited * NS) == 0
