"""asyncio waits that end without their outcome, and event loops that go away.

Every end of a queued wait other than its outcome (cancellation, GeneratorExit, a
KeyboardInterrupt or SystemExit thrown into the task, the loop closed under it, the task
or loop collected) removes the waiter or gives back the grant that raced it, exactly once,
for every kind of level. A loop's channel owns its wake-up descriptor: nothing is ever
written to a descriptor number the loop gave up. Timing runs on ManualClocks.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import ratequeue as rq
from forking import check_child, fork_child
from ratequeue._ratequeue import _wait_submit

FD_DIR = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"


def open_fds() -> set[int]:
    return {int(n) for n in os.listdir(FD_DIR)}


async def settle(rounds: int = 4) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def run(awaitable: Any) -> Any:
    return await awaitable


@dataclass
class Case:
    """One kind of level, one unit held so that the next acquire must queue."""

    acquire: Callable[[], Any]  # the awaitable of one queued acquire
    waiting: Callable[[], int]  # waiters now queued (keyed: keys whose queue is in use)
    back: Callable[[], bool]  # after the holder is done: exactly the held unit is free
    exact: bool = True  # False: `waiting` also counts awaitables still referenced


def limiter() -> Case:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, burst=1), clock=clock)
    assert lim.try_acquire()

    def back() -> bool:
        clock.set(0.1)
        lim.poll()
        return lim.try_acquire() and not lim.try_acquire()

    return Case(lim.acquire_async, lambda: lim.waiting, back)


def keyed_limiter() -> Case:
    clock = rq.ManualClock()
    lim = rq.KeyedLimiter(rq.Rate(10, burst=1), clock=clock)
    assert lim.try_acquire("u")

    def back() -> bool:
        clock.set(0.1)
        lim.poll()
        return lim.try_acquire("u") and not lim.try_acquire("u")

    return Case(lambda: lim.acquire_async("u"), lambda: lim.stats()["waiting_keys"], back, False)


def concurrency() -> Case:
    c = rq.Concurrency(1)
    held = c.try_acquire()
    assert held is not None

    def back() -> bool:
        held.release()
        return (_held1 := c.try_acquire()) is not None and c.try_acquire() is None

    return Case(c.acquire_async, lambda: c.waiting, back)


def keyed_concurrency() -> Case:
    c = rq.KeyedConcurrency(1)
    held = c.try_acquire("u")
    assert held is not None

    def back() -> bool:
        held.release()
        return (_held2 := c.try_acquire("u")) is not None and c.try_acquire("u") is None

    return Case(lambda: c.acquire_async("u"), lambda: c.stats()["waiting_keys"], back, False)


def policy() -> Case:
    # The first level admits at once; the wait is on the second, holding the first.
    outer, inner = rq.Concurrency(1), rq.Concurrency(1)
    p = rq.Policy({"outer": outer, "inner": inner})
    held = inner.try_acquire()
    assert held is not None

    def back() -> bool:
        held.release()
        return (
            (_held3 := outer.try_acquire()) is not None
            and (_held4 := inner.try_acquire()) is not None
            and outer.try_acquire() is None
            and inner.try_acquire() is None
        )

    return Case(p.acquire_async, lambda: inner.waiting, back)


KINDS = {
    "Limiter": limiter,
    "KeyedLimiter": keyed_limiter,
    "Concurrency": concurrency,
    "KeyedConcurrency": keyed_concurrency,
    "Policy": policy,
}
kinds = pytest.mark.parametrize("make", KINDS.values(), ids=KINDS.keys())


def assert_nothing_left(case: Case) -> None:
    """No waiter left, and exactly the held unit free once the holder is done."""
    if case.exact:
        assert case.waiting() == 0
    assert case.back()
    gc.collect()  # collected coroutines give back nothing twice
    assert case.waiting() == 0


@kinds
def test_a_loop_closed_with_a_pending_wait_cancels_it(make):
    case = make()
    loop = asyncio.new_event_loop()
    tasks = [loop.create_task(run(case.acquire())) for _ in range(3)]
    loop.run_until_complete(settle())
    assert case.waiting() >= 1
    loop.close()  # the tasks are still pending
    assert not any(t.done() for t in tasks)
    del tasks
    assert_nothing_left(case)


def test_a_closed_loop_writes_nothing_into_a_reused_descriptor(tmp_path):
    c = rq.Concurrency(1)
    held = c.try_acquire()
    before = open_fds()
    loop = asyncio.new_event_loop()
    task = loop.create_task(run(c.acquire_async()))
    loop.run_until_complete(settle())
    assert c.waiting == 1
    loops_fds = open_fds() - before
    loop.close()
    del loop, task
    gc.collect()
    # Take every descriptor number the loop gave up (the lowest free number comes first).
    mine: dict[int, int] = {}
    for i in range(len(loops_fds) + 64):
        fd = os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT)
        mine[fd] = fd
        if fd > max(loops_fds):
            break
    try:
        assert loops_fds <= set(mine), "the loop's descriptors are all closed"
        held.release()  # a grant now must reach no one's file
        assert all(os.fstat(fd).st_size == 0 for fd in mine)
        p = c.try_acquire()
        assert p is not None, "the permit came back"
        p.release()
        assert c.waiting == 0
    finally:
        for fd in mine:
            os.close(fd)


@kinds
def test_generator_exit_on_a_suspended_wait_leaves_the_queue(make):
    case = make()

    async def main():
        it = case.acquire().__await__()
        it.send(None)  # queued: suspended on its future
        assert case.waiting() == 1
        it.close()  # GeneratorExit, as when a closed loop's task is collected
        await settle()

    asyncio.run(main())
    assert_nothing_left(case)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
@kinds
def test_an_interrupt_thrown_into_a_waiting_task_leaves_the_queue(make, exc):
    case = make()

    async def main():
        it = case.acquire().__await__()
        it.send(None)
        with pytest.raises(exc):
            it.throw(exc())

    asyncio.run(main())
    assert_nothing_left(case)


def test_generator_exit_after_the_grant_arrived_gives_it_back_once():
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, burst=1), clock=clock)
    assert lim.try_acquire()

    async def main():
        it = lim.acquire_async().__await__()
        it.send(None)
        lim.run_until(0.1)  # granted at 0.1; the outcome waits in the loop's channel
        assert lim.waiting == 0
        it.close()
        await settle()  # the loop drains the channel: the grant goes back

    asyncio.run(main())
    assert lim.try_acquire()
    assert not lim.try_acquire()


def test_generator_exit_after_a_permit_arrived_gives_it_back_once():
    c = rq.Concurrency(1)
    held = c.try_acquire()

    async def main():
        it = c.acquire_async().__await__()
        it.send(None)
        held.release()  # granted to the waiter; the outcome waits in the channel
        it.close()
        await settle()

    asyncio.run(main())
    assert (_held5 := c.try_acquire()) is not None
    assert c.try_acquire() is None


@pytest.mark.filterwarnings("ignore:unclosed:ResourceWarning")
@kinds
def test_a_loop_and_its_task_collected_while_waiting(make):
    case = make()
    gc.collect()
    before = open_fds()
    loop = asyncio.new_event_loop()
    task = loop.create_task(run(case.acquire()))
    loop.run_until_complete(settle())
    assert case.waiting() == 1
    del loop, task  # never closed: collected with the task pending
    gc.collect()
    assert_nothing_left(case)
    assert open_fds() <= before


@kinds
def test_keyboard_interrupt_raised_in_the_loop_then_closed(make):
    case = make()
    loop = asyncio.new_event_loop()

    async def main():
        tasks = [asyncio.ensure_future(run(case.acquire())) for _ in range(3)]
        await settle()
        assert not any(t.done() for t in tasks)
        assert case.waiting() >= 1
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        loop.run_until_complete(main())
    loop.close()
    assert_nothing_left(case)


@kinds
def test_keyboard_interrupt_under_asyncio_run(make):
    case = make()

    async def main():
        tasks = [asyncio.ensure_future(run(case.acquire())) for _ in range(3)]
        await settle()
        assert not any(t.done() for t in tasks)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(main())
    assert_nothing_left(case)


@pytest.mark.timeout(120)
def test_many_loops_in_many_threads_leak_no_descriptors_and_no_waiters():
    c = rq.Concurrency(4)
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(1000, burst=1), clock=clock)
    errors: list[BaseException] = []

    async def user(level: Any, hold: float) -> None:
        async with level.acquire_async():
            await asyncio.sleep(hold)

    async def round_(k: int) -> None:
        # Some hold their permit past the close, some wait for one, some finish.
        tasks = [asyncio.ensure_future(user(c, 3600 if i < k % 4 else 0)) for i in range(6)]
        tasks += [asyncio.ensure_future(user(lim, 0)) for _ in range(3)]
        await settle()
        assert tasks

    def worker(seed: int) -> None:
        try:
            for k in range(30):
                loop = asyncio.new_event_loop()
                try:
                    loop.run_until_complete(round_(seed + k))
                finally:
                    loop.close()  # with tasks pending: waiting, or holding permits
                del loop
        except BaseException as e:
            errors.append(e)

    gc.collect()
    before = len(open_fds())
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert c.waiting == 0
    assert lim.waiting == 0
    gc.collect()  # the pending tasks' `async with` return the permits they held
    assert c.in_use == 0
    assert len(open_fds()) - before <= 2
    clock.advance(1)
    assert lim.try_acquire()


def test_a_forked_child_never_writes_to_an_inherited_descriptor(tmp_path):
    from ratequeue import aio

    c = rq.Concurrency(1)
    held = c.try_acquire()
    loop = asyncio.new_event_loop()
    task = loop.create_task(run(c.acquire_async()))
    loop.run_until_complete(settle())
    inherited = aio._channels[loop].channel
    fd = inherited.fileno()

    def child() -> None:
        os.close(fd)  # the child reuses the number for a file of its own
        mine = os.open(tmp_path / "child", os.O_RDWR | os.O_CREAT)
        assert mine == fd
        # The child starts with every permit free (the parent's are not its own).
        own = c.try_acquire()
        assert own is not None
        ticket = _wait_submit(c.acquire_async(), inherited)
        assert isinstance(ticket, int)
        own.release()  # granted to a waiter on the inherited channel
        assert os.fstat(mine).st_size == 0
        p = c.try_acquire()  # the channel handed the grant back
        assert p is not None

    check_child(fork_child(child, 20), 20)
    held.release()  # the parent's channel still works
    permit = loop.run_until_complete(asyncio.wait_for(task, 10))
    permit.release()
    loop.close()
    assert c.waiting == 0
