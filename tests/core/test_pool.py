"""ratequeue.Pool: routing by predicted wait, weights, fallback, cooldowns, sync and async."""

from __future__ import annotations

import asyncio
import email.utils
import math
import threading
import time

import pytest
import ratequeue as rq
from ratequeue._ratequeue import Channel
from ratequeue.pool import parse_retry_after


def pool_of(clock: rq.ManualClock, *specs: tuple[str, float, int, float], **kw: object) -> rq.Pool:
    """Providers (name, rpm, burst, weight) on one manual clock."""
    providers = [
        rq.Provider(name, rpm=rpm, burst=burst, weight=weight, clock=clock)
        for name, rpm, burst, weight in specs
    ]
    return rq.Pool(providers, clock=clock, **kw)  # type: ignore[arg-type]


def test_goes_to_the_shortest_predicted_wait(clock: rq.ManualClock) -> None:
    pool = pool_of(clock, ("a", 60, 1, 1.0), ("b", 30, 1, 1.0), max_wait=10)
    assert [pool.acquire(timeout=0)[0].name for _ in range(2)] == ["a", "b"]
    # Both are used up: a refills in 1 s, b in 2 s.
    assert pool.waits() == pytest.approx({"a": 1.0, "b": 2.0})
    p, wait = pool.choose()
    assert (p.name, wait) == ("a", pytest.approx(1.0))
    clock.advance(1.0)
    assert pool.acquire(timeout=0)[0].name == "a"
    # Now a would wait 1 s and b 1 s: a tie, shared by weight (here equal).
    assert pool.waits() == pytest.approx({"a": 1.0, "b": 1.0})


def test_ties_are_shared_by_weight(clock: rq.ManualClock) -> None:
    # Huge bursts: every wait is 0, so every choice is a tie.
    pool = pool_of(clock, ("heavy", 6000, 1000, 3.0), ("light", 6000, 1000, 1.0))
    names = [pool.acquire(timeout=0)[0].name for _ in range(400)]
    assert names.count("heavy") == 300
    assert names.count("light") == 100
    # Smooth: never more than three heavy in a row.
    assert "heavy" * 4 not in "".join("heavy" if n == "heavy" else "|" for n in names)
    stats = pool.stats()
    assert stats["heavy"]["sent"] == 300 and stats["light"]["sent"] == 100


def test_falls_back_when_the_wait_would_exceed_max_wait(clock: rq.ManualClock) -> None:
    pool = pool_of(clock, ("fast", 60, 5, 10.0), ("slow", 6, 1, 1.0), max_wait=2.0)
    got = [pool.acquire(timeout=0)[0].name for _ in range(6)]
    # fast (weight 10) takes its burst of 5 (ties at 0 s with slow's first token, shared by
    # weight); then fast would wait 1 s, slow 0 s or 10 s.
    assert got.count("fast") == 5 and got.count("slow") == 1
    ch = Channel()
    p, r = pool.acquire_async()._submit(ch)  # fast: 1 s <= 2 s
    assert p.name == "fast" and isinstance(r, int)
    p, r = pool.acquire_async()._submit(ch)  # fast: 2 s
    assert p.name == "fast"
    with pytest.raises(rq.PoolOverloaded) as e:
        pool.acquire_async()._submit(ch)  # fast 3 s, slow 10 s: both beyond max_wait
    assert e.value.retry_after == pytest.approx(3.0)
    assert e.value.waits == pytest.approx({"fast": 3.0, "slow": 10.0})
    assert isinstance(e.value, rq.Overloaded)


def test_overloaded_when_nobody_can_and_its_retry_after_is_the_smallest_wait(
    clock: rq.ManualClock,
) -> None:
    pool = pool_of(clock, ("a", 60, 1, 1.0), ("b", 60, 1, 1.0), max_wait=0.5)
    pool.acquire()
    pool.acquire()
    pool.report("a", 429, retry_after=7)
    with pytest.raises(rq.Overloaded) as e:
        pool.acquire()
    assert e.value.retry_after == pytest.approx(1.0)  # b's predicted wait
    assert e.value.waits["a"] == pytest.approx(7.0)  # cooling down 7 s


def test_cooldown_on_429_honours_retry_after(clock: rq.ManualClock) -> None:
    pool = pool_of(clock, ("a", 6000, 100, 5.0), ("b", 6000, 100, 1.0))
    assert pool.report("a", 429, retry_after="12") == 12.0
    assert pool.in_cooldown("a") and pool.cooldown_remaining("a") == pytest.approx(12.0)
    assert {pool.acquire(timeout=0)[0].name for _ in range(50)} == {"b"}
    clock.advance(11.9)
    assert pool.acquire(timeout=0)[0].name == "b"
    clock.advance(0.2)
    assert not pool.in_cooldown("a")
    assert pool.acquire(timeout=0)[0].name == "a"  # back, and heavier
    # An HTTP date works too.
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 28.0 <= pool.report("a", 429, retry_after=when) <= 31.0
    assert pool.stats()["a"]["rate_limited"] == 2


def test_failures_back_off_exponentially_and_success_resets(clock: rq.ManualClock) -> None:
    pool = pool_of(clock, ("a", 60, 1, 1.0), ("b", 60, 1, 1.0), cooldown=2.0, max_cooldown=5.0)
    assert pool.report("a", ok=False) == 2.0
    assert pool.report("a", 503) == 4.0
    assert pool.report("a", 500) == 5.0  # capped
    assert pool.report("a", 429) == 5.0  # 429 without Retry-After: the same rule
    assert pool.report("a", 200) == 0.0
    assert pool.report("a", ok=False) == 2.0  # the run of failures was reset
    assert pool.report("b", 400) == 0.0  # the caller's fault: no cooldown
    assert not pool.in_cooldown("b")
    s = pool.stats()
    assert (s["a"]["failed"], s["a"]["rate_limited"], s["a"]["ok"]) == (4, 1, 1)
    assert s["b"]["client_errors"] == 1


def test_a_grant_that_arrives_during_cooldown_is_rerouted(clock: rq.ManualClock) -> None:
    pool = pool_of(clock, ("a", 60, 1, 1.0), ("b", 60, 1, 1.0))
    ch = Channel()
    pool.acquire_async()._submit(ch)
    pool.acquire_async()._submit(ch)
    p, ticket = pool.acquire_async()._submit(ch)  # both used up: queued on one of them
    assert isinstance(ticket, int)
    pool.report(p, 429, retry_after=30)
    p.limiter.run_until(1.0)
    [(t, granted, _)] = ch.drain()
    assert (t, granted) == (ticket, True)
    assert pool.on_grant(p) is False  # do not use it: its provider is cooling down
    q, _ = pool.acquire_async()._submit(ch)
    assert q is not p
    assert pool.stats()[p.name]["rerouted"] == 1


def test_blocking_acquire_waits_in_the_best_queue(clock: rq.ManualClock) -> None:
    pool = pool_of(clock, ("a", 60, 1, 1.0), ("b", 30, 1, 1.0), max_wait=5.0)
    pool.acquire()
    pool.acquire()
    out: list[tuple[str, float]] = []

    def worker() -> None:
        p, permit = pool.acquire()
        out.append((p.name, permit.waited))

    t = threading.Thread(target=worker)
    t.start()
    deadline = time.monotonic() + 5
    while not pool["a"].limiter.waiting and time.monotonic() < deadline:
        time.sleep(0.001)
    assert pool["a"].limiter.waiting == 1
    pool["a"].limiter.run_until(1.0)
    t.join(5)
    assert out == [("a", pytest.approx(1.0))]


def test_acquire_async(clock: rq.ManualClock) -> None:
    pool = pool_of(clock, ("a", 60, 1, 1.0), ("b", 60, 1, 1.0), max_wait=5.0)

    async def main() -> list[tuple[str, float]]:
        first = [await pool.acquire_async(), await pool.acquire_async()]
        task = asyncio.ensure_future(pool.acquire_async())
        while not (pool["a"].limiter.waiting or pool["b"].limiter.waiting):
            await asyncio.sleep(0)
        for p in pool:
            p.limiter.run_until(1.0)
        third = await asyncio.wait_for(task, 5)
        return [(p.name, permit.waited) for p, permit in [*first, third]]

    got = asyncio.run(main())
    assert sorted(n for n, _ in got[:2]) == ["a", "b"]
    assert got[2][1] == pytest.approx(1.0)


def test_async_overloaded(clock: rq.ManualClock) -> None:
    pool = pool_of(clock, ("a", 60, 1, 1.0), max_wait=0.1)

    async def main() -> None:
        await pool.acquire_async()
        with pytest.raises(rq.PoolOverloaded):
            await pool.acquire_async()

    asyncio.run(main())


def test_tokens_go_where_they_fit(clock: rq.ManualClock) -> None:
    small = rq.Provider("small", rpm=600, tpm=1_000, clock=clock)
    big = rq.Provider("big", rpm=600, tpm=100_000, clock=clock, weight=0.1)
    reqs_only = rq.Provider("plain", rpm=600, clock=clock, weight=0.1)
    pool = rq.Pool([small, big, reqs_only], clock=clock)
    assert pool.acquire(timeout=0, tokens=500)[0].name == "small"  # heaviest of the ties
    # 5,000 tokens can never fit small (burst 1,000): big or plain (no token limit).
    assert pool.acquire(timeout=0, tokens=5_000)[0].name in ("big", "plain")
    assert pool.waits(tokens=5_000)["small"] == math.inf
    with pytest.raises(TypeError, match="unexpected cost unit"):
        pool.acquire(timeout=0, dollars=3)
    only_small = rq.Pool([rq.Provider("s", tpm=1_000, clock=clock)], clock=clock)
    with pytest.raises(rq.CostTooLarge):
        only_small.acquire(timeout=0, tokens=5_000)


def test_validation(clock: rq.ManualClock) -> None:
    with pytest.raises(ValueError):
        rq.Pool([])
    with pytest.raises(ValueError, match="unique"):
        rq.Pool([rq.Provider("a", rpm=1, clock=clock), rq.Provider("a", rpm=1, clock=clock)])
    with pytest.raises(ValueError):
        rq.Provider("a")
    with pytest.raises(ValueError):
        rq.Provider("a", rpm=1, weight=0)
    with pytest.raises(ValueError):
        rq.Provider("", rpm=1)
    pool = pool_of(clock, ("a", 60, 1, 1.0))
    with pytest.raises(ValueError, match="no provider named"):
        pool.report("zzz", 429)
    with pytest.raises(ValueError, match="not in this pool"):
        pool.report(rq.Provider("a", rpm=1, clock=clock), 429)
    with pytest.raises(TypeError):
        pool.report("a", "429")  # type: ignore[arg-type]


def test_parse_retry_after() -> None:
    assert parse_retry_after(None) is None
    assert parse_retry_after(3) == 3.0
    assert parse_retry_after("2.5") == 2.5
    assert parse_retry_after("-4") == 0.0
    assert parse_retry_after("soon") is None
    past = email.utils.formatdate(time.time() - 100, usegmt=True)
    assert parse_retry_after(past) == 0.0


def test_real_clock_smoke() -> None:
    # Default clocks (real time): nothing here waits, so nothing sleeps.
    pool = rq.Pool([rq.Provider("a", rpm=6000, burst=10), rq.Provider("b", rpm=6000, burst=10)])
    got = {pool.acquire(timeout=0)[0].name for _ in range(6)}
    assert got == {"a", "b"}
    pool.report("a", 429, retry_after=60)
    assert {pool.acquire(timeout=0)[0].name for _ in range(4)} == {"b"}
    assert 59 < pool.cooldown_remaining("a") <= 60
