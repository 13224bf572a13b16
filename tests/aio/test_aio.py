"""acquire_async: the asyncio side of the wait queue.

Exact behaviour on a ManualClock (grants only in poll()/run_until(), called from the
loop or from a helper thread); real-time smoke tests with wide tolerances.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import threading
import time

import pytest
import ratequeue as rq

NS = 10**9


def waited_ns(permit):
    return round(permit.waited * NS)


async def settle(rounds=4):
    for _ in range(rounds):
        await asyncio.sleep(0)


async def acquire_in_task(limiter, *args, **kwargs):
    return await limiter.acquire_async(*args, **kwargs)


def manual(rate=10, burst=1, **kw):
    clock = rq.ManualClock()
    return clock, rq.Limiter(rq.Rate(rate, burst=burst), clock=clock, **kw)


# ---------------------------------------------------------------------------------------
# ManualClock: exact


def test_fast_path_and_async_with_give_a_permit():
    _clock, limiter = manual(burst=2)

    async def main():
        p = await limiter.acquire_async()
        assert isinstance(p, rq.Permit)
        assert p.waited == 0.0
        async with limiter.acquire_async() as p2:
            assert isinstance(p2, rq.Permit)
            assert p2.waited == 0.0
        assert limiter.available() == pytest.approx(0.0)

    asyncio.run(main())


def test_poll_from_the_loop_grants_in_schedule_time():
    clock, limiter = manual()
    assert limiter.try_acquire()

    async def main():
        tasks = [asyncio.ensure_future(acquire_in_task(limiter)) for _ in range(3)]
        await settle()
        assert limiter.waiting == 3
        assert limiter.poll() == pytest.approx(0.1)  # nothing due yet
        clock.set(0.25)  # late: two slots are due, granted at 0.1 and 0.2
        assert limiter.poll() == pytest.approx(0.3)
        await settle()
        assert [t.done() for t in tasks] == [True, True, False]
        assert [waited_ns(t.result()) for t in tasks[:2]] == [100_000_000, 200_000_000]
        assert limiter.next_wake() == pytest.approx(0.3)
        clock.set(0.3)
        assert limiter.poll() is None
        return await tasks[2]

    assert waited_ns(asyncio.run(main())) == 300_000_000
    assert limiter.waiting == 0


def test_run_until_from_a_helper_thread():
    _clock, limiter = manual(rate=100)
    assert limiter.try_acquire()

    async def main():
        tasks = [asyncio.ensure_future(acquire_in_task(limiter)) for _ in range(50)]
        await settle()
        assert limiter.waiting == 50
        driver = threading.Thread(target=limiter.run_until, args=(1.0,))
        driver.start()
        permits = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        driver.join()
        return permits

    permits = asyncio.run(main())
    assert [waited_ns(p) for p in permits] == [k * 10_000_000 for k in range(1, 51)]


def test_async_with_on_the_queued_path():
    _clock, limiter = manual()
    assert limiter.try_acquire()

    async def user(log):
        async with limiter.acquire_async() as permit:
            log.append(permit)

    async def main():
        log = []
        task = asyncio.ensure_future(user(log))
        await settle()
        limiter.run_until(1)
        await task
        return log

    (permit,) = asyncio.run(main())
    assert waited_ns(permit) == 100_000_000


def test_wait_timeout_on_a_manual_clock():
    _clock, limiter = manual(classes={"a": 100, "b": 1})
    assert limiter.try_acquire()

    async def main():
        hogs = [asyncio.ensure_future(acquire_in_task(limiter, priority="a")) for _ in range(20)]
        first_b = asyncio.ensure_future(acquire_in_task(limiter, priority="b"))
        timed = asyncio.ensure_future(acquire_in_task(limiter, priority="b", timeout=0.5))
        await settle()
        assert limiter.waiting == 22
        # the virtual-time driver runs in a helper thread while the loop waits
        drive = asyncio.get_running_loop().run_in_executor(None, limiter.run_until, 5.0)
        with pytest.raises(rq.WaitTimeout) as exc:
            await timed
        assert exc.value.retry_after >= 0
        await drive
        permits = await asyncio.gather(*hogs, first_b)
        return permits

    permits = asyncio.run(main())
    assert sorted(waited_ns(p) for p in permits) == [k * 100_000_000 for k in range(1, 22)]
    assert limiter.waiting == 0
    assert limiter.stats()["timed_out"] == 1


def test_cancelling_a_queued_task_leaves_no_trace():
    _clock, limiter = manual()
    assert limiter.try_acquire()

    async def main():
        tasks = [asyncio.ensure_future(acquire_in_task(limiter)) for _ in range(5)]
        await settle()
        tasks[1].cancel()
        tasks[3].cancel()
        await settle()
        assert limiter.waiting == 3
        limiter.run_until(10)
        return await asyncio.gather(*tasks, return_exceptions=True)

    out = asyncio.run(main())
    assert isinstance(out[1], asyncio.CancelledError)
    assert isinstance(out[3], asyncio.CancelledError)
    # the others take consecutive slots, as if the cancelled ones had never come
    assert [waited_ns(out[i]) for i in (0, 2, 4)] == [100_000_000, 200_000_000, 300_000_000]
    stats = limiter.stats()
    assert stats["cancelled"] == 2
    assert stats["queued_grants"] == 3


def test_cancel_after_delivery_before_resumption_gives_back_once():
    # The grant reached the task's future, but the task is cancelled (same loop
    # iteration) before it resumes: the grant is given back exactly once.
    _clock, limiter = manual()
    assert limiter.try_acquire()

    async def main():
        x = asyncio.ensure_future(acquire_in_task(limiter))
        await settle()
        limiter.run_until(0.1)  # x granted at 0.1: TAT = 0.2
        asyncio.get_running_loop().call_later(0, x.cancel)  # runs right after the drain
        await asyncio.gather(x, return_exceptions=True)
        return x

    x = asyncio.run(main())
    assert x.cancelled()
    assert limiter.waiting == 0
    # given back once: one unit free at 0.1 (and not two: burst is 1)
    assert limiter.available() == pytest.approx(1.0)
    assert limiter.try_acquire()
    assert not limiter.try_acquire()


def test_closing_the_loop_cancels_its_waiters():
    clock, limiter = manual()
    assert limiter.try_acquire()

    async def main():
        tasks = [asyncio.ensure_future(acquire_in_task(limiter)) for _ in range(10)]
        await settle()
        assert not any(t.done() for t in tasks)
        assert limiter.waiting == 10

    asyncio.run(main())  # cancels the pending tasks on the way out
    assert limiter.waiting == 0
    assert limiter.stats()["cancelled"] == 10
    clock.set(0.1)
    assert limiter.try_acquire()


def test_many_event_loops_do_not_leak_descriptors():
    # Each loop that queued gets a pipe; it must go with the loop.
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc")
    clock, limiter = manual(rate=1000)

    async def main():
        clock.advance(1)
        assert limiter.try_acquire()
        t = asyncio.ensure_future(acquire_in_task(limiter))
        await settle()
        limiter.run_until(clock.now() + 0.001)
        await t

    asyncio.run(main())
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        asyncio.run(main())
    gc.collect()
    after = len(os.listdir("/proc/self/fd"))
    assert after - before <= 4, (before, after)


def test_fast_path_awaitable_works_with_asyncio_helpers():
    # ensure_future / gather / wait_for do `yield from awaitable.__await__()`: the
    # ready-at-once awaitable must be an iterator too.
    _clock, limiter = manual(burst=3)

    async def main():
        p1 = await asyncio.wait_for(limiter.acquire_async(), 1)
        p2, p3 = await asyncio.gather(limiter.acquire_async(), limiter.acquire_async())
        return p1, p2, p3

    assert all(isinstance(p, rq.Permit) for p in asyncio.run(main()))


def test_queued_awaitable_works_with_asyncio_helpers():
    _clock, limiter = manual()
    assert limiter.try_acquire()

    async def main():
        a = asyncio.ensure_future(limiter.acquire_async())
        b = asyncio.ensure_future(limiter.acquire_async())
        await settle()
        assert limiter.waiting == 2
        limiter.run_until(1)
        return await asyncio.gather(a, b)

    assert [waited_ns(p) for p in asyncio.run(main())] == [100_000_000, 200_000_000]


# ---------------------------------------------------------------------------------------
# real time: wide tolerances


@pytest.mark.timeout(60)
def test_hundred_tasks_in_real_time():
    limiter = rq.Limiter(rq.Rate(200, burst=1))

    done: list[int] = []

    async def one(i):
        permit = await limiter.acquire_async()
        done.append(i)
        return permit

    async def main():
        t0 = time.monotonic()
        permits = await asyncio.gather(*(one(i) for i in range(100)))
        return time.monotonic() - t0, permits

    elapsed, permits = asyncio.run(main())
    # At most burst + rate * d over any window: 100 grants take 0.495 s at least; the
    # upper bound only catches a lost wake-up (a loaded machine adds seconds, not more).
    assert 0.49 <= elapsed <= 20.0, elapsed
    # FIFO: granted in arrival order, spaced by the rate (schedule time)...
    granted = [p.granted_at_ns for p in permits]
    assert all(b - a >= 5_000_000 - 1 for a, b in itertools.pairwise(granted)), granted
    # ...and the queued ones resumed in that order. A task that starts after every earlier
    # one was granted (a loop slowed down by a loaded machine) finds nobody waiting and is
    # admitted at once, maybe before the granted ones resume (exact on a ManualClock in
    # test_aio_order.py).
    queued = [i for i in done if permits[i].waited > 0]
    assert queued == sorted(queued)
    # Each waited at most its place in the schedule (a loaded loop may start late).
    assert all(0.0 <= p.waited <= 0.5 + 1e-3 for p in permits)
    assert limiter.waiting == 0


@pytest.mark.timeout(60)
def test_two_event_loops_in_two_threads_share_one_limiter():
    limiter = rq.Limiter(rq.Rate(200, burst=1))
    results = {}

    def run(name):
        async def main():
            return await asyncio.gather(*(acquire_in_task(limiter) for _ in range(50)))

        results[name] = asyncio.run(main())

    threads = [threading.Thread(target=run, args=(n,)) for n in ("x", "y")]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    elapsed = time.monotonic() - t0
    assert sorted(results) == ["x", "y"]
    assert sum(len(v) for v in results.values()) == 100
    assert 0.49 <= elapsed <= 3.0, elapsed
    assert limiter.waiting == 0
    waits = sorted(p.waited for v in results.values() for p in v)
    assert waits[-1] == pytest.approx(0.495, abs=0.1)


@pytest.mark.timeout(60)
def test_threads_and_tasks_mixed_in_real_time():
    limiter = rq.Limiter(rq.Rate(200, burst=1))
    got = []

    def worker():
        for _ in range(10):
            got.append(limiter.acquire())

    threads = [threading.Thread(target=worker) for _ in range(3)]

    async def main():
        for t in threads:
            t.start()
        return await asyncio.gather(*(acquire_in_task(limiter) for _ in range(30)))

    t0 = time.monotonic()
    permits = asyncio.run(main())
    for t in threads:
        t.join(30)
    elapsed = time.monotonic() - t0
    assert len(permits) + len(got) == 60
    assert 0.29 <= elapsed <= 3.0, elapsed
    assert limiter.waiting == 0


@pytest.mark.timeout(60)
def test_task_cancellation_in_real_time_keeps_capacity():
    limiter = rq.Limiter(rq.Rate(5, burst=1))

    async def main():
        assert limiter.try_acquire()  # next slot at +0.2 s
        t0 = time.monotonic()
        tasks = [asyncio.ensure_future(acquire_in_task(limiter)) for _ in range(10)]
        await asyncio.sleep(0.05)
        assert limiter.waiting == 10
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert all(t.cancelled() for t in tasks)
        assert limiter.waiting == 0
        # the cancelled waiters took nothing: the 0.2 s slot is still there
        p = await limiter.acquire_async()
        return time.monotonic() - t0, p

    elapsed, p = asyncio.run(main())
    assert 0.15 <= elapsed <= 0.6, elapsed
    assert p.waited <= 0.2
    assert limiter.stats()["cancelled"] == 10


@pytest.mark.timeout(60)
def test_wait_for_timeout_in_real_time_leaves_the_queue_clean():
    limiter = rq.Limiter(rq.Rate(2, burst=1))

    async def main():
        assert limiter.try_acquire()  # next slot at +0.5 s
        t0 = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(limiter.acquire_async(), 0.1)
        elapsed = time.monotonic() - t0
        assert limiter.waiting == 0
        p = await limiter.acquire_async()
        return elapsed, time.monotonic() - t0, p

    elapsed, total, permit = asyncio.run(main())
    assert 0.09 <= elapsed <= 0.4, elapsed
    assert 0.45 <= total <= 1.2, total
    assert permit.waited <= 0.45  # the timed-out waiter took nothing


@pytest.mark.timeout(60)
def test_wait_timeout_in_real_time():
    limiter = rq.Limiter(rq.Rate(10, burst=1), classes={"a": 100, "b": 1})

    async def main():
        assert limiter.try_acquire()
        hogs = [asyncio.ensure_future(acquire_in_task(limiter, priority="a")) for _ in range(8)]
        first_b = asyncio.ensure_future(acquire_in_task(limiter, priority="b"))
        await settle()
        t0 = time.monotonic()
        with pytest.raises(rq.WaitTimeout) as exc:
            await limiter.acquire_async(priority="b", timeout=0.3)
        elapsed = time.monotonic() - t0
        assert exc.value.retry_after >= 0
        await asyncio.gather(*hogs, first_b)
        return elapsed

    elapsed = asyncio.run(main())
    assert 0.28 <= elapsed <= 1.5, elapsed
    assert limiter.waiting == 0
