"""Grant order of asyncio waiters when the loop runs late, exact on a ManualClock.

What ``test_aio.py::test_hundred_tasks_in_real_time`` saw on a loaded machine, replayed in
virtual time: tasks that start only after every earlier waiter was granted (but before
those resume) find nobody waiting and are admitted at once. FIFO holds in schedule time:
every grant comes after the grants of earlier arrivals, spaced by the rate, and queued
tasks resume in grant order.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine
from typing import Any

import ratequeue as rq

MS = 1_000_000


def recording(
    lim: rq.Limiter,
) -> tuple[list[int], Callable[[int], Coroutine[Any, Any, rq.Permit]]]:
    """``(resumed, one)``: ``one(i)`` acquires, then appends ``i`` to ``resumed`` as the
    task resumes."""
    resumed: list[int] = []

    async def one(i: int) -> rq.Permit:
        permit = await lim.acquire_async()
        resumed.append(i)
        return permit

    return resumed, one


def test_a_task_arriving_after_the_queue_was_granted_is_admitted_after_it_in_schedule_time(
    clock: rq.ManualClock,
) -> None:
    lim = rq.Limiter(rq.Rate(200, burst=1), clock=clock)
    resumed, one = recording(lim)

    async def main() -> list[rq.Permit]:
        first = [asyncio.ensure_future(one(i)) for i in range(50)]
        await asyncio.sleep(0)
        assert lim.waiting == 49  # task 0 took the burst
        assert lim.run_until(0.245) == 49  # all granted; the loop has not woken yet
        assert lim.waiting == 0
        clock.set(1.0)  # the loop runs late: the bucket is full again
        late = [asyncio.ensure_future(one(i)) for i in range(50, 100)]
        await asyncio.sleep(0)
        assert lim.waiting == 49  # task 50 admitted at once, the others queued behind it
        assert lim.run_until(2.0) == 49
        return list(await asyncio.wait_for(asyncio.gather(*first, *late), 10))

    permits = asyncio.run(main())
    granted = [p.granted_at_ns for p in permits]
    assert granted[:50] == [i * 5 * MS for i in range(50)]
    assert granted[50:] == [1000 * MS + i * 5 * MS for i in range(50)]
    assert permits[50].waited == 0.0
    assert resumed.index(50) < resumed.index(1)  # the inversion the real-time test saw
    assert all(b > a for a, b in itertools.pairwise(granted))
    queued = [i for i in resumed if permits[i].waited > 0]
    assert queued == [*range(1, 50), *range(51, 100)]
    assert sorted(resumed) == list(range(100))
    assert lim.waiting == 0


def test_tasks_gathered_at_once_resume_in_arrival_order(clock: rq.ManualClock) -> None:
    # The same hundred tasks when the loop keeps up: every one but the first queues, and
    # they resume exactly in arrival order at the rate's spacing.
    lim = rq.Limiter(rq.Rate(200, burst=1), clock=clock)
    resumed, one = recording(lim)

    async def main() -> list[rq.Permit]:
        tasks = [asyncio.ensure_future(one(i)) for i in range(100)]
        await asyncio.sleep(0)
        assert lim.waiting == 99
        assert lim.run_until(1.0) == 99
        return list(await asyncio.wait_for(asyncio.gather(*tasks), 10))

    permits = asyncio.run(main())
    assert resumed == list(range(100))
    assert [p.granted_at_ns for p in permits] == [i * 5 * MS for i in range(100)]
    assert [round(p.waited * 1e9) for p in permits] == [i * 5 * MS for i in range(100)]
