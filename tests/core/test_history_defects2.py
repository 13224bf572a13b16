"""Defects the history checker (tests/history.py) found outside Policy paths (issue 10).

Each was a failing test first. Timing on a ManualClock (virtual time).
"""

from __future__ import annotations

import asyncio
import itertools
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


# ---------------------------------------------------------------------------------------
# A settle that charges an overage while a queued reservation holds a promised time used
# to push the waiters ahead of it onto that time (seed 7/10, one class): the holder goes
# at its promised time, so two grants shared one slot. The overage is now debited behind
# the promised reservations: nobody is moved onto a promise, and FIFO holds.


def _gaps_ok(times: list[float], interval: float) -> bool:
    ts = sorted(times)
    return all(b - a >= interval - 1e-9 for a, b in itertools.pairwise(ts))


def test_an_overage_settled_under_a_queued_reservation_moves_nobody_onto_its_time() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, burst=1), clock=clock)  # one unit per 0.1 s
    p = lim.acquire()  # at 0
    ch = Channel()
    ticket = lim.submit(ch)  # a waiter due at 0.1
    r = lim.reserve()  # behind it: promised 0.2
    assert round(r.delay, 9) == 0.2
    p.settle(requests=2)  # one more unit for the grant at 0
    lim.run_until(0.25)
    ((t, ok, waited_ns),) = ch.drain()
    assert (t, ok) == (ticket, True)
    waiter = waited_ns / NS
    assert waiter <= r.delay  # FIFO: the waiter still goes before the reservation
    assert _gaps_ok([0.0, waiter, r.delay], 0.1)  # and never onto its promised time
    # The overage is still owed, debited behind the promise: next admission at 0.4.
    assert round(lim.retry_after(), 9) == 0.15
    assert lim.waiting == 0


def test_an_overage_and_a_waiter_ahead_leaving_keep_every_promise() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, burst=1), clock=clock)
    p = lim.acquire()
    ch = Channel()
    leaving = lim.submit(ch, timeout=0.15)  # due 0.1; leaves at 0.15 once pushed
    staying = lim.submit(ch)  # due 0.2
    r = lim.reserve()  # promised 0.3
    assert round(r.delay, 9) == 0.3
    p.settle(requests=3)  # two more units
    lim.run_until(3.0)
    grants = {t: w / NS for t, ok, w in ch.drain() if ok}
    assert staying in grants
    times = [0.0, r.delay, *grants.values()]
    assert _gaps_ok(times, 0.1), sorted(times)
    assert grants[staying] <= r.delay
    assert leaving not in grants or grants[leaving] <= grants[staying]


# ---------------------------------------------------------------------------------------
# A multi-rate limiter debits every rate at the latest rate's time, so a rate can hold a
# grant scheduled in its future that its own TAT does not reveal (it conformed earlier).
# Cancelling an older reservation then refunded units a later-scheduled grant already
# stood on (seed 7: 143 tokens in 0.4 s against 100 + 100/s).


def test_a_refund_never_frees_what_a_later_scheduled_grant_of_another_rate_stands_on() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(
        rq.Rate(5, per=2, burst=1),  # one request per 0.4 s
        rq.Rate(100, per=1, burst=100, unit="tokens"),
        clock=clock,
    )
    clock.advance(1.0)
    assert lim.try_acquire(requests=1, tokens=39)  # 1.0
    r1 = lim.reserve(requests=1, tokens=30)  # 1.4
    r2 = lim.reserve(requests=1, tokens=55)  # 1.8
    clock.advance(1.0)
    r3 = lim.reserve(requests=1, tokens=61)  # 2.2: the requests rate sets its time
    assert [round(r.at, 9) for r in (r1, r2, r3)] == [1.4, 1.8, 2.2]
    clock.advance(0.12)  # 2.12: r2's time has passed, r3's not
    r2.cancel()
    r4 = lim.reserve(requests=1, tokens=82)
    # 61 + 82 tokens within d seconds: at most 100 + 100 * d.
    d = r4.at - r3.at
    assert 100 + 100 * d + 1e-6 >= 61 + 82, (r3.at, r4.at)


# ---------------------------------------------------------------------------------------
# Several weighted classes: a queued reservation (of the first class) is promised the
# drain time of the backlog. A later arrival of another class with a smaller start tag
# used to take the slots the waiters ahead of it in its class needed, so either the
# reservation came before them (FIFO broken in its class) or it came late (its holder,
# going at the promised time, shared a slot: over-admission).


def test_several_classes_a_reservation_keeps_its_time_and_its_place() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(1, burst=1), clock=clock, classes={"hi": 1, "lo": 1})
    assert lim.try_acquire()  # the next unit at 1 s
    ch = Channel()
    hi = [lim.submit(ch, priority="hi") for _ in range(3)]
    r = lim.reserve()
    assert round(r.at, 9) == 4.0
    lo = lim.submit(ch, priority="lo")
    lim.run_until(10.0)
    got = {t: w / NS for t, ok, w in ch.drain() if ok}
    assert [got[t] for t in hi] == [1.0, 2.0, 3.0]  # FIFO, all before the reservation
    times = sorted([0.0, r.at, *got.values()])
    assert _gaps_ok(times, 1.0), times
    assert got[lo] == 5.0


def test_the_seeds_that_found_them_keep_every_promise() -> None:
    """The randomized runs that found the defects above (single mode, no Policy)."""
    import history

    only = {"try", "reserve", "wait", "finish", "cancel_task", "retry_after", "reserve_retry"}
    only.add("clock")
    for seed in (4, 6, 7, 10):
        res = history.run(seed, 10_000, "single", only=only)
        assert not res.violations, res.report()


# ---------------------------------------------------------------------------------------
# Deadlines (seed 9, threads, an epoch-based clock: the driver wakes a microsecond late).
# A semaphore grant is dated at the poll that finds a permit free; a poll after a
# waiter's deadline granted it there, past its timeout, instead of timing it out.


def test_a_permit_freed_after_a_waiters_deadline_times_it_out() -> None:
    clock = rq.ManualClock()
    c = rq.Concurrency(1, clock=clock)
    p = c.try_acquire()
    assert p is not None
    ch = Channel()
    ticket = c.submit(ch, timeout=1.0)
    clock.advance(1.5)  # no poll at the deadline (a late driver)
    p.release()
    c.poll()
    assert ch.drain() == [(ticket, False, NS)]
    assert c.in_use == 0


def test_a_key_permit_freed_after_a_waiters_deadline_times_it_out() -> None:
    clock = rq.ManualClock()
    k = rq.KeyedConcurrency(1, clock=clock)

    async def main() -> str:
        p = k.try_acquire("t")
        assert p is not None
        task = asyncio.ensure_future(k.acquire_async("t", timeout=1.0))
        await asyncio.sleep(0)
        clock.advance(1.5)  # no poll at the deadline (a late driver)
        p.release()
        try:
            q = await task
        except rq.WaitTimeout:
            return "timeout"
        return f"granted after {q.waited}"

    assert asyncio.run(main()) == "timeout"
    assert k.in_use("t") == 0


# ---------------------------------------------------------------------------------------
# A queued grant is dated at its schedule time, which may lie in the past when the
# driver wakes late. Capacity given back (here: an earlier reservation cancelled) used
# to be granted at a time before it was given back, ahead of a reservation that arrived
# first (seed 112: a waiter granted before an earlier reservation's promised time).


def test_capacity_given_back_is_never_granted_before_it_was_given() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(5, burst=4), clock=clock)  # one unit per 0.2 s, burst 4
    assert lim.try_acquire(4)
    r2 = lim.reserve(2)
    r1 = lim.reserve(1)
    assert (round(r2.at, 9), round(r1.at, 9)) == (0.4, 0.6)
    clock.advance(0.5)
    ch = Channel()
    ticket = lim.submit(ch)  # behind r1: due 0.8
    clock.advance(0.2)  # the driver has not woken yet
    assert r2.cancel()  # its time has passed; given back at 0.7
    lim.run_until(2.0)
    ((t, ok, waited_ns),) = ch.drain()
    assert (t, ok) == (ticket, True)
    granted_at = 0.5 + waited_ns / NS
    assert granted_at >= 0.7 - 1e-9  # not before the capacity came back
    assert granted_at >= r1.at  # nor before a reservation that arrived first


def test_an_overage_left_behind_a_cancelled_reservation_is_charged_without_waiting() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, burst=1), clock=clock)
    p = lim.acquire()
    ch = Channel()
    lim.submit(ch)  # due 0.1
    r = lim.reserve()  # promised 0.2
    p.settle(requests=2)  # owed behind the promise
    assert r.cancel()  # nothing is promised any more: the overage need not wait for 0.2
    lim.run_until(0.15)
    assert lim.waiting == 0
    assert round(lim.retry_after(), 9) == 0.15  # the waiter at 0.1, then the overage
