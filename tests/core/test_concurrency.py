"""Concurrency: a semaphore with the wait queue's discipline (FIFO per class, weighted
classes, bounded, exact cancellation); permits come back on release."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import ratequeue as rq


def wait_until(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.0005)


async def settle(rounds=4):
    for _ in range(rounds):
        await asyncio.sleep(0)


class Waiter:
    """A thread that acquires, records the order of its grant, and holds the permit
    until told to release it (or at once with ``hold=False``)."""

    def __init__(self, sem, name, log, n=None, hold=False, **kw):
        self.sem, self.name, self.log, self.n, self.hold, self.kw = sem, name, log, n, hold, kw
        self.permit = None
        self.error = None
        self.go = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            p = self.sem.acquire(self.n, **self.kw)
        except BaseException as e:
            self.error = e
            return
        self.permit = p
        self.log.append(self.name)
        if self.hold:
            self.go.wait(10)
        p.release()

    def start(self):
        before = self.sem.waiting
        self.thread.start()
        wait_until(lambda: not self.thread.is_alive() or self.sem.waiting == before + 1)
        return self

    def finish(self):
        self.go.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


# ---------------------------------------------------------------------------------------
# the bound


@pytest.mark.timeout(60)
def test_at_most_limit_holders_under_eight_threads():
    sem = rq.Concurrency(3)
    lock = threading.Lock()
    holders = 0
    peak = 0
    errors = []

    def worker():
        nonlocal holders, peak
        try:
            for _ in range(40):
                with sem.acquire():
                    with lock:
                        holders += 1
                        peak = max(peak, holders)
                    assert sem.in_use <= 3
                    time.sleep(0.0002)
                    with lock:
                        holders -= 1
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert peak <= 3
    assert peak >= 2  # the limit was actually exercised
    assert sem.in_use == 0
    assert sem.waiting == 0
    stats = sem.stats()
    assert stats["in_use"] == 0
    assert stats["queued_grants"] > 0


@pytest.mark.timeout(60)
def test_at_most_limit_holders_with_tasks():
    sem = rq.Concurrency(4)
    holders = 0
    peak = 0

    async def worker():
        nonlocal holders, peak
        for _ in range(10):
            async with sem.acquire_async():
                holders += 1
                peak = max(peak, holders)
                assert sem.in_use <= 4
                await asyncio.sleep(0)
                holders -= 1

    async def main():
        await asyncio.gather(*(worker() for _ in range(20)))

    asyncio.run(main())
    assert peak == 4
    assert sem.in_use == 0
    assert sem.waiting == 0


def test_permit_is_returned_when_the_body_raises():
    sem = rq.Concurrency(2)
    with pytest.raises(RuntimeError), sem.acquire() as p:
        assert sem.in_use == 1
        raise RuntimeError("boom")
    assert sem.in_use == 0
    assert p.released
    assert p.release() is False  # only once

    async def main():
        with pytest.raises(RuntimeError):
            async with sem.acquire_async(2):
                assert sem.in_use == 2
                raise RuntimeError("boom")
        assert sem.in_use == 0

    asyncio.run(main())


def test_release_is_idempotent_and_never_frees_someone_elses_permit():
    sem = rq.Concurrency(2)
    a = sem.try_acquire()
    b = sem.try_acquire()
    assert a is not None and b is not None
    assert sem.try_acquire() is None
    assert a.release() is True
    assert a.release() is False
    with a:
        pass  # exiting again releases nothing
    assert sem.in_use == 1  # b still holds
    assert (_held1 := sem.try_acquire()) is not None
    assert sem.try_acquire() is None


def test_cost_above_limit_and_zero():
    sem = rq.Concurrency(2)
    with pytest.raises(rq.CostTooLarge):
        sem.acquire(3)
    with pytest.raises(rq.CostTooLarge):
        sem.try_acquire(3)
    with pytest.raises(ValueError):
        sem.acquire(0)
    assert sem.in_use == 0


# ---------------------------------------------------------------------------------------
# queue discipline


@pytest.mark.timeout(60)
def test_thread_waiters_are_granted_in_fifo_order():
    sem = rq.Concurrency(1)
    holder = sem.acquire()
    log = []
    waiters = [Waiter(sem, i, log).start() for i in range(6)]
    assert sem.waiting == 6
    holder.release()
    for w in waiters:
        w.finish()
    assert log == list(range(6))
    assert sem.in_use == 0


def test_task_waiters_are_granted_in_fifo_order():
    sem = rq.Concurrency(2)

    async def main():
        log = []

        async def one(i):
            async with sem.acquire_async():
                log.append(i)
                await asyncio.sleep(0)

        a, b = sem.try_acquire(), sem.try_acquire()
        tasks = []
        for i in range(10):
            tasks.append(asyncio.ensure_future(one(i)))
            await asyncio.sleep(0)
        await settle()
        assert sem.waiting == 10
        a.release()
        b.release()
        await asyncio.gather(*tasks)
        return log

    assert asyncio.run(main()) == list(range(10))
    assert sem.in_use == 0


@pytest.mark.timeout(60)
def test_a_large_request_at_the_head_is_not_overtaken():
    sem = rq.Concurrency(3)
    held = [sem.acquire() for _ in range(3)]
    log = []
    big = Waiter(sem, "big", log, n=2, hold=True).start()
    small = Waiter(sem, "small", log, n=1, hold=True).start()
    held[0].release()  # one permit free: not enough for the head, and no overtaking
    time.sleep(0.05)
    assert log == []
    assert sem.try_acquire() is None  # no barging either
    assert sem.in_use == 2
    held[1].release()
    wait_until(lambda: log == ["big"])
    assert sem.in_use == 3
    held[2].release()
    wait_until(lambda: log == ["big", "small"])
    big.finish()
    small.finish()
    assert sem.in_use == 0


@pytest.mark.timeout(60)
def test_set_limit_growth_grants_waiters():
    sem = rq.Concurrency(1)
    holder = sem.acquire()
    log = []
    waiters = [Waiter(sem, i, log, hold=True).start() for i in range(3)]
    assert sem.waiting == 3
    sem.set_limit(4)
    wait_until(lambda: len(log) == 3)
    assert sorted(log) == [0, 1, 2]  # granted together; the threads log in any order
    assert sem.limit == 4
    assert sem.in_use == 4
    assert sem.waiting == 0
    # shrinking keeps the holders; newcomers wait until the count is below the limit
    sem.set_limit(2)
    late = Waiter(sem, "late", log, hold=True).start()
    assert sem.waiting == 1
    holder.release()
    waiters[0].finish()
    assert sem.in_use == 2
    time.sleep(0.02)
    assert "late" not in log
    waiters[1].finish()
    wait_until(lambda: "late" in log)
    waiters[2].finish()
    late.finish()
    assert sem.in_use == 0


def test_weighted_classes_share_the_permits():
    sem = rq.Concurrency(1, classes={"hi": 3, "lo": 1})

    async def main():
        order = []

        async def one(cls):
            async with sem.acquire_async(priority=cls):
                order.append(cls)
                await asyncio.sleep(0)

        holder = sem.try_acquire()
        tasks = []
        for _ in range(60):
            for cls in ("hi", "lo"):
                tasks.append(asyncio.ensure_future(one(cls)))
                await asyncio.sleep(0)
        await settle()
        assert sem.waiting == 120
        holder.release()
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(main())
    first = order[:80]  # both classes backlogged throughout
    assert abs(first.count("hi") - 60) <= 2, first.count("hi")
    assert order.count("lo") == 60  # nobody starves


# ---------------------------------------------------------------------------------------
# bounds, timeouts and cancellation


def test_max_queue_refuses_at_once():
    sem = rq.Concurrency(1, max_queue=2)
    holder = sem.acquire()
    log = []
    waiters = [Waiter(sem, i, log).start() for i in range(2)]
    with pytest.raises(rq.Overloaded) as exc:
        sem.acquire()
    assert exc.value.retry_after >= 0
    assert sem.stats()["refused_full"] == 1
    holder.release()
    for w in waiters:
        w.finish()
    assert sem.in_use == 0


@pytest.mark.timeout(60)
def test_timeout_on_a_manual_clock():
    clock = rq.ManualClock()
    sem = rq.Concurrency(1, clock=clock, max_wait=5.0)
    holder = sem.acquire()
    log = []
    w = Waiter(sem, "w", log, timeout=1.0).start()
    default = Waiter(sem, "default", log).start()  # max_wait=5 applies
    assert sem.waiting == 2
    clock.advance(0.999)
    sem.poll()
    assert sem.waiting == 2
    clock.advance(0.001)
    assert sem.poll() == pytest.approx(5.0)
    w.thread.join(5)
    assert isinstance(w.error, rq.WaitTimeout)
    assert w.error.retry_after >= 0
    assert sem.waiting == 1
    clock.set(5.0)
    sem.poll()
    default.thread.join(5)
    assert isinstance(default.error, rq.WaitTimeout)
    assert sem.in_use == 1
    holder.release()
    assert sem.in_use == 0
    assert sem.stats()["timed_out"] == 2


@pytest.mark.timeout(60)
def test_timeout_in_real_time():
    sem = rq.Concurrency(1)
    holder = sem.acquire()
    t0 = time.monotonic()
    with pytest.raises(rq.WaitTimeout):
        sem.acquire(timeout=0.1)
    elapsed = time.monotonic() - t0
    assert 0.09 <= elapsed <= 1.0, elapsed
    assert sem.waiting == 0
    holder.release()
    assert sem.in_use == 0

    async def main():
        holder = sem.try_acquire()
        t0 = time.monotonic()
        with pytest.raises(rq.WaitTimeout):
            await sem.acquire_async(timeout=0.1)
        holder.release()
        return time.monotonic() - t0

    assert 0.09 <= asyncio.run(main()) <= 1.0
    assert sem.in_use == 0


def test_cancelled_waiting_task_leaves_the_queue_and_takes_nothing():
    sem = rq.Concurrency(1)

    async def main():
        holder = sem.try_acquire()
        tasks = [asyncio.ensure_future(sem.acquire_async()) for _ in range(3)]
        await settle()
        assert sem.waiting == 3
        tasks[0].cancel()
        tasks[2].cancel()
        await settle()
        assert sem.waiting == 1
        holder.release()
        p = await tasks[1]
        assert sem.in_use == 1
        p.release()
        await settle()
        return tasks

    tasks = asyncio.run(main())
    assert tasks[0].cancelled() and tasks[2].cancelled()
    assert sem.in_use == 0
    assert sem.waiting == 0
    assert sem.stats()["cancelled"] == 2


def test_cancelling_a_task_inside_async_with_returns_the_permit():
    sem = rq.Concurrency(1)

    async def main():
        entered = asyncio.Event()

        async def body():
            async with sem.acquire_async():
                entered.set()
                await asyncio.sleep(3600)

        t = asyncio.ensure_future(body())
        await entered.wait()
        assert sem.in_use == 1
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        assert sem.in_use == 0

    asyncio.run(main())


def test_cancel_racing_the_grant_returns_the_permit():
    # The grant is on its way (in the loop's channel) when the task is cancelled.
    sem = rq.Concurrency(2)

    async def main():
        a, b = sem.try_acquire(), sem.try_acquire()
        t = asyncio.ensure_future(sem.acquire_async())
        await settle()
        a.release()  # grants t; the outcome is not delivered yet
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        await settle()
        assert t.cancelled()
        assert sem.in_use == 1  # b only
        assert (_held2 := sem.try_acquire()) is not None
        assert sem.try_acquire() is None
        b.release()

    asyncio.run(main())


def test_cancel_after_delivery_before_resumption_returns_the_permit_once():
    # The grant reached the task's future, but the task is cancelled in the same loop
    # iteration, before it resumes: the permit must come back exactly once.
    sem = rq.Concurrency(2)

    async def main():
        a, b = sem.try_acquire(), sem.try_acquire()
        t = asyncio.ensure_future(sem.acquire_async())
        await settle()
        a.release()  # grants t
        asyncio.get_running_loop().call_later(0, t.cancel)  # runs right after the drain
        await asyncio.gather(t, return_exceptions=True)
        assert t.cancelled()
        in_use = sem.in_use
        extra = [sem.try_acquire() for _ in range(3)]
        b.release()
        return in_use, sum(p is not None for p in extra)

    in_use, extra = asyncio.run(main())
    assert in_use == 1, f"in_use={in_use} while b still holds its permit"
    assert extra == 1  # 1 held + 1 more = the limit of 2


@pytest.mark.timeout(60)
def test_ctrl_c_while_blocked_in_acquire(ctrl_c):
    sem = rq.Concurrency(1)
    holder = sem.acquire()
    ctrl_c(0.15)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        sem.acquire()
    elapsed = time.monotonic() - t0
    assert elapsed <= 5.0, elapsed
    assert sem.waiting == 0
    assert sem.in_use == 1
    holder.release()
    assert sem.in_use == 0
    assert (_held3 := sem.try_acquire()) is not None


def test_a_permit_dropped_unreleased_gives_its_slots_back():
    """Left open at stop 42: a Concurrency permit lost before anyone could release it (a
    Ctrl-C as ``acquire`` returned it, an error before its ``with``) kept its slots for
    good. Now they go back when it is dropped, to a waiter first; a permit released
    before it is dropped gives nothing back twice; a keyed one goes back to its key."""
    import gc

    sem = rq.Concurrency(2)
    p = sem.try_acquire(2)
    assert p is not None and sem.in_use == 2
    del p
    gc.collect()
    assert sem.in_use == 0
    q = sem.try_acquire(2)
    assert q is not None and q.release()
    del q
    gc.collect()
    held = sem.try_acquire(2)
    assert held is not None and sem.try_acquire() is None  # two slots, not four

    got = []
    waiter = threading.Thread(target=lambda: got.append(sem.acquire(1, timeout=5)))
    waiter.start()
    wait_until(lambda: sem.waiting == 1)
    del held
    gc.collect()
    waiter.join(5)
    assert len(got) == 1 and sem.in_use == 1
    got.clear()
    gc.collect()
    assert sem.in_use == 0

    async def dropped_async():
        p = await sem.acquire_async(2)
        assert sem.in_use == 2
        del p

    asyncio.run(dropped_async())
    gc.collect()
    assert sem.in_use == 0

    kc = rq.KeyedConcurrency(1)
    k = kc.acquire("a")
    assert kc.in_use("a") == 1 and kc.try_acquire("a") is None
    del k
    gc.collect()
    assert kc.in_use("a") == 0
    assert (_held4 := kc.try_acquire("a")) is not None
