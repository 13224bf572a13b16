"""ratequeue.redis against a real redis-server: decisions, storage, waiting, policies, asyncio."""

from __future__ import annotations

import asyncio
import time

import pytest
import ratequeue as rq
import redis
from ratequeue.redis import (
    GCRA_SHA,
    AsyncRedisKeyedLimiter,
    AsyncRedisLimiter,
    AsyncRedisPolicy,
    RedisKeyedLimiter,
    RedisLimiter,
    RedisPolicy,
)
from redis.crc import key_slot
from redis_server import RedisServer

US = 1_000_000


def server_us(c: redis.Redis) -> int:
    s, us = c.time()
    return int(s) * US + int(us)


# -- one limiter, the server's clock ---------------------------------------------------


def test_burst_then_refused_with_retry_after(r: redis.Redis) -> None:
    lim = RedisLimiter(r, rq.Rate(10, per=1, burst=3), name="api")
    assert [lim.try_acquire() for _ in range(4)] == [True, True, True, False]
    assert 0 < lim.retry_after() <= 0.1
    assert lim.available() < 1
    assert lim.stats()["admitted"] == 3 and lim.stats()["refused"] == 1


def test_tat_is_server_microseconds_and_key_expires_when_full(r: redis.Redis) -> None:
    # one permit a minute: the key lives 3 minutes (at 100/s it lived 30 ms, and a loaded
    # machine's delay before the next command let it expire)
    lim = RedisLimiter(r, rq.Rate(1, per=60, burst=5), name="exp")
    before = server_us(r)
    assert lim.try_acquire(3)
    after = server_us(r)
    (key,) = lim.keys
    assert key == b"rq:{exp}:exp:0"
    tat = int(r.get(key))
    # TAT = max(TAT, now) + 3 * 60 s, in integer microseconds of the server's clock.
    assert before + 180_000_000 <= tat <= after + 180_000_000
    assert 0 < r.pttl(key) <= 180_000  # expires when full again
    fast = RedisLimiter(r, rq.Rate(100, per=1, burst=5), name="fast")
    assert fast.try_acquire(3)  # full again 30 ms later (a later look changes nothing)
    time.sleep(0.06)
    assert r.exists(*fast.keys) == 0  # full again: no key, no memory
    assert fast.available() == 5.0


def test_several_units_all_or_nothing(r: redis.Redis) -> None:
    lim = RedisLimiter(
        r,
        rq.Rate(10, per=1, burst=5),
        rq.Rate(100, per=1, unit="tokens"),
        name="llm",
    )
    assert lim.units == ["requests", "tokens"]
    assert lim.try_acquire(tokens=80)
    assert not lim.try_acquire(tokens=80)  # tokens refuse: requests untouched
    # Real time: refills of 10 and 100 per second since (a loaded machine, up to 50 ms).
    assert 3.99 <= lim.available() <= 4.5
    assert 19 <= lim.available("tokens") <= 25
    with pytest.raises(TypeError, match="missing cost"):
        lim.try_acquire()
    with pytest.raises(TypeError, match="unexpected keyword"):
        lim.try_acquire(tokens=1, bytes=3)
    with pytest.raises(TypeError, match="given twice"):
        lim.try_acquire(1, requests=1, tokens=1)
    with pytest.raises(ValueError, match=">= 0"):
        lim.try_acquire(tokens=-1)
    with pytest.raises(TypeError, match="int"):
        lim.try_acquire(tokens=1.5)  # type: ignore[arg-type]
    with pytest.raises(rq.CostTooLarge) as e:
        lim.try_acquire(tokens=101)
    assert isinstance(e.value, ValueError) and e.value.retry_after == float("inf")
    with pytest.raises(ValueError, match="unit"):
        lim.available("bytes")


def test_same_unit_twice_applies_both(r: redis.Redis) -> None:
    lim = RedisLimiter(r, rq.Rate(2, per=1), rq.Rate(100, per=60, burst=3), name="two")
    assert [lim.try_acquire() for _ in range(3)] == [True, True, False]
    assert len(lim.keys) == 2


def test_script_is_reloaded_after_noscript(r: redis.Redis) -> None:
    lim = RedisLimiter(r, rq.Rate(10, per=1), name="noscript")
    assert lim.try_acquire()
    r.script_flush()
    assert r.script_exists(GCRA_SHA) == [False]
    assert lim.try_acquire()
    assert r.script_exists(GCRA_SHA) == [True]


def test_decode_responses_client(redis_server: RedisServer) -> None:
    c = redis_server.client(decode_responses=True)
    c.flushdb()
    lim = RedisLimiter(c, rq.Rate(10, per=1, burst=1), name="dec")
    assert lim.try_acquire()
    res = lim.reserve()
    assert 0 < res.delay <= 0.1
    assert res.cancel() is True
    assert 0 < lim.retry_after() <= 0.1
    c.close()


# -- reservations and waiting ----------------------------------------------------------


def test_reserve_cancel_and_overloaded(r: redis.Redis) -> None:
    clock = rq.ManualClock()
    lim = RedisLimiter(r, rq.Rate(10, per=1, burst=1), name="res", clock=clock)
    assert lim.reserve().delay == 0
    a = lim.reserve()
    assert a.delay == pytest.approx(0.1)
    with pytest.raises(rq.Overloaded) as e:
        lim.reserve(max_wait=0.15)
    assert e.value.retry_after == pytest.approx(0.05)
    b = lim.reserve(max_wait=0.2)
    assert b.delay == pytest.approx(0.2)
    assert a.cancel() is False  # b was reserved after it: a's slot stays used
    assert b.cancel() is True and b.cancelled
    assert b.cancel() is False  # only the first call counts
    assert lim.retry_after() == pytest.approx(0.2)
    clock.advance(0.1)
    assert a.cancel() is False  # its time has come: nothing to give back


def test_acquire_sleeps_once_per_grant(r: redis.Redis) -> None:
    lim = RedisLimiter(r, rq.Rate(20, per=1, burst=1), name="wait", max_wait=1.0)
    lim.try_acquire()
    calls = lim.stats()["redis_calls"]
    t0 = time.monotonic()
    with lim.acquire() as p:
        elapsed = time.monotonic() - t0
    assert 0 < p.waited <= 0.05  # the server's wait: 50 ms minus the time since the first
    assert elapsed >= p.waited - 0.002
    assert lim.stats()["redis_calls"] == calls + 1  # one round trip, then one sleep
    with pytest.raises(rq.Overloaded):
        lim.acquire(timeout=0.01)
    assert lim.stats()["redis_calls"] == calls + 2


def test_acquire_on_manual_clock_moves_it(r: redis.Redis) -> None:
    clock = rq.ManualClock()
    lim = RedisLimiter(r, rq.Rate(4, per=1, burst=1), name="man", clock=clock)
    waits = [lim.acquire().waited for _ in range(3)]
    assert waits == [0.0, 0.25, 0.25]
    assert clock.now() == pytest.approx(0.5)


def test_settle_refunds_and_charges(r: redis.Redis) -> None:
    clock = rq.ManualClock()
    lim = RedisLimiter(
        r, rq.Rate(10, per=1), rq.Rate(1000, per=1, unit="tokens"), name="s", clock=clock
    )
    p = lim.acquire(tokens=500)
    assert lim.available("tokens") == 500
    p.settle(tokens=100)
    assert lim.available("tokens") == 900
    p.settle(tokens=700)
    assert lim.available("tokens") == 300
    assert p.costs == {"requests": 1, "tokens": 700}
    with pytest.raises(TypeError):
        p.settle(bytes=1)


# -- keyed -------------------------------------------------------------------------------


def test_keyed_limiter_keys_are_independent(r: redis.Redis) -> None:
    users = RedisKeyedLimiter(r, rq.Rate(2, per=60), name="user")
    assert [users.try_acquire("alice") for _ in range(3)] == [True, True, False]
    assert users.try_acquire("bob")
    assert users.try_acquire(b"carol", 2)
    with pytest.raises(rq.CostTooLarge):
        users.try_acquire(7, 3)
    assert users.available("alice") == pytest.approx(0, abs=0.01)
    assert users.available("dave") == 2
    assert 29 < users.retry_after("alice") <= 30
    # Each key is its own hash tag: spread over a cluster.
    assert users.key("alice") == b"rq:{s:alice}:user:s:alice"
    tagged = RedisKeyedLimiter(r, rq.Rate(2, per=60), name="user", tag="t1")
    assert tagged.key("alice") == b"rq:{t1}:user:s:alice"
    users.reset("alice")
    assert users.try_acquire("alice")


def test_keyed_acquire_and_reserve(r: redis.Redis) -> None:
    clock = rq.ManualClock()
    users = RedisKeyedLimiter(r, rq.Rate(10, per=1, burst=1), name="u", clock=clock)
    assert users.acquire("a").waited == 0
    assert users.acquire("a").waited == pytest.approx(0.1)
    res = users.reserve("a", max_wait=1)
    assert res.delay == pytest.approx(0.1)
    assert res.cancel()
    with pytest.raises(rq.Overloaded):
        users.reserve("a", max_wait=0.05)


# -- policies ----------------------------------------------------------------------------


def policy(r: redis.Redis, per: float = 1, **kw: object) -> RedisPolicy:
    return RedisPolicy(
        r,
        {
            "user": rq.KeyedLimiter(rq.Rate(2, per=per)),
            "tenant": rq.KeyedLimiter(rq.Rate(5, per=per)),
            "cluster": rq.Limiter(rq.Rate(100, per=per), rq.Rate(1000, per=per, unit="tokens")),
        },
        name="api",
        **kw,  # type: ignore[arg-type]
    )


def test_policy_keys_share_one_cluster_slot(r: redis.Redis) -> None:
    # rates per hour: a key expires once its bucket is full again, which at 100/s was
    # 10 ms after the acquire, before a loaded machine's next command listed the keys
    p = policy(r, per=3600)
    assert p.try_acquire(user="alice", tenant="acme", tokens=10)
    keys = sorted(r.keys("*"))
    assert keys == [
        b"rq:{api}:cluster:0",
        b"rq:{api}:cluster:1",
        b"rq:{api}:tenant:s:acme",
        b"rq:{api}:user:s:alice",
    ]
    assert len({key_slot(k) for k in keys}) == 1
    # A standalone limiter with the policy's tag shares the policy's bucket.
    hourly = rq.Rate(100, per=3600), rq.Rate(1000, per=3600, unit="tokens")
    cluster = RedisLimiter(r, *hourly, name="cluster", tag="api")
    assert cluster.keys == keys[:2]
    # 10 tokens taken, refilled at 1000/h since (under one token in the next 3.6 s).
    assert 990 <= cluster.available("tokens") < 991


def test_policy_all_or_nothing(r: redis.Redis) -> None:
    p = policy(r, per=3600)  # hourly: no refill between the calls, however slow
    assert p.try_acquire(user="a", tenant="t", tokens=100)
    assert p.try_acquire(user="a", tenant="t", tokens=100)
    tokens_before = float(r.get(b"rq:{api}:cluster:1"))
    assert p.try_acquire(user="a", tenant="t", tokens=100) is None  # user refuses
    assert float(r.get(b"rq:{api}:cluster:1")) == tokens_before  # nothing debited
    st = p.stats()
    assert st["admitted"] == 2 and st["levels"]["user"]["refused"] == 1
    with pytest.raises(TypeError, match="missing key"):
        p.try_acquire(tenant="t", tokens=1)
    with pytest.raises(TypeError, match="unexpected keyword"):
        p.try_acquire(user="a", tenant="t", tokens=1, color="red")
    with pytest.raises(TypeError, match='missing cost for unit "tokens"'):
        p.try_acquire(user="a", tenant="t")
    with pytest.raises(rq.CostTooLarge, match="cluster"):
        p.try_acquire(user="b", tenant="t", tokens=1001)


def test_policy_shadow_counts_but_never_refuses(r: redis.Redis) -> None:
    p = policy(r, per=3600, shadow=["user"])  # hourly: no refill between the calls
    got = [p.try_acquire(user="a", tenant="t", tokens=1) is not None for _ in range(4)]
    assert got == [True, True, True, True]
    assert p.stats()["levels"]["user"]["shadow_refused"] == 2
    assert p.try_acquire(user="a", tenant="t", tokens=1) is not None
    assert p.try_acquire(user="a", tenant="t", tokens=1) is None  # tenant (enforced): 5/h
    assert p.stats()["levels"]["tenant"]["refused"] == 1
    with pytest.raises(ValueError, match="shadow"):
        policy(r, shadow=["nope"])


def test_policy_reserve_waits_for_the_latest_level(r: redis.Redis) -> None:
    clock = rq.ManualClock()
    p = policy(r, clock=clock)
    for _ in range(2):
        p.try_acquire(user="a", tenant="t", tokens=1)
    res = p.reserve(user="a", tenant="t", tokens=1, max_wait=1)
    assert res.delay == pytest.approx(0.5)  # the user level (2/s) is the latest
    with pytest.raises(rq.Overloaded, match="user") as e:
        p.reserve(user="a", tenant="t", tokens=1, max_wait=0.5)
    assert e.value.retry_after == pytest.approx(0.5)
    assert res.cancel()
    permit = p.acquire(user="a", tenant="t", tokens=500)
    assert permit.waited == pytest.approx(0.5) and clock.now() == pytest.approx(0.5)
    permit.settle(tokens=100)
    assert permit.costs == {"requests": 1, "tokens": 100}


def test_policy_rejects_concurrency_levels(r: redis.Redis) -> None:
    with pytest.raises(TypeError, match="concurrency"):
        RedisPolicy(r, {"c": rq.Concurrency(3)}, name="x")  # type: ignore[dict-item]


# -- asyncio -----------------------------------------------------------------------------


def test_async_limiter(redis_server: RedisServer) -> None:
    async def main() -> None:
        c = redis_server.async_client()
        await c.flushdb()
        # 2/s: each wait is up to 0.5 s, wide enough that a loaded machine's pauses
        # between the calls below never refill a whole token
        lim = AsyncRedisLimiter(c, rq.Rate(2, per=1, burst=2), name="aio", max_wait=1)
        assert [await lim.try_acquire() for _ in range(3)] == [True, True, False]
        t0 = time.monotonic()
        async with lim.acquire() as p:
            assert 0 < p.waited <= 0.5
        assert time.monotonic() - t0 >= p.waited - 0.002
        assert 0 < (await lim.acquire()).waited <= 0.5
        with pytest.raises(rq.Overloaded):
            await lim.acquire(timeout=0.01)
        assert 0 < await lim.retry_after() <= 0.5
        assert await lim.available() < 1
        res = await lim.reserve()
        assert await res.cancel_async()
        await c.script_flush()
        await lim.reset()
        assert await lim.try_acquire()  # NOSCRIPT: loaded again
        await c.aclose()

    asyncio.run(main())


def test_async_cancel_gives_the_reservation_back(redis_server: RedisServer) -> None:
    async def main() -> None:
        c = redis_server.async_client()
        await c.flushdb()
        lim = AsyncRedisLimiter(c, rq.Rate(2, per=1, burst=1), name="cancel")
        assert await lim.try_acquire()
        task = asyncio.ensure_future(lim.acquire())
        await asyncio.sleep(0.05)
        before = await lim.retry_after()
        assert 0.5 < before <= 1.0  # the waiter holds the next slot
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await lim.retry_after() < 0.5  # given back: the next slot is free again
        await c.aclose()

    asyncio.run(main())


def test_async_keyed_and_policy(redis_server: RedisServer) -> None:
    async def main() -> None:
        c = redis_server.async_client()
        await c.flushdb()
        users = AsyncRedisKeyedLimiter(c, rq.Rate(1, per=1), name="u")
        assert await users.try_acquire("a")
        assert not await users.try_acquire("a")
        assert await users.available("b") == 1
        assert 0.9 < await users.retry_after("a") <= 1
        p = AsyncRedisPolicy(
            c,
            {"user": rq.KeyedLimiter(rq.Rate(1, per=1)), "all": rq.Rate(50, per=1)},
            name="pol",
        )
        permit = await p.try_acquire(user="x")
        assert permit is not None
        assert await p.try_acquire(user="x") is None
        with pytest.raises(rq.Overloaded):
            await p.reserve(user="x", max_wait=0.1)
        res = await p.reserve(user="x", max_wait=2)
        assert 0.9 < res.delay <= 1
        assert await res.cancel_async()
        await c.aclose()

    asyncio.run(main())


# -- arguments ---------------------------------------------------------------------------


def test_bad_arguments(r: redis.Redis) -> None:
    with pytest.raises(TypeError):
        RedisLimiter(r, name="x")
    with pytest.raises(ValueError, match="name"):
        RedisLimiter(r, rq.Rate(1, per=1), name="")
    with pytest.raises(ValueError, match="on_failure"):
        RedisLimiter(r, rq.Rate(1, per=1), name="x", on_failure="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="local_fraction"):
        RedisLimiter(r, rq.Rate(1, per=1), name="x", local_fraction=0)
    with pytest.raises(ValueError, match="lease"):
        RedisLimiter(r, rq.Rate(1, per=1), name="x", lease=2.0)
    with pytest.raises(TypeError, match="ManualClock"):
        RedisLimiter(r, rq.Rate(1, per=1), name="x", clock=rq.MonotonicClock())  # type: ignore[arg-type]
    lim = RedisLimiter(r, rq.Rate(1, per=1), name="x")
    with pytest.raises(ValueError, match="max_wait"):
        lim.reserve(max_wait=-1)
    with pytest.raises(TypeError, match="key"):
        RedisKeyedLimiter(r, rq.Rate(1, per=1), name="k").try_acquire(1.5)  # type: ignore[arg-type]


def test_sync_settle_of_an_async_permit_is_a_type_error(redis_server: RedisServer) -> None:
    async def main() -> None:
        c = redis_server.async_client()
        lim = AsyncRedisLimiter(c, rq.Rate(10, per=1, unit="tokens"), name="st")
        p = await lim.acquire(tokens=5)
        with pytest.raises(TypeError, match="settle_async"):
            p.settle(tokens=1)
        await p.settle_async(tokens=1)
        # 4 of the 5 tokens came back; the bucket refills meanwhile (real time), up to 10
        assert 9 - 1e-6 <= await lim.available("tokens") <= 10
        await c.aclose()

    asyncio.run(main())


def test_missing_server_fails_never_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    import redis_server as helper

    monkeypatch.setattr(helper, "server_binary", lambda: None)
    for ci in ("true", ""):
        monkeypatch.setenv("CI", ci)
        with pytest.raises(pytest.fail.Exception, match="never skip"):
            helper.require_binary()
