"""Pool.acquire_async has the shape of the other asyncio entry points: an awaitable and
async context manager (``PoolAcquiring``) whose channel hook is private; no public
method of the pool takes the internal ``Channel``."""

from __future__ import annotations

import asyncio
import gc
import inspect
import warnings
from collections.abc import Coroutine

import pytest
import ratequeue as rq
from ratequeue._ratequeue import Channel


def pool_of(clock: rq.ManualClock, *names: str, max_wait: float | None = 5.0) -> rq.Pool:
    providers = [rq.Provider(n, rpm=60, burst=1, clock=clock) for n in names]
    return rq.Pool(providers, clock=clock, max_wait=max_wait)


def test_no_public_method_takes_a_channel() -> None:
    assert not hasattr(rq.Pool, "submit")
    for cls in (rq.Pool, rq.PoolAcquiring, rq.Provider):
        for name, member in inspect.getmembers(cls, callable):
            if name.startswith("_") and name not in ("__init__", "__aenter__", "__aexit__"):
                continue
            hints = str(inspect.signature(member))
            assert "Channel" not in hints, f"{cls.__name__}.{name}{hints}"


def test_acquire_async_is_a_pool_acquiring_and_a_coroutine(clock: rq.ManualClock) -> None:
    pool = pool_of(clock, "a")
    acq = pool.acquire_async()
    assert isinstance(acq, rq.PoolAcquiring)
    assert isinstance(acq, Coroutine)
    assert asyncio.iscoroutine(acq)
    acq.close()  # never started: nothing to end, nothing routed
    assert pool.stats()["a"]["routed"] == 0


def test_one_never_awaited_routes_nothing_and_does_not_warn(clock: rq.ManualClock) -> None:
    pool = pool_of(clock, "a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool.acquire_async()
        gc.collect()
    assert pool.stats()["a"]["routed"] == 0
    assert pool["a"].limiter.try_acquire()  # the capacity is still there


def test_await_gives_provider_and_permit(clock: rq.ManualClock) -> None:
    pool = pool_of(clock, "a", "b")

    async def main() -> list[str]:
        got = [await pool.acquire_async(), await pool.acquire_async()]
        return sorted(p.name for p, permit in got if isinstance(permit, rq.Permit))

    assert asyncio.run(main()) == ["a", "b"]


def test_create_task_accepts_it_and_it_waits_for_the_grant(clock: rq.ManualClock) -> None:
    pool = pool_of(clock, "a")

    async def main() -> float:
        await pool.acquire_async()
        task = asyncio.create_task(pool.acquire_async())
        while not pool["a"].limiter.waiting:
            await asyncio.sleep(0)
        pool["a"].limiter.run_until(1.0)
        _, permit = await asyncio.wait_for(task, 5)
        return permit.waited

    assert asyncio.run(main()) == pytest.approx(1.0)


def test_async_with_releases_the_permit_at_exit(clock: rq.ManualClock) -> None:
    pool = pool_of(clock, "a")

    async def main() -> tuple[bool, bool, str]:
        async with pool.acquire_async() as (provider, permit):
            inside = permit.released
        return inside, permit.released, provider.name

    inside, after, name = asyncio.run(main())
    assert (inside, after, name) == (False, True, "a")


def test_async_with_raises_the_refusal_and_releases_nothing(clock: rq.ManualClock) -> None:
    pool = pool_of(clock, "a", max_wait=0.1)

    async def main() -> None:
        await pool.acquire_async()
        with pytest.raises(rq.PoolOverloaded):
            async with pool.acquire_async():
                pytest.fail("entered without a permit")

    asyncio.run(main())


def test_cancelling_a_queued_wait_leaves_the_queue(clock: rq.ManualClock) -> None:
    pool = pool_of(clock, "a")

    async def main() -> None:
        await pool.acquire_async()
        task = asyncio.create_task(pool.acquire_async())
        while not pool["a"].limiter.waiting:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pool["a"].limiter.waiting == 0

    asyncio.run(main())
    clock.advance(1.0)
    assert pool["a"].limiter.try_acquire()  # the cancelled wait took nothing


def test_throw_before_the_start_raises_and_routes_nothing(clock: rq.ManualClock) -> None:
    pool = pool_of(clock, "a")
    acq = pool.acquire_async()
    with pytest.raises(KeyboardInterrupt):
        acq.throw(KeyboardInterrupt)
    with pytest.raises(ValueError, match="x"):
        pool.acquire_async().throw(ValueError, ValueError("x"), None)
    assert pool.stats()["a"]["routed"] == 0
    assert pool["a"].limiter.try_acquire()


def test_the_private_hook_queues_on_a_channel_of_its_own(clock: rq.ManualClock) -> None:
    pool = pool_of(clock, "a")
    ch = Channel()
    p, permit = pool.acquire_async()._submit(ch)
    assert (p.name, isinstance(permit, rq.Permit)) == ("a", True)
    p, ticket = pool.acquire_async(timeout=2.0)._submit(ch)
    assert isinstance(ticket, int)
    pool["a"].limiter.run_until(1.0)
    assert [(t, granted) for t, granted, _ in ch.drain()] == [(ticket, True)]
    assert pool.on_grant(p) is True
    assert pool.stats()["a"]["sent"] == 2
