"""A Policy waits in its levels' queues (issue 10: a Policy barged past them).

``Policy.acquire`` and ``Policy.acquire_async`` hold every rate level for one common
grant time without passing anyone: on a level where requests wait or reservations are
promised, a reservation joins that level's queue behind them and the queue debits it at
the common time; cancelling before that time leaves the queue (the waiters behind move
up). Everything runs on a ManualClock driven by ``run_until``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ratequeue as rq
from ratequeue._ratequeue import Channel

NS = 10**9


def granted_at(ch: Channel) -> dict[int, float]:
    """Ticket -> waited seconds (arrival at 0) of every grant drained from ``ch``."""
    out = {}
    for ticket, ok, waited in ch.drain():
        assert ok
        out[ticket] = waited / NS
    return out


def backlogged(burst: int = 4) -> tuple[rq.ManualClock, rq.Limiter, Channel, int, rq.Reservation]:
    """Rate(10, burst) with its burst used at 0 s, a waiter due at 0.1 s and a
    reservation promised at 0.2 s queued."""
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, burst=burst), clock=clock)
    assert lim.try_acquire(burst)
    ch = Channel()
    ticket = lim.submit(ch)
    assert isinstance(ticket, int)
    r = lim.reserve()
    assert r.delay == pytest.approx(0.2)
    return clock, lim, ch, ticket, r


def test_policy_acquire_queues_behind_a_levels_waiter_and_promised_reservation() -> None:
    # The repro: the policy was debited at 0.1 s, ahead of the waiter (0.1 s) and
    # the reservation (0.2 s) queued before it: two grants in one slot.
    _clock, lim, ch, ticket, _r = backlogged()
    policy = rq.Policy({"api": lim})
    p = policy.acquire()
    assert p.delay == pytest.approx(0.3)
    lim.run_until(1.0)
    assert granted_at(ch) == {ticket: pytest.approx(0.1)}
    # The waiter, the reservation and the policy, each granted by the queue in turn.
    assert lim.stats()["queued_grants"] == 3


def test_units_granted_never_exceed_the_rate_with_a_policy_in_the_queue() -> None:
    clock, lim, _ch, _ticket, r = backlogged()
    policy = rq.Policy({"api": lim})
    times = [0.0] * 4 + [0.1, r.delay, policy.acquire().delay]
    lim.run_until(0.3)
    assert not lim.try_acquire(), "the slot at 0.3 s is the policy's"
    clock.advance(0.1)
    assert lim.try_acquire()
    times.append(0.4)
    times.sort()
    for i, s in enumerate(times):
        for e in times[i:]:
            n = sum(1 for t in times if s - 1e-9 <= t <= e + 1e-9)
            assert n <= 4 + 10 * (e - s) + 1e-6, (s, e, times)


def test_policy_acquire_async_queues_behind_the_waiters() -> None:
    _clock, lim, ch, ticket, _r = backlogged()
    policy = rq.Policy({"api": lim})

    async def main() -> float:
        p = await policy.acquire_async()
        return p.delay

    assert asyncio.run(main()) == pytest.approx(0.3)
    lim.run_until(1.0)
    assert granted_at(ch) == {ticket: pytest.approx(0.1)}


def test_a_keyed_level_key_waiter_is_not_passed() -> None:
    clock = rq.ManualClock()
    keyed = rq.KeyedLimiter(rq.Rate(10, burst=1), clock=clock)
    policy = rq.Policy({"user": keyed})
    got: dict[str, Any] = {}

    async def main() -> None:
        assert keyed.try_acquire("u")
        waiter = asyncio.ensure_future(keyed.acquire_async("u"))
        await asyncio.sleep(0)
        p = await policy.acquire_async(user="u")
        got["delay"] = p.delay
        keyed.run_until(1.0)
        got["waited"] = (await waiter).waited

    asyncio.run(main())
    assert got == {"delay": pytest.approx(0.2), "waited": pytest.approx(0.1)}
    # Another key is idle: granted at once.
    assert policy.acquire(user="v").delay == 0.0


def test_the_common_time_is_the_slowest_levels_and_every_level_is_held_for_it() -> None:
    clock, lim, ch, ticket, _r = backlogged(burst=1)
    keyed = rq.KeyedLimiter(rq.Rate(1, burst=2), clock=clock)
    policy = rq.Policy({"api": lim, "user": keyed})
    p = policy.acquire(user="u")
    assert p.delay == pytest.approx(0.3)
    # The idle level was debited for that time: one unit of its burst of 2 is left then.
    lim.run_until(0.3)
    assert keyed.try_acquire("u")
    assert not keyed.try_acquire("u")
    lim.run_until(1.0)
    assert granted_at(ch) == {ticket: pytest.approx(0.1)}


def test_cancel_before_the_common_time_leaves_the_queue_and_the_next_moves_up() -> None:
    _clock, lim, ch, ticket, _r = backlogged(burst=1)
    policy = rq.Policy({"api": lim})
    p = policy.acquire()
    assert p.delay == pytest.approx(0.3)
    behind = lim.submit(ch)  # due at 0.4 s behind the policy
    p.cancel()
    p.cancel()  # once
    lim.run_until(1.0)
    assert granted_at(ch) == {ticket: pytest.approx(0.1), behind: pytest.approx(0.3)}
    assert lim.stats()["waiting"] == 0


def test_cancel_after_the_common_time_keeps_the_slot() -> None:
    _clock, lim, _ch, _ticket, _r = backlogged(burst=1)
    policy = rq.Policy({"api": lim})
    p = policy.acquire()
    lim.run_until(0.3)
    p.cancel()  # the holder may have used it: kept
    assert not lim.try_acquire()
    assert lim.retry_after() == pytest.approx(0.1)


def test_a_backlog_beyond_the_timeout_is_refused_at_once_holding_nothing() -> None:
    _clock, lim, ch, ticket, _r = backlogged(burst=1)
    policy = rq.Policy({"api": lim})
    with pytest.raises(rq.Overloaded) as e:
        policy.acquire(timeout=0.25)
    assert e.value.retry_after == pytest.approx(0.05)
    assert lim.stats()["waiting"] == 2
    lim.run_until(1.0)
    assert granted_at(ch) == {ticket: pytest.approx(0.1)}
    assert lim.try_acquire()  # nothing was held


def test_a_full_level_queue_refuses_the_policy() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, burst=1), clock=clock, max_queue=1)
    policy = rq.Policy({"api": lim})
    assert lim.try_acquire()
    ch = Channel()
    lim.submit(ch)
    with pytest.raises(rq.Overloaded, match="queue is full"):
        policy.acquire()
    assert lim.stats()["waiting"] == 1


def test_a_settle_before_the_queue_grants_lowers_its_debit_and_is_not_refunded_twice() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(10, burst=1), rq.Rate(100, burst=100, unit="tokens"), clock=clock)
    policy = rq.Policy({"api": lim})
    assert lim.try_acquire(tokens=50)
    ch = Channel()
    lim.submit(ch, tokens=50)  # due at 0.1 s
    p = policy.acquire(tokens=100)
    assert p.delay == pytest.approx(1.0)  # 200 tokens at 100/s past a burst of 100
    p.settle(tokens=10)  # not yet granted: the queue's grant will debit 10, not 100
    lim.run_until(1.0)
    assert lim.available("tokens") == pytest.approx(90.0, abs=1e-6)
    p.settle(tokens=10)  # granted, and settled to 10 already: nothing more comes back
    assert lim.available("tokens") == pytest.approx(90.0, abs=1e-6)


def test_a_concurrency_level_then_the_rate_queue() -> None:
    clock, lim, _ch, _ticket, _r = backlogged(burst=1)
    slots = rq.Concurrency(1, clock=clock)
    policy = rq.Policy({"slots": slots, "api": lim})

    async def main() -> tuple[float, float]:
        first = policy.try_acquire()
        assert first is None  # the rate level has waiters
        p1 = await policy.acquire_async()
        task = asyncio.ensure_future(policy.acquire_async())
        await asyncio.sleep(0)
        assert not task.done()  # waits for the slot
        p1.release()
        for _ in range(5):
            await asyncio.sleep(0)
        p2 = await task
        return p1.delay, p2.delay

    d1, d2 = asyncio.run(main())
    assert d1 == pytest.approx(0.3)
    assert d2 == pytest.approx(0.4)


# ---------------------------------------------------------------------------------------
# the one lifecycle: every way a wait ends gives everything back, once


def two_slots() -> tuple[rq.ManualClock, rq.Concurrency, rq.KeyedConcurrency, rq.Policy]:
    clock = rq.ManualClock()
    a = rq.Concurrency(1, clock=clock)
    b = rq.KeyedConcurrency(1, clock=clock)
    return clock, a, b, rq.Policy({"a": a, "b": b})


def test_a_cancelled_async_acquire_gives_back_the_level_it_held_and_leaves_the_queue() -> None:
    _clock, a, b, policy = two_slots()
    holder = b.try_acquire("t")
    assert holder is not None

    async def main() -> None:
        task = asyncio.ensure_future(policy.acquire_async(b="t"))
        for _ in range(3):
            await asyncio.sleep(0)
        assert (a.in_use, b.in_use("t")) == (1, 1)  # holds a, waits for b
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (a.in_use, b.in_use("t")) == (0, 1)
        holder.release()
        assert b.in_use("t") == 0  # nobody left in b's queue to take it

    asyncio.run(main())


def test_an_async_acquire_timing_out_in_a_queue_holds_nothing() -> None:
    _clock, a, b, policy = two_slots()
    holder = b.try_acquire("t")
    assert holder is not None

    async def main() -> None:
        task = asyncio.ensure_future(policy.acquire_async(b="t", timeout=0.5))
        for _ in range(3):
            await asyncio.sleep(0)
        b.run_until(0.5)
        with pytest.raises(rq.WaitTimeout):
            await task
        assert (a.in_use, b.in_use("t")) == (0, 1)

    asyncio.run(main())


def test_a_loop_closed_under_a_policy_wait_gives_everything_back() -> None:
    _clock, a, b, policy = two_slots()
    holder = b.try_acquire("t")
    assert holder is not None
    loop = asyncio.new_event_loop()
    task = loop.create_task(_awaited(policy.acquire_async(b="t")))
    for _ in range(3):
        loop.run_until_complete(asyncio.sleep(0))
    assert a.in_use == 1
    loop.close()  # the task never resumes
    del task
    import gc

    gc.collect()
    assert a.in_use == 0
    holder.release()
    assert b.in_use("t") == 0


async def _awaited(aw: Any) -> Any:
    return await aw


def wait_for(pred: Any, timeout: float = 5.0) -> None:
    import time

    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.001)


def test_a_blocked_thread_is_granted_in_turn_then_an_async_with_waiter() -> None:
    import threading

    _clock, a, b, policy = two_slots()
    first = policy.acquire(b="t")
    got: list[rq.PolicyPermit] = []
    th = threading.Thread(target=lambda: got.append(policy.acquire(b="t")))
    th.start()
    wait_for(lambda: a.waiting == 1)
    first.release()
    th.join(5)
    assert len(got) == 1 and got[0].delay >= 0.0  # the time it waited
    assert (a.in_use, b.in_use("t")) == (1, 1)

    done: list[bool] = []

    async def main() -> None:
        async with policy.acquire_async(b="u") as p:  # a is taken: waits in its queue
            assert not p.released
        assert p.released
        done.append(True)

    t2 = threading.Thread(target=lambda: asyncio.run(main()))
    t2.start()
    wait_for(lambda: a.waiting == 1)
    assert not done
    got[0].release()
    t2.join(5)
    assert done == [True]
    assert (a.in_use, b.in_use("t"), b.in_use("u")) == (0, 0, 0)


def test_an_acquire_async_never_awaited_holds_nothing() -> None:
    clock = rq.ManualClock()
    slots = rq.Concurrency(1, clock=clock)
    api = rq.Limiter(rq.Rate(10, burst=1), clock=clock)
    policy = rq.Policy({"slots": slots, "api": api})
    aw = policy.acquire_async()
    del aw
    assert slots.in_use == 0
    assert api.try_acquire()


@pytest.mark.timeout(60)
def test_ctrl_c_while_a_policy_waits_in_a_queue_gives_everything_back(ctrl_c: Any) -> None:
    first = rq.Concurrency(1)
    second = rq.Concurrency(1)
    policy = rq.Policy({"first": first, "second": second})
    holder = second.acquire()
    timer = ctrl_c(0.15)
    with pytest.raises(KeyboardInterrupt):
        policy.acquire()  # holds first, waits in second's queue
    timer.join()
    assert (first.in_use, second.waiting, second.in_use) == (0, 0, 1)
    holder.release()
    assert second.in_use == 0


def test_a_keys_retry_after_counts_a_policy_share_held_for_a_later_time() -> None:
    # The policy's share on the key waits for the slow level's time (1 s): the bucket
    # cannot bank the capacity it leaves unused meanwhile, and the key's predictions
    # (retry_after, deadlines, the next policy's time) must not count it.
    clock = rq.ManualClock()
    slow = rq.Limiter(rq.Rate(1, burst=1), clock=clock)
    user = rq.KeyedLimiter(rq.Rate(5, burst=2), clock=clock)
    policy = rq.Policy({"slow": slow, "user": user})
    assert slow.try_acquire()
    assert user.try_acquire("k", 2)

    async def main() -> None:
        waiter = asyncio.ensure_future(user.acquire_async("k"))
        await asyncio.sleep(0)
        p = await policy.acquire_async(user="k")
        assert p.delay == pytest.approx(1.0)
        ra = user.retry_after("k", 2)
        user.run_until(ra)
        slow.run_until(ra)
        assert (await waiter).waited == pytest.approx(0.2)
        assert user.try_acquire("k", 2), f"refused after retry_after={ra}"

    asyncio.run(main())
