"""The hand-written fast entries of the extension: ``Limiter.try_acquire``'s vectorcall
method, the awaitables' ``am_send`` slot (an end value without a StopIteration object)
and the loop future made without ``loop.create_future`` on asyncio's own loops.

Each keeps the behaviour of the path it shortcuts: same decisions, same errors, same
messages; the loop's own ``create_future`` is used whenever the loop overrides it.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any

import pytest
import ratequeue as rq


def manual(rate: float = 10, burst: int = 2) -> tuple[rq.ManualClock, rq.Limiter]:
    clock = rq.ManualClock()
    return clock, rq.Limiter(rq.Rate(rate, burst=burst), clock=clock)


def test_try_acquire_keeps_its_signature_and_doc() -> None:
    sig = inspect.signature(rq.Limiter.try_acquire)
    assert str(sig) == "(self, n=None, /, **costs)"
    assert (rq.Limiter.try_acquire.__doc__ or "").startswith("Admits now or returns False")


def test_the_fast_entry_decides_like_the_keyword_path() -> None:
    # Same calls on twin limiters: positional (the fast entry) against keywords (the
    # full method); every decision equal, on a clock that moves between calls.
    clock_a, a = manual(rate=5, burst=3)
    clock_b, b = manual(rate=5, burst=3)
    costs = [None, 1, 2, 0, 3, 1, None, 2, 1, 1, None, 3]
    for step, c in enumerate(costs * 5):
        got = a.try_acquire() if c is None else a.try_acquire(c)
        want = b.try_acquire(requests=1 if c is None else c)
        assert got is want, step
        if step % 3 == 2:
            clock_a.advance(0.15)
            clock_b.advance(0.15)


@pytest.mark.parametrize(
    ("call", "exc", "message"),
    [
        (lambda lim: lim.try_acquire(1, 2), TypeError, "takes from 0 to 1 positional"),
        (lambda lim: lim.try_acquire(-1), ValueError, "requests=-1 must be >= 0"),
        (lambda lim: lim.try_acquire(1.5), TypeError, "requests must be an int"),
        (lambda lim: lim.try_acquire(100), rq.CostTooLarge, "exceeds the burst"),
        (lambda lim: lim.try_acquire(2**64 - 1), rq.CostTooLarge, "exceeds the burst"),
        (lambda lim: lim.try_acquire(2**64), ValueError, "requests"),
        (lambda lim: lim.try_acquire(foo=1), TypeError, 'unexpected keyword "foo"'),
        (lambda lim: rq.Limiter.try_acquire(5), TypeError, "doesn't apply"),
        (lambda lim: rq.Limiter.try_acquire(), TypeError, "needs an argument"),
    ],
)
def test_the_fast_entry_keeps_every_error(call: Any, exc: type[Exception], message: str) -> None:
    _clock, lim = manual()
    with pytest.raises(exc, match=message):
        call(lim)
    assert lim.try_acquire(2) is True  # nothing was consumed


def test_ints_of_other_types_and_several_units_take_the_full_path() -> None:
    _clock, lim = manual(burst=3)
    with pytest.raises(TypeError, match="got bool"):
        lim.try_acquire(True)
    assert lim.try_acquire(3) is True
    clock = rq.ManualClock()
    both = rq.Limiter(rq.Rate(10, burst=2), rq.Rate(100, unit="tokens", burst=50), clock=clock)
    assert both.try_acquire(tokens=50) is True
    assert both.try_acquire(tokens=1) is False
    with pytest.raises(TypeError):
        both.try_acquire(1)  # tokens must be named


def test_the_fast_entry_defers_to_a_waiter() -> None:
    clock, lim = manual(burst=1)
    assert lim.try_acquire()

    async def main() -> None:
        waiter = asyncio.ensure_future(lim.acquire_async())
        await asyncio.sleep(0)
        assert lim.waiting == 1
        clock.advance(1.0)
        assert lim.try_acquire() is False  # the waiter is served first
        lim.run_until(clock.now())
        permit = await waiter
        assert permit.waited == pytest.approx(0.1)

    asyncio.run(main())


def test_awaiting_a_ready_acquire_gives_its_permit_each_time() -> None:
    _clock, lim = manual()

    async def main() -> None:
        ready = lim.acquire_async()
        permit = await ready
        assert isinstance(permit, rq.Permit)
        assert await ready is permit
        async with lim.acquire_async() as p:
            assert isinstance(p, rq.Permit)

    asyncio.run(main())


def test_queued_waits_end_with_their_permits_in_order() -> None:
    _clock, lim = manual(rate=10, burst=1)
    assert lim.try_acquire()

    async def main() -> list[float]:
        tasks = [asyncio.ensure_future(lim.acquire_async()) for _ in range(5)]
        await asyncio.sleep(0)
        assert lim.waiting == 5
        lim.run_until(0.5)
        return [p.waited for p in await asyncio.gather(*tasks)]

    waited = asyncio.run(main())
    assert waited == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])


def test_a_refused_wait_raises_through_the_send_slot() -> None:
    _clock, lim = manual(rate=1, burst=1)
    assert lim.try_acquire()

    async def main() -> None:
        with pytest.raises(rq.Overloaded, match="exceeds timeout"):
            await lim.acquire_async(timeout=0.5)
        assert lim.waiting == 0

    asyncio.run(main())


class CountingLoop(asyncio.SelectorEventLoop):
    """A loop whose create_future is its own: ratequeue must call it."""

    made = 0

    def create_future(self) -> asyncio.Future[Any]:
        CountingLoop.made += 1
        return super().create_future()


def test_a_loop_with_its_own_create_future_makes_the_waits_futures() -> None:
    clock, lim = manual(rate=10, burst=1)

    async def main() -> int:
        clock.advance(1.0)
        assert lim.try_acquire()
        task = asyncio.ensure_future(lim.acquire_async())
        await asyncio.sleep(0)
        lim.run_until(clock.now() + 0.1)
        await task
        return CountingLoop.made

    # A plain loop first, so the thread's cached loop is a plain one before the switch.
    asyncio.run(main())
    CountingLoop.made = 0
    loop = CountingLoop()
    try:
        before = CountingLoop.made
        made = loop.run_until_complete(main())
    finally:
        loop.close()
    assert made - before >= 1
    # And a plain loop again afterwards: no call to the other loop's create_future.
    CountingLoop.made = 0
    asyncio.run(main())
    assert CountingLoop.made == 0


def test_a_wait_driven_by_hand_sends_and_stops_like_a_coroutine() -> None:
    _clock, lim = manual(burst=1)
    assert lim.try_acquire()

    async def main() -> None:
        acq = lim.acquire_async()
        fut = acq.send(None)
        assert isinstance(fut, asyncio.Future)
        again = acq.send(None)  # resumed before its outcome: the same future
        assert again is fut
        lim.run_until(0.1)
        fut._asyncio_future_blocking = False
        permit = await fut
        with pytest.raises(StopIteration) as stop:
            next(acq)
        assert stop.value.value is permit

    asyncio.run(main())


def test_loops_in_two_threads_each_get_their_own_futures() -> None:
    # The running loop is read per thread: a wait resolves on the loop that awaited it
    # (a future of the other thread's loop would raise or never be resolved here).
    lim = rq.Limiter(rq.Rate(2_000, burst=1))
    got: list[int] = []
    errors: list[BaseException] = []

    def run() -> None:
        async def main() -> int:
            waits = asyncio.gather(*(lim.acquire_async() for _ in range(20)))
            permits = await asyncio.wait_for(waits, 20)
            return sum(isinstance(p, rq.Permit) for p in permits)

        try:
            got.append(asyncio.run(main()))
        except BaseException as e:  # reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert got == [20, 20]
