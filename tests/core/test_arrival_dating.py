"""Arrivals are dated when they join the queue (the clock read under the queue's lock),
so arrival order and queue order agree: a thread that read the clock, then waited for
the lock while the clock moved and others joined, is not dated before them (history
checker, threads mode: a FIFO pass that was the dating's, not the queue's)."""

from __future__ import annotations

import threading
import time

import ratequeue as rq
from ratequeue import _ratequeue

NS = 1_000_000_000


def test_a_waiter_is_dated_when_it_joins_the_queue_not_when_it_asked_for_the_lock():
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, per="second", burst=1), clock=clock)
    assert lim.try_acquire()
    holder = threading.Thread(target=_ratequeue._hold_locks_for_test, args=(lim, 0.6))
    holder.start()
    time.sleep(0.15)
    out: dict[str, rq.Permit] = {}
    waiter = threading.Thread(target=lambda: out.setdefault("p", lim.acquire(timeout=10)))
    waiter.start()
    time.sleep(0.15)  # the waiter now waits for the queue's lock
    clock.advance(1.0)
    holder.join()
    deadline = time.monotonic() + 10
    while "p" not in out and time.monotonic() < deadline:
        lim.run_until(clock.now() + 0.5)
        waiter.join(timeout=0.05)
    waiter.join(timeout=10)
    p = out["p"]
    arrival = p.granted_at_ns - round(p.waited * NS)
    assert arrival >= 1 * NS, (p.granted_at_ns, p.waited)
    assert p.granted_at_ns >= arrival
