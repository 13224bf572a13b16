"""The wake path: a queued ``acquire_async`` is one native awaitable that yields one
future of the running loop, resolved natively in one call per batch of outcomes.

Exact behaviour on a ManualClock (grants only in ``run_until``); every way a native
wait can end settles its ticket exactly once.
"""

from __future__ import annotations

import asyncio
import gc

import pytest
import ratequeue as rq
from ratequeue import aio


def manual(rate: float = 10, burst: int = 1) -> tuple[rq.ManualClock, rq.Limiter]:
    clock = rq.ManualClock()
    return clock, rq.Limiter(rq.Rate(rate, burst=burst), clock=clock)


def test_throwing_into_a_done_awaitable_raises_what_is_thrown() -> None:
    # A defect found here: the already-done awaitable of the fast path returned the
    # thrown exception as a value (a "bad yield" for a task) instead of raising it.
    _clock, lim = manual()
    ready = lim.acquire_async()
    with pytest.raises(ValueError, match="thrown"):
        ready.throw(ValueError("thrown"))  # type: ignore[attr-defined]
    queued = lim.acquire_async()
    with pytest.raises(KeyError):
        queued.throw(KeyError("not started"))


def test_a_queued_wait_yields_one_loop_future_and_ends_with_the_permit() -> None:
    _clock, lim = manual()
    assert lim.try_acquire()

    async def main() -> None:
        acq = lim.acquire_async()
        fut = acq.send(None)
        assert isinstance(fut, asyncio.Future)
        assert fut.get_loop() is asyncio.get_running_loop()
        assert lim.waiting == 1
        lim.run_until(0.1)
        fut._asyncio_future_blocking = False  # as a task does with what it is yielded
        permit = await fut  # resolved by the loop's reader, natively
        assert permit.waited == pytest.approx(0.1)
        with pytest.raises(StopIteration) as stop:
            acq.send(None)
        assert stop.value.value is permit
        assert await acq is permit  # awaiting again gives the same permit

    asyncio.run(main())


@pytest.mark.parametrize("how", ["close", "collect"])
def test_a_wait_closed_or_collected_before_its_grant_leaves_the_queue(how: str) -> None:
    clock, lim = manual()
    assert lim.try_acquire()

    async def main() -> None:
        acq = lim.acquire_async()
        acq.send(None)
        assert lim.waiting == 1
        if how == "close":
            acq.close()
        else:
            del acq
            gc.collect()
        assert lim.waiting == 0
        assert lim.stats()["cancelled"] == 1

    asyncio.run(main())
    clock.set(0.1)
    assert lim.try_acquire()


def test_a_grant_delivered_to_a_closed_wait_goes_back_once() -> None:
    clock, lim = manual()
    assert lim.try_acquire()

    async def main() -> None:
        acq = lim.acquire_async()
        acq.send(None)
        lim.run_until(0.1)  # granted into the channel, not drained yet
        acq.close()  # decided: the reader gives the grant back
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    asyncio.run(main())
    assert lim.waiting == 0
    assert lim.available() == pytest.approx(1.0)
    assert lim.try_acquire()
    assert not lim.try_acquire()
    clock.advance(0.1)
    assert lim.try_acquire()


def test_closing_a_loop_settles_its_native_waits_granted_or_not() -> None:
    clock, lim = manual(burst=2)
    assert lim.try_acquire(2)
    loop = asyncio.new_event_loop()

    async def one() -> rq.Permit:
        return await lim.acquire_async()

    tasks = [loop.create_task(one()) for _ in range(3)]
    loop.run_until_complete(asyncio.sleep(0))
    assert lim.waiting == 3
    core = aio._channels[loop]
    assert core.pending == 3
    lim.run_until(0.1)  # one grant in the channel, never drained: the loop stops here
    assert lim.waiting == 2
    loop.close()  # nothing cancelled the tasks: the channel settles their tickets
    assert core.pending == 0
    assert lim.waiting == 0
    assert all(not t.done() for t in tasks)
    # The grant at 0.1 went back; nothing else was taken.
    assert lim.try_acquire()
    assert not lim.try_acquire()
    clock.set(0.2)
    assert lim.try_acquire()


def test_the_history_checker_sees_native_waits_as_owed() -> None:
    _clock, lim = manual()
    assert lim.try_acquire()

    async def main() -> None:
        task = asyncio.ensure_future(lim.acquire_async())
        await asyncio.sleep(0)
        core = aio._channels[asyncio.get_running_loop()]
        assert core.pending == 1
        lim.run_until(0.1)
        await task
        assert core.pending == 0

    asyncio.run(main())


def test_one_batch_resolves_every_waiter_in_fifo_order() -> None:
    _clock, lim = manual(rate=1000)
    assert lim.try_acquire()
    order: list[int] = []

    async def one(i: int) -> float:
        p = await lim.acquire_async()
        order.append(i)
        return p.waited

    async def main() -> list[float]:
        tasks = [asyncio.ensure_future(one(i)) for i in range(200)]
        await asyncio.sleep(0)
        lim.run_until(1.0)  # 200 grants, delivered in one batch
        return await asyncio.gather(*tasks)

    waited = asyncio.run(main())
    assert order == list(range(200))
    assert waited == pytest.approx([(i + 1) / 1000 for i in range(200)])


def test_real_time_batches_keep_fifo_and_cancelled_waits_give_their_places_back() -> None:
    # The driver hands a loop every grant due within its resolution (0.5 ms) in one
    # batch: 200 waiters at 20,000/s (one grant every 50 µs) are resumed through fewer
    # reader wake-ups than grants (~16 here; ~60 at 0.1 ms), in grant order; those
    # cancelled while queued (or with a grant of a batch on its way) leave exactly once.
    lim = rq.Limiter(rq.Rate(20_000, per="second", burst=1))
    assert lim.try_acquire()
    n = 200
    order: list[int] = []

    async def one(i: int) -> rq.Permit:
        p = await lim.acquire_async()
        order.append(i)
        return p

    loop = asyncio.new_event_loop()
    select = loop._selector.select  # type: ignore[attr-defined]
    self_pipe = loop._ssock.fileno()  # type: ignore[attr-defined]
    reads = [0]

    def counting(timeout: float | None = None) -> list[object]:
        events = select(timeout)
        reads[0] += sum(1 for key, _ in events if key.fd != self_pipe)
        return events

    loop._selector.select = counting  # type: ignore[attr-defined]

    async def main() -> tuple[list[object], set[int]]:
        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        await asyncio.sleep(0)
        cancelled = {i for i in range(n) if i % 7 == 3 and tasks[i].cancel()}
        got = await asyncio.gather(*tasks, return_exceptions=True)
        assert aio._channels[asyncio.get_running_loop()].pending == 0
        return got, cancelled

    try:
        got, cancelled = loop.run_until_complete(main())
    finally:
        loop.close()
    assert cancelled, "some waits were still queued when cancelled"
    for i, r in enumerate(got):
        assert isinstance(r, asyncio.CancelledError) == (i in cancelled), (i, r)
    # Grants in arrival order; those that waited resume in it too (one granted at once,
    # the queue found empty, may resume before an earlier arrival's batch is read).
    kept = [i for i in range(n) if i not in cancelled]
    assert sorted(order) == kept
    at = [got[i].granted_at_ns for i in kept]  # type: ignore[union-attr]
    assert at == sorted(at)
    queued = [i for i in order if got[i].waited > 0]  # type: ignore[union-attr]
    assert queued == sorted(queued) and len(queued) > len(kept) / 2
    assert lim.waiting == 0
    assert 0 < reads[0] < len(order)
