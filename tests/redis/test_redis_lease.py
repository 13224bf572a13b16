"""Leases: a slice of a Redis bucket served locally, the unused part given back, and the
documented bound on admissions: over any window of length d, at most
burst + rate * d + N * L (N lease holders, L units per lease); over a run that starts
from a full bucket, at most burst + rate * d."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import numpy as np
import pytest
import ratequeue as rq
import redis
from forking import check_child, fork_child
from ratequeue.redis import AsyncRedisLimiter, RedisLimiter
from redis_server import RedisServer


def leased(r: redis.Redis, clock: rq.ManualClock | None, **kw: object) -> RedisLimiter:
    args: dict[str, object] = {"name": "lease", "lease": 0.1, "clock": clock}
    args.update(kw)
    rates = args.pop("rates", [rq.Rate(100, per=1, burst=100)])
    return RedisLimiter(r, *rates, **args)  # type: ignore[arg-type]


def test_lease_serves_locally_and_gives_back(r: redis.Redis) -> None:
    clock = rq.ManualClock()
    lim = leased(r, clock)
    peek = RedisLimiter(r, rq.Rate(100, per=1, burst=100), name="lease", clock=clock)
    assert lim.try_acquire()
    assert peek.available() == 90  # one call took a lease of 10 units
    calls = lim.stats()["redis_calls"]
    assert all(lim.try_acquire() for _ in range(9))
    assert lim.stats()["redis_calls"] == calls  # served by the local bucket
    assert lim.try_acquire()  # the 11th renews
    assert peek.available() == 80
    lim.close()  # 9 unused units, still ahead: given back
    assert peek.available() == 89
    assert lim.stats()["leases"] == 2


def test_only_the_part_still_ahead_is_given_back(r: redis.Redis) -> None:
    clock = rq.ManualClock()
    lim = leased(r, clock)
    peek = RedisLimiter(r, rq.Rate(100, per=1, burst=100), name="lease", clock=clock)
    for _ in range(3):
        assert lim.try_acquire()
    clock.advance(0.05)  # 5 of the lease's 10 slots have passed
    lim.close()  # gives back 5 (7 unused, but 2 of them lie in the past)
    assert peek.available() == 100
    # A lease whose time has passed gives nothing back.
    lim.try_acquire()
    clock.advance(0.5)
    lim.close()
    assert peek.available() == 100


def test_lease_ttl_renews(r: redis.Redis) -> None:
    clock = rq.ManualClock()
    lim = leased(r, clock, lease_ttl=0.2)
    peek = RedisLimiter(r, rq.Rate(100, per=1, burst=100), name="lease", clock=clock)
    assert lim.try_acquire()
    clock.advance(0.3)
    assert lim.try_acquire()  # expired: unused part returned, a new lease taken
    assert lim.stats()["leases"] == 2
    assert peek.available() == 90
    with pytest.raises(ValueError, match="lease_ttl"):
        leased(r, clock, lease_ttl=0)


def test_lease_several_units(r: redis.Redis) -> None:
    clock = rq.ManualClock()
    rates = [rq.Rate(10, per=1, burst=10), rq.Rate(1000, per=1, unit="tokens")]
    lim = leased(r, clock, rates=rates, lease=0.5)
    peek = RedisLimiter(r, *rates, name="lease", clock=clock)
    assert lim.try_acquire(tokens=300)  # lease: 5 requests, 500 tokens
    assert lim.try_acquire(tokens=200)
    assert peek.available() == 5 and peek.available("tokens") == 500
    assert lim.try_acquire(tokens=400)  # renewal: 0 tokens left locally
    assert lim.try_acquire(tokens=1000) is False  # needs the whole burst: not there
    with pytest.raises(rq.CostTooLarge):
        lim.try_acquire(tokens=1001)
    permit = lim.acquire(tokens=10)
    assert permit.waited == 0  # from the lease
    lim.close()


def test_lease_refuses_with_nothing_left(r: redis.Redis) -> None:
    clock = rq.ManualClock()
    lim = leased(r, clock, rates=[rq.Rate(10, per=1, burst=4)], lease=0.5)
    assert [lim.try_acquire() for _ in range(5)] == [True, True, True, True, False]
    assert lim.retry_after() == pytest.approx(0.1)
    assert lim.acquire().waited == pytest.approx(0.1)  # waiting goes to Redis directly


def worst_window(times: list[float], burst: int, rate: float) -> float:
    """max over windows [t_i, t_j] of admitted - (burst + rate * (t_j - t_i))."""
    t = np.sort(np.asarray(times))
    worst = -np.inf
    for i in range(len(t)):
        counts = np.arange(1, len(t) - i + 1)
        worst = max(worst, float(np.max(counts - burst - rate * (t[i:] - t[i]))))
    return worst


@pytest.mark.parametrize("seed", range(4))
def test_bound_with_several_holders(r: redis.Redis, seed: int) -> None:
    rng = random.Random(seed)
    clock = rq.ManualClock()
    rate, burst, n = 200, 40, 4
    holders = [
        RedisLimiter(
            r,
            rq.Rate(rate, per=1, burst=burst),
            name=f"bound{seed}",
            lease=0.25,
            lease_ttl=rng.choice([0.05, 0.2, 1.0]),
            clock=clock,
        )
        for _ in range(n)
    ]
    lease_units = 10
    times: list[float] = []
    for _ in range(1500):
        clock.advance(rng.choice([0.0, 0.0, 0.0005, 0.002, 0.01]))
        h = rng.randrange(n)
        if rng.random() < 0.02:
            holders[h].close()
        elif holders[h].try_acquire():
            times.append(clock.now())
    elapsed = clock.now()
    assert len(times) <= burst + rate * elapsed  # from a full bucket: no overshoot at all
    assert worst_window(times, burst, rate) <= n * lease_units + 1e-6


def test_the_bound_is_reached_by_idle_holders(r: redis.Redis) -> None:
    """Holders that took leases and went idle while the bucket refilled can spend their
    leases on top of a full bucket: N * L more than burst at one instant, and no more."""
    clock = rq.ManualClock()
    rate, burst, n, lease_units = 200, 40, 4, 10
    holders = [
        RedisLimiter(r, rq.Rate(rate, per=1, burst=burst), name="idle", lease=0.25, clock=clock)
        for _ in range(n)
    ]
    for h in holders:
        assert h.try_acquire()  # each takes a lease of 10 and uses 1
    clock.advance(burst / rate)  # the bucket is full again; the leases are still held
    spent = sum(h.try_acquire() for _ in range(30) for h in holders)
    assert spent == burst + n * (lease_units - 1)
    times = [0.0] * n + [clock.now()] * spent
    assert worst_window(times, burst, rate) == n * (lease_units - 1)


def test_give_back_after_another_give_back_is_conservative(r: redis.Redis) -> None:
    """A give-back moves later leases earlier in the schedule; their recorded places are
    then stale, so they give nothing back (rather than too much)."""
    clock = rq.ManualClock()
    rate = rq.Rate(100, per=1, burst=30)
    a, b = (RedisLimiter(r, rate, name="v", lease=1 / 3, clock=clock) for _ in range(2))
    peek = RedisLimiter(r, rate, name="v", clock=clock)
    assert a.try_acquire() and b.try_acquire()  # a: slots [0, 100 ms), b: [100, 200 ms)
    a.close()  # 9 unused, all ahead: given back exactly
    assert peek.available() == 20 - 1 + 0  # 30 - b's 10 - a's 1
    clock.advance(0.05)
    b.close()  # b's place moved; its give-back would be stale: nothing given
    assert peek.available() == pytest.approx(24)  # 19 + 5 refilled
    assert r.get(b"\xffrq:{v}:v:0") is not None  # the generation of the last give-back


def test_threads_share_one_lease(redis_server: RedisServer) -> None:
    c = redis_server.client()
    c.flushdb()
    rate, burst = 2000, 200
    lim = RedisLimiter(c, rq.Rate(rate, per=1, burst=burst), name="threads", lease=0.05)
    counts = [0] * 4

    def server_now() -> float:
        """The limiter's clock: the server's TIME (the wall clock, which may run faster
        than the client's monotonic one while it is being corrected)."""
        s, us = c.time()
        return float(s) + us / 1e6

    stop = time.monotonic() + 0.5
    start = server_now()

    def work(i: int) -> None:
        while time.monotonic() < stop:
            if lim.try_acquire():
                counts[i] += 1

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    elapsed = server_now() - start
    lim.close()
    assert sum(counts) <= burst + rate * elapsed
    # Behaviour, not speed (a loaded machine may run the threads slowly): the shared
    # lease admits at least the burst across the threads.
    assert sum(counts) >= 0.9 * burst - 10
    c.close()


def test_async_lease(redis_server: RedisServer) -> None:
    async def main() -> None:
        c = redis_server.async_client()
        await c.flushdb()
        clock = rq.ManualClock()
        lim = AsyncRedisLimiter(
            c, rq.Rate(100, per=1, burst=100), name="alease", lease=0.1, clock=clock
        )
        assert all([await lim.try_acquire() for _ in range(25)])
        assert lim.stats()["leases"] == 3
        assert (await lim.acquire()).waited == 0
        await lim.close()
        assert await lim.available() == 74
        await c.aclose()

    asyncio.run(main())


def test_forked_child_does_not_reuse_the_parents_lease(redis_server: RedisServer) -> None:
    import os

    c = redis_server.client()
    c.flushdb()
    clock = rq.ManualClock()
    lim = RedisLimiter(c, rq.Rate(100, per=1, burst=100), name="fork", lease=0.1, clock=clock)
    peek = RedisLimiter(c, rq.Rate(100, per=1, burst=100), name="fork", clock=clock)
    assert lim.try_acquire()  # the parent holds a lease of 10 (9 left)
    rfd, wfd = os.pipe()

    def child() -> None:
        ok = lim.try_acquire()  # must take a lease of its own
        os.write(wfd, b"%d %d" % (ok, lim.stats()["leases"]))

    check_child(fork_child(child, 20), 20)
    os.close(wfd)
    got = os.read(rfd, 64).decode()
    os.close(rfd)
    assert got == "1 2"  # the parent's count (1) plus the child's own lease
    assert peek.available() == 80
    c.close()
