"""Failure policies and the circuit breaker, with a real redis-server stopped, frozen
(SIGSTOP: calls time out) and restarted in the middle of a run."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import ratequeue as rq
import redis
from ratequeue.redis import (
    AsyncRedisLimiter,
    CircuitBreaker,
    RedisKeyedLimiter,
    RedisLimiter,
    RedisPolicy,
    RedisUnavailable,
)
from redis_server import RedisServer


def dead_client() -> redis.Redis:
    """A client of a port where nothing listens."""
    from redis_server import free_port

    return RedisServer("redis-server", free_port()).client(timeout=0.2)


def test_fail_closed_refuses_without_exceptions() -> None:
    lim = RedisLimiter(
        dead_client(), rq.Rate(10, per=1), name="x", breaker=CircuitBreaker(retry_interval=60)
    )
    assert [lim.try_acquire() for _ in range(5)] == [False] * 5
    with pytest.raises(RedisUnavailable) as e:
        lim.acquire()
    assert isinstance(e.value, rq.Overloaded) and 59 < e.value.retry_after <= 60
    with pytest.raises(RedisUnavailable):
        lim.reserve()
    assert lim.available() == 0.0
    assert lim.retry_after() > 59
    st = lim.stats()
    assert st["redis_calls"] == 1  # the breaker spared every later call
    assert st["breaker"] == {"state": "open", "failures": 1, "opened": 1}


def test_fail_open_admits() -> None:
    lim = RedisLimiter(dead_client(), rq.Rate(10, per=1), name="x", on_failure="fail_open")
    assert all(lim.try_acquire() for _ in range(50))
    assert lim.acquire().waited == 0
    assert lim.reserve().delay == 0
    assert lim.retry_after() == 0
    users = RedisKeyedLimiter(dead_client(), rq.Rate(1, per=1), name="u", on_failure="fail_open")
    assert users.try_acquire("a") and users.try_acquire("a")
    p = RedisPolicy(dead_client(), {"all": rq.Rate(1, per=1)}, name="p", on_failure="fail_open")
    assert p.try_acquire() is not None and p.try_acquire() is not None


def test_local_fallback_at_a_fraction_of_the_rate() -> None:
    clock = rq.ManualClock()
    lim = RedisLimiter(
        dead_client(),
        rq.Rate(100, per=1, burst=10),
        name="x",
        on_failure="local",
        local_fraction=0.5,
        clock=clock,
    )
    assert sum(lim.try_acquire() for _ in range(20)) == 5  # burst 10 * 0.5
    clock.advance(0.1)
    assert sum(lim.try_acquire() for _ in range(20)) == 5  # 50/s for 0.1 s
    assert lim.acquire().waited == pytest.approx(0.02)
    assert lim.stats()["fallback_decisions"] >= 41
    users = RedisKeyedLimiter(
        dead_client(), rq.Rate(10, per=1), name="u", on_failure="local", local_fraction=0.2
    )
    assert [users.try_acquire("a") for _ in range(3)] == [True, True, False]
    p = RedisPolicy(
        dead_client(),
        {"user": rq.KeyedLimiter(rq.Rate(4, per=1)), "all": rq.Rate(100, per=1)},
        name="p",
        on_failure="local",
        local_fraction=0.5,
    )
    assert [p.try_acquire(user="a") is not None for _ in range(3)] == [True, True, False]


def test_request_errors_are_not_outages(r: redis.Redis) -> None:
    lim = RedisLimiter(r, rq.Rate(10, per=1), name="wrong")
    r.hset(lim.keys[0], "a", "b")  # WRONGTYPE inside the script
    with pytest.raises(redis.ResponseError):
        lim.try_acquire()
    assert lim.breaker.state == "closed"


def run_loop(
    lim: RedisLimiter,
    seconds: float,
    log: list[tuple[float, float, bool]],
    errors: list[BaseException],
) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        try:
            ok = lim.try_acquire()
        except BaseException as e:
            errors.append(e)
            return
        log.append((t0, time.monotonic(), ok))
        time.sleep(0.001)


def test_stop_and_restart_in_the_middle_of_a_run(own_redis: RedisServer) -> None:
    rate, burst = 50, 5
    lim = RedisLimiter(
        own_redis.client(timeout=0.2),
        rq.Rate(rate, per=1, burst=burst),
        name="run",
        breaker=CircuitBreaker(retry_interval=0.1),
    )
    log: list[tuple[float, float, bool]] = []
    errors: list[BaseException] = []
    t = threading.Thread(target=run_loop, args=(lim, 1.6, log, errors))
    t.start()
    time.sleep(0.4)
    own_redis.stop()
    stopped = time.monotonic()
    time.sleep(0.4)
    restarting = time.monotonic()
    own_redis.start()
    restarted = time.monotonic()
    t.join()
    assert not errors
    down = [ok for t0, t1, ok in log if t0 > stopped and t1 < restarting]
    assert down and not any(down)  # fail_closed: nothing admitted while Redis is down
    st = lim.stats()
    # One failure per breaker interval at most, not one per call.
    assert st["redis_failures"] <= (restarted - stopped) / 0.1 + 3
    assert len(down) > 5 * st["redis_failures"]
    # After recovery the new (empty) server counts from a full bucket.
    after = [(t0, t1) for t0, t1, ok in log if ok and t0 > restarted]
    assert after, "no admission after the restart"
    span = log[-1][1] - after[0][0]
    assert len(after) <= burst + rate * span + 1
    assert len(after) >= 0.8 * (burst + rate * (span - 0.25))
    assert lim.breaker.state == "closed"


def test_frozen_server_costs_one_timeout_per_interval(own_redis: RedisServer) -> None:
    timeout, interval = 0.1, 0.3
    lim = RedisLimiter(
        own_redis.client(timeout=timeout),
        rq.Rate(1000, per=1),
        name="frozen",
        on_failure="local",
        local_fraction=0.5,
        breaker=CircuitBreaker(retry_interval=interval),
    )
    assert lim.try_acquire()
    own_redis.pause()
    slow = 0
    decisions = 0
    t_end = time.monotonic() + 1.0
    while time.monotonic() < t_end:
        t0 = time.monotonic()
        lim.try_acquire()
        decisions += 1
        if time.monotonic() - t0 >= timeout * 0.9:
            slow += 1
    assert 1 <= slow <= 1.0 / (interval + timeout) + 2
    assert decisions > 100 * slow  # the other calls are decided locally at once
    own_redis.resume()
    time.sleep(interval + 0.05)
    assert lim.try_acquire()  # the probe reaches Redis again
    assert lim.breaker.state == "closed"


def test_async_restart(own_redis: RedisServer) -> None:
    async def main() -> None:
        c = own_redis.async_client(timeout=0.2)
        lim = AsyncRedisLimiter(
            c, rq.Rate(100, per=1, burst=3), name="a", breaker=CircuitBreaker(0.05)
        )
        assert await lim.try_acquire()
        own_redis.stop()
        assert [await lim.try_acquire() for _ in range(20)] == [False] * 20
        with pytest.raises(RedisUnavailable):
            await lim.acquire()
        assert lim.stats()["redis_failures"] == 1
        own_redis.start()
        ok = False
        for _ in range(100):  # bounded: the breaker lets a probe through every 50 ms
            await asyncio.sleep(0.01)
            if await lim.try_acquire():
                ok = True
                break
        assert ok and lim.breaker.state == "closed"
        await c.aclose()

    asyncio.run(main())


def test_cancelled_probe_lets_another_call_probe() -> None:
    br = CircuitBreaker(retry_interval=0)
    br._failure(OSError("boom"))
    assert br._allow()  # the probe
    assert not br._allow()  # one at a time
    br._abandon()
    assert br._allow()
    br._success()
    assert br.state == "closed"
    with pytest.raises(ValueError):
        CircuitBreaker(retry_interval=-1)
