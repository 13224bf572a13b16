"""Review of the asyncio await lifecycle (the core's ``wait/awaiting.rs``) from Python.

Each test drives one transition where a permit could be lost or given back twice: a
policy's step failing after an earlier level was granted, a task cancelled while its
grant is in the loop's channel or after its future was resolved, ``throw()`` into an
awaitable never started, two tasks awaiting one awaitable. Timing on ManualClocks.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
import ratequeue as rq


async def settle(rounds: int = 6) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def run(awaitable: Any) -> Any:
    return await awaitable


def two_levels() -> tuple[rq.Policy, rq.Concurrency, rq.Concurrency, Any, Any]:
    outer, inner = rq.Concurrency(1), rq.Concurrency(1)
    p = rq.Policy({"outer": outer, "inner": inner})
    held_o, held_i = outer.try_acquire(), inner.try_acquire()
    assert held_o is not None and held_i is not None
    return p, outer, inner, held_o, held_i


def both_free(outer: rq.Concurrency, inner: rq.Concurrency) -> bool:
    a, b = outer.try_acquire(), inner.try_acquire()
    free = a is not None and b is not None
    for x in (a, b):
        if x is not None:
            x.release()
    return free


def test_a_policy_step_failing_in_the_host_after_a_level_grant_gives_it_back():
    """The task resumes after one level was granted and its next step fails in the host
    (here the loop's create_future raises, as a MemoryError or a KeyboardInterrupt landing
    there would): the acquire ends with that error, and the level it held goes back."""
    p, outer, inner, held_o, held_i = two_levels()
    armed = False

    class FlakyLoop(asyncio.SelectorEventLoop):
        def create_future(self) -> asyncio.Future[Any]:
            if armed:
                raise RuntimeError("the host's future failed")
            return super().create_future()

    async def main() -> None:
        nonlocal armed
        task = asyncio.ensure_future(run(p.acquire_async()))
        await settle()
        assert outer.waiting + inner.waiting == 1, "queued on one level"
        armed = True
        # Whichever level it waits on, its holder releases: the wait is granted and the
        # task resumes into its next step (the other level is still held).
        (held_o if outer.waiting else held_i).release()
        for _ in range(1000):
            await asyncio.sleep(0)  # makes no future
            if task.done():
                break
        armed = False
        with pytest.raises(RuntimeError, match="future failed"):
            await task

    loop = FlakyLoop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    gc.collect()
    for h in (held_o, held_i):
        h.release()
    assert both_free(outer, inner), "the level granted before the failed step is still held"


@pytest.mark.parametrize("resolved_first", [False, True])
def test_a_task_cancelled_while_its_grant_is_on_the_way_gives_it_back_once(resolved_first):
    """task.cancel() while the grant is in the channel (the cancel reaches the task
    first) or after the loop resolved its future (asyncio throws the cancel in instead
    of sending the result): the grant goes back exactly once."""
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, burst=1), clock=clock)
    assert lim.try_acquire()

    async def main() -> None:
        task = asyncio.ensure_future(run(lim.acquire_async()))
        await settle()
        assert lim.waiting == 1
        lim.run_until(0.1)  # granted at 0.1: the outcome is in the loop's channel
        if resolved_first:
            # Let the reader resolve the future, but cancel before the task steps.
            fut = task._fut_waiter  # type: ignore[attr-defined]
            while not fut.done():
                await asyncio.sleep(0)
            assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await settle()

    asyncio.run(main())
    gc.collect()
    assert lim.waiting == 0
    assert lim.try_acquire(), "the grant was lost"
    assert not lim.try_acquire(), "the grant was given back twice"


def test_throw_into_an_awaitable_never_started_holds_nothing():
    """throw() before the first step ends it; a later await says so and takes nothing."""
    c = rq.Concurrency(1)
    held = c.try_acquire()
    assert held is not None

    async def main() -> None:
        acq = c.acquire_async()
        it = acq.__await__()
        with pytest.raises(ValueError, match="boom"):
            it.throw(ValueError("boom"))
        with pytest.raises(RuntimeError):
            await acq
        assert c.waiting == 0

    asyncio.run(main())
    held.release()
    assert (_held1 := c.try_acquire()) is not None
    assert c.try_acquire() is None


def test_two_tasks_awaiting_one_awaitable_share_one_permit_and_one_cancel():
    """A second task awaiting the same queued awaitable waits on the same future: it
    gets the same (single) permit, never a second unit. Cancelling one of them cancels
    the shared wait for both (documented here as found; no unit is lost)."""
    c = rq.Concurrency(1)
    held = c.try_acquire()
    assert held is not None

    async def main() -> tuple[Any, Any]:
        acq = c.acquire_async()
        t1 = asyncio.ensure_future(run(acq))
        await settle()
        t2 = asyncio.ensure_future(run(acq))
        await settle()
        assert c.waiting == 1, "one waiter, however many tasks await it"
        held.release()
        r1, r2 = await asyncio.wait_for(asyncio.gather(t1, t2), 10)
        return r1, r2

    r1, r2 = asyncio.run(main())
    assert r1 is r2, "the two tasks got different permits from one acquire"
    assert c.try_acquire() is None, "one unit, held by the shared permit"
    r1.release()
    r2.release()
    assert (_held2 := c.try_acquire()) is not None
    assert c.try_acquire() is None
