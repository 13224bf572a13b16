"""Fork safety (pre-fork servers): a limiter whose queue and driver thread were used in
the parent still serves waiters in a child, which needs its own driver thread.

Each child reports through its exit code (and a traceback on a pipe); the parent kills a
child that hangs, the failure holding its Python and native stacks (tests/forking.py).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import ratequeue as rq
from forking import check_child, fork_child

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)"),
    pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning"),
    pytest.mark.timeout(120),  # a hung child: its timeout, its stacks (gdb), then the failure
]

CHILD_TIMEOUT = 15


def assert_child_ok(body, timeout=CHILD_TIMEOUT):
    check_child(fork_child(body, timeout), timeout)


async def acquire_in_task(limiter, *args, **kwargs):
    return await limiter.acquire_async(*args, **kwargs)


# A waiter that must queue however late its thread or task starts on a loaded machine: it
# empties the bucket itself just before it acquires (or finds others waiting, and queues
# behind them), so only a preemption between two adjacent calls could let it pass at once.


def acquire_queued(limiter):
    limiter.try_acquire()
    return limiter.acquire()


async def acquire_queued_in_task(limiter):
    limiter.try_acquire()
    return await limiter.acquire_async()


def use_in_parent(limiter, n=6):
    """Queued waits from threads and from a task, so the driver thread has run and an
    event-loop channel exists in the parent."""
    threads = [threading.Thread(target=acquire_queued, args=(limiter,)) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)

    async def main():
        return await asyncio.gather(*(acquire_queued_in_task(limiter) for _ in range(n)))

    permits = asyncio.run(main())
    assert any(p.waited > 0 for p in permits)
    assert limiter.waiting == 0


def waits_in_child(limiter, n=5, per_wait=0.05):
    """Blocking and asyncio waiters in the child, each needing real queued waits."""
    t0 = time.monotonic()
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(acquire_queued(limiter))) for _ in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(results) == n, "thread waiters did not complete in the child"
    assert any(p.waited > 0 for p in results)

    async def main():
        return await asyncio.wait_for(
            asyncio.gather(*(acquire_queued_in_task(limiter) for _ in range(n))), 10
        )

    permits = asyncio.run(main())
    assert len(permits) == n
    assert any(p.waited > 0 for p in permits)
    # main-thread blocking acquire (the signal-checking path) too
    p = acquire_queued(limiter)
    assert p.waited > 0
    # A lower bound only: a loaded machine makes the waits longer, never shorter.
    elapsed = time.monotonic() - t0
    assert elapsed >= (2 * n) * per_wait * 0.9, elapsed
    assert limiter.waiting == 0


def test_child_waits_after_the_parent_used_the_queue():
    limiter = rq.Limiter(rq.Rate(20, burst=1))
    use_in_parent(limiter)
    assert_child_ok(lambda: waits_in_child(limiter))
    # the parent still works afterwards
    use_in_parent(limiter, n=3)


def test_child_waits_while_a_parent_thread_was_waiting_at_fork():
    # The parent's driver thread is asleep until the parent waiter's slot when the
    # process forks: the child has no driver thread and must start its own.
    limiter = rq.Limiter(rq.Rate(20, burst=1))
    use_in_parent(limiter, n=2)
    limiter.try_acquire()  # empty the bucket, if it was not
    done = []
    for _ in range(3):
        th = threading.Thread(target=lambda: done.append(limiter.acquire()))
        th.start()
    deadline = time.monotonic() + 5
    while limiter.waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.001)

    def child():
        # the inherited waiters have no thread here; the child's own still complete
        waits_in_child(limiter)

    assert_child_ok(child)
    deadline = time.monotonic() + 10
    while len(done) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(done) == 3
    assert limiter.waiting == 0


def test_child_waits_while_a_parent_task_was_waiting_at_fork():
    limiter = rq.Limiter(rq.Rate(20, burst=1))
    results = []

    def parent_loop():
        async def main():
            return await asyncio.gather(*(acquire_in_task(limiter) for _ in range(10)))

        results.extend(asyncio.run(main()))

    th = threading.Thread(target=parent_loop)
    th.start()
    deadline = time.monotonic() + 5
    while limiter.waiting < 5 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert_child_ok(lambda: waits_in_child(limiter))
    th.join(10)
    assert len(results) == 10


def test_child_deadlines_are_kept_by_its_own_driver():
    sem = rq.Concurrency(1)
    with sem.acquire(), pytest.raises(rq.WaitTimeout):
        sem.acquire(timeout=0.05)  # the parent's driver expires it

    def child():
        holder = sem.acquire()
        t0 = time.monotonic()
        try:
            sem.acquire(timeout=0.2)
        except rq.WaitTimeout:
            pass
        else:
            raise AssertionError("no WaitTimeout in the child")
        elapsed = time.monotonic() - t0
        assert 0.15 <= elapsed <= 2.0, elapsed
        holder.release()
        assert sem.in_use == 0
        assert sem.waiting == 0

    assert_child_ok(child)
    assert sem.in_use == 0


def test_child_rate_limit_is_the_parents_state():
    # The bucket is memory: the child inherits what the parent consumed (the same
    # budget is not duplicated for the waiters, only copied).
    limiter = rq.Limiter(rq.Rate(1, burst=2))
    assert limiter.try_acquire(2)

    def child():
        assert not limiter.try_acquire()
        assert limiter.retry_after() > 0.5

    assert_child_ok(child)


def test_child_try_acquire_is_not_blocked_forever_by_an_inherited_waiter():
    # The parent's waiter has no thread in the child: the child drops it, otherwise
    # try_acquire (no barging) would stay False forever in a child that never waits.
    limiter = rq.Limiter(rq.Rate(10, burst=1))
    assert limiter.try_acquire()
    th = threading.Thread(target=limiter.acquire)
    th.start()
    deadline = time.monotonic() + 5
    while limiter.waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.001)

    def child():
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            if limiter.try_acquire():
                return
            time.sleep(0.01)
        raise AssertionError(f"try_acquire stayed False; waiting={limiter.waiting}")

    try:
        assert_child_ok(child)
    finally:
        th.join(10)


def test_fork_while_other_threads_use_the_queue_never_deadlocks_the_child():
    limiter = rq.Limiter(rq.Rate(20_000, burst=1))
    stop = threading.Event()

    def worker():
        while not stop.is_set():
            limiter.acquire()

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(6)]
    for w in workers:
        w.start()

    def child():
        for _ in range(3):
            limiter.acquire()

    try:
        for _ in range(40):
            assert_child_ok(child, timeout=5)  # a deadlocked child fails quickly
    finally:
        stop.set()
        for w in workers:
            w.join(10)
