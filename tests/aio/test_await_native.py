"""The await lifecycle in the core, seen from asyncio: a policy's queued waits are
native like a limiter's (one future per level, resolved by the loop's reader, the leave
rule of ``wait/awaiting.rs``), and ``Pool.acquire_async`` awaits without a coroutine in
between. Everything runs on a ManualClock.
"""

from __future__ import annotations

import asyncio

import pytest
import ratequeue as rq


def two_slots() -> tuple[rq.Concurrency, rq.Concurrency, rq.Policy]:
    clock = rq.ManualClock()
    a = rq.Concurrency(1, clock=clock)
    b = rq.Concurrency(1, clock=clock)
    return a, b, rq.Policy({"a": a, "b": b})


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_policy_waits_level_by_level_each_one_future_resolved_natively() -> None:
    a, b, policy = two_slots()
    ha, hb = a.try_acquire(), b.try_acquire()
    assert ha is not None and hb is not None

    async def main() -> None:
        acq = policy.acquire_async()
        steps = acq.__await__()
        first = steps.send(None)
        assert isinstance(first, asyncio.Future)
        ha.release()  # a's queue grants the acquire
        await settle()
        assert first.done() and first.result() is None  # a level's grant: more to come
        second = steps.send(None)
        assert isinstance(second, asyncio.Future) and second is not first
        assert (a.in_use, b.waiting) == (1, 1)
        hb.release()
        await settle()
        with pytest.raises(StopIteration) as stop:
            steps.send(None)
        permit = stop.value.value
        assert isinstance(permit, rq.PolicyPermit)
        assert (a.in_use, b.in_use) == (1, 1)
        permit.release()
        assert (a.in_use, b.in_use) == (0, 0)

    asyncio.run(main())


def test_a_policy_task_cancelled_after_a_levels_grant_before_resuming_gives_it_back() -> None:
    a, b, policy = two_slots()
    ha, hb = a.try_acquire(), b.try_acquire()
    assert ha is not None and hb is not None

    async def main() -> None:
        task = asyncio.ensure_future(policy.acquire_async())
        await settle()
        assert a.waiting == 1
        ha.release()  # granted to the task's wait on a, its outcome on the way
        task.cancel()  # before the task resumes
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (a.in_use, b.in_use, a.waiting, b.waiting) == (0, 1, 0, 0)

    asyncio.run(main())


def test_a_policy_awaited_twice_at_once_is_refused_and_the_first_goes_on() -> None:
    a, b, policy = two_slots()
    ha = a.try_acquire()
    assert ha is not None

    async def main() -> None:
        acq = policy.acquire_async()
        task = asyncio.ensure_future(acq)
        await settle()
        ha.release()
        permit = await task
        assert isinstance(permit, rq.PolicyPermit)
        assert await acq is permit  # awaited again: the same permit
        permit.release()
        assert (a.in_use, b.in_use) == (0, 0)

    asyncio.run(main())


def test_a_pool_acquiring_is_awaited_once() -> None:
    clock = rq.ManualClock()
    pool = rq.Pool([rq.Provider("p", rpm=60, burst=5, clock=clock)], clock=clock)

    async def main() -> None:
        acq = pool.acquire_async()
        provider, permit = await acq
        assert provider.name == "p" and not permit.released
        with pytest.raises(RuntimeError, match="already awaited"):
            await acq
        async with pool.acquire_async() as (_, second):
            assert not second.released
        assert second.released

    asyncio.run(main())
