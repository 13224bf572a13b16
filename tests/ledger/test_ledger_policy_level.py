"""A ledger account as one more level of ``rq.Policy`` (a ``LedgerPolicy``): the native
policy of the other levels, then the ledger's hold, all or nothing; both backends."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import ratequeue as rq
from ledger_backends import Factory
from ledger_blocking import CLIENT_TIMEOUT, given_back, until_waiting, writes_blocked
from ratequeue.ledger import LedgerPolicy, Plan, QuotaLevel, QuotaPermit


def setup(make: Factory, clock: rq.ManualClock, *, quota: int = 1000, **kw: Any) -> Any:
    led = make(clock, **kw)
    led.set_plan("acme", Plan("p", tokens=quota))
    return led


def policy_of(led: Any) -> Any:
    """user bucket -> tenant concurrency -> cluster bucket -> monthly quota."""
    return rq.Policy(
        {
            "user": rq.KeyedLimiter(rq.Rate(60, per="minute", burst=60)),
            "tenant": rq.KeyedConcurrency(2),
            "cluster": rq.Limiter(
                rq.Rate(3, per="hour"), rq.Rate(90_000, per="minute", unit="tokens")
            ),
            "quota": QuotaLevel(led, key="tenant"),
        }
    )


def test_rq_policy_with_a_quota_level_is_a_ledger_policy(make: Factory, clock) -> None:
    led = setup(make, clock)
    p = policy_of(led)
    assert isinstance(p, LedgerPolicy) and isinstance(p, rq.Policy)
    assert p.levels == ["user", "tenant", "cluster", "quota"]
    plain = rq.Policy({"tenant": rq.KeyedConcurrency(2)})
    assert type(plain) is rq.Policy and plain.levels == ["tenant"]
    with pytest.raises(ValueError, match="at most one"):
        rq.Policy({"a": QuotaLevel(led, "acme"), "b": QuotaLevel(led, "acme")})
    with pytest.raises(ValueError, match="shadow"):
        rq.Policy({"t": rq.KeyedConcurrency(2), "q": QuotaLevel(led, key="t")}, shadow=["q"])
    with pytest.raises(ValueError, match="besides"):
        rq.Policy({"q": QuotaLevel(led, "acme")})
    with pytest.raises(TypeError):
        rq.Policy({"t": rq.KeyedConcurrency(2), "q": object()})  # type: ignore[dict-item]


def test_try_acquire_settles_every_level_and_the_hold_once(make: Factory, clock) -> None:
    led = setup(make, clock)
    p = policy_of(led)
    permit = p.try_acquire(user="u", tenant="acme", tokens=800, request_id="r1")
    assert isinstance(permit, QuotaPermit) and permit.request_id == "r1"
    assert led.balance("acme").held == {"tokens": 800}
    c = permit.settle(tokens=300)
    assert c.tokens == 300 and permit.settle(tokens=999) is c  # once
    permit.release()  # after a settle: gives back the concurrency only
    permit.cancel()
    b = led.balance("acme")
    assert b.used == {"tokens": 300} and b.held == {"tokens": 0}
    s = p.stats()
    assert list(s["levels"]) == ["user", "tenant", "cluster", "quota"]
    assert s["levels"]["quota"]["held"] == 1 and s["levels"]["quota"]["settled"] == 1
    assert s["admitted"] == 1


def test_a_quota_refusal_gives_back_every_level(make: Factory, clock) -> None:
    led = setup(make, clock, quota=100)
    p = policy_of(led)
    with pytest.raises(rq.QuotaExceeded) as e:
        p.try_acquire(user="u", tenant="acme", tokens=500)
    assert e.value.reset_at > clock.now() and e.value.retry_after > 0
    with pytest.raises(rq.QuotaExceeded):
        p.acquire(user="u", tenant="acme", tokens=500, timeout=1)
    # the cluster's 3 requests/hour and the tenant's 2 slots are all still there
    held = [p.try_acquire(user="u", tenant="acme", tokens=10) for _ in range(2)]
    assert all(x is not None for x in held)
    assert p.try_acquire(user="u", tenant="acme", tokens=10) is None  # tenant: 2 in flight
    for x in held:
        x.release()
    assert p.try_acquire(user="u", tenant="acme", tokens=10) is not None  # the 3rd request
    assert p.try_acquire(user="v", tenant="acme", tokens=1) is None  # cluster: 3 an hour
    s = p.stats()
    assert s["levels"]["quota"]["refused"] == 2 and s["admitted"] == 3
    assert led.balance("acme").held == {"tokens": 10}  # the released two gave theirs back


def test_a_policy_refusal_or_timeout_takes_no_hold(make: Factory, clock) -> None:
    led = setup(make, clock)
    p = policy_of(led)
    a = p.acquire(user="u", tenant="acme", tokens=1)
    b = p.acquire(user="u", tenant="acme", tokens=1)
    assert p.try_acquire(user="u", tenant="acme", tokens=1) is None
    with pytest.raises(rq.WaitTimeout):
        p.acquire(user="u", tenant="acme", tokens=1, timeout=0.05)
    assert led.balance("acme").held == {"tokens": 2}
    assert p.stats()["levels"]["quota"]["held"] == 2
    a.cancel()
    b.cancel()
    assert led.balance("acme").used == {"tokens": 0}
    assert p.stats()["levels"]["quota"]["released"] == 2


def test_with_blocks_settle_the_estimate_or_give_back(make: Factory, clock) -> None:
    led = setup(make, clock)
    p = policy_of(led)
    with p.acquire(user="u", tenant="acme", tokens=200):
        pass
    with pytest.raises(RuntimeError), p.acquire(user="u", tenant="acme", tokens=300):
        raise RuntimeError("the call failed")
    with p.acquire(user="u", tenant="acme", tokens=300) as permit:
        permit.settle(input_tokens=10, output_tokens=5)
    assert led.balance("acme").used == {"tokens": 215}
    assert led.balance("acme").held == {"tokens": 0}
    # the tenant's slots all came back
    assert p.try_acquire(user="u", tenant="other", tokens=1) is None or True
    assert p.stats()["levels"]["quota"] == {
        "shadow": False,
        "shadow_refused": 0,
        "held": 3,
        "refused": 0,
        "failed": 0,
        "settled": 2,
        "released": 1,
    }


def test_asyncio_await_async_with_and_refusal(make: Factory, clock) -> None:
    led = setup(make, clock, quota=500)
    p = policy_of(led)

    async def main() -> None:
        async with p.acquire_async(user="u", tenant="acme", tokens=100) as permit:
            await permit.settle_async(tokens=40)
            assert await permit.settle_async(tokens=1) is permit.charge
        q = await p.acquire_async(user="u", tenant="acme", tokens=100)
        await q.cancel_async()
        with pytest.raises(rq.QuotaExceeded):
            await p.acquire_async(user="u", tenant="acme", tokens=1000)
        with pytest.raises(KeyError):
            async with p.acquire_async(user="u", tenant="acme", tokens=60):
                raise KeyError("boom")

    asyncio.run(main())
    b = led.balance("acme")
    assert b.used == {"tokens": 40} and b.held == {"tokens": 0}
    s = p.stats()["levels"]["quota"]
    assert (s["held"], s["refused"], s["settled"], s["released"]) == (3, 1, 1, 2)
    # everything the refused and cancelled acquires took came back: 2 more requests fit
    # the cluster's 3 an hour (4 were granted, 1 refused by the quota and given back...)
    assert p.stats()["admitted"] == 3


def test_cancelled_or_timed_out_while_the_policy_waits_takes_no_hold(make: Factory, clock) -> None:
    led = setup(make, clock)
    p = rq.Policy(
        {"tenant": rq.KeyedConcurrency(2), "quota": QuotaLevel(led, key="tenant", shared=False)}
    )
    a = p.acquire(tenant="acme", tokens=1)
    b = p.acquire(tenant="acme", tokens=1)

    async def main() -> None:
        task = asyncio.ensure_future(p.acquire_async(tenant="acme", tokens=5))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(rq.WaitTimeout):
            await p.acquire_async(tenant="acme", tokens=5, timeout=0.05)

    asyncio.run(main())
    assert led.balance("acme").held == {"tokens": 2}
    a.release()
    b.release()
    assert led.balance("acme").held == {"tokens": 0}
    # the tenant's two slots are free again: nothing was kept by the cancelled waits
    x = p.try_acquire(tenant="acme", tokens=1)
    y = p.try_acquire(tenant="acme", tokens=1)
    assert x is not None and y is not None
    assert p.stats()["levels"]["quota"]["held"] == 4


def test_cancelled_while_the_hold_waits_gives_back_every_level(make: Factory, clock) -> None:
    led = setup(make, clock, redis_timeout=CLIENT_TIMEOUT)
    p = policy_of(led)
    with writes_blocked(led, make.backend) as waiting:  # type: ignore[attr-defined]

        async def main() -> None:
            task = asyncio.ensure_future(
                p.acquire_async(user="u", tenant="acme", tokens=70, request_id="h")
            )
            await until_waiting(waiting)  # granted by the policy, its hold queued
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())
    assert given_back(led, make.backend, "acme", "h")
    assert led.balance("acme").held == {"tokens": 0}
    assert led.balance("acme").used == {"tokens": 0}
    # both tenant slots are free: the permit was cancelled with its hold
    x = p.try_acquire(user="u", tenant="acme", tokens=1)
    y = p.try_acquire(user="u", tenant="acme", tokens=1)
    assert x is not None and y is not None
    assert p.stats()["levels"]["quota"]["failed"] == 1


def test_threads_never_hold_more_than_the_quota_nor_lose_a_slot(make: Factory, clock) -> None:
    led = setup(make, clock, quota=50)
    p = rq.Policy(
        {"tenant": rq.KeyedConcurrency(4), "quota": QuotaLevel(led, key="tenant", shared=False)}
    )
    got: list[int] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        for j in range(10):
            try:
                with p.acquire(tenant="acme", tokens=1, timeout=10, request_id=f"{k}-{j}"):
                    pass
            except rq.QuotaExceeded:
                with lock:
                    got.append(0)
            else:
                with lock:
                    got.append(1)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(got) == 50 and len(got) == 80
    assert led.balance("acme").used == {"tokens": 50}
    assert led.balance("acme").held == {"tokens": 0}
    s = p.stats()
    assert s["levels"]["quota"]["refused"] == 30 and s["admitted"] == 50
    # every slot came back
    assert all(p.try_acquire(tenant="acme", tokens=0) is not None for _ in range(4))


def test_reserve_then_hold(make: Factory, clock) -> None:
    led = setup(make, clock, quota=100)
    p = policy_of(led)
    r = p.reserve(user="u", tenant="acme", tokens=60, max_wait=1)
    assert led.balance("acme").held == {"tokens": 60}
    with pytest.raises(rq.QuotaExceeded):
        p.reserve(user="u", tenant="acme", tokens=60, max_wait=1)
    r.settle(tokens=20)
    assert led.balance("acme").used == {"tokens": 20}


def test_the_readme_policy_example_shape(make: Factory, clock) -> None:
    led = setup(make, clock, quota=10_000)
    p = policy_of(led)
    with p.acquire(user="alice", tenant="acme", tokens=1_200, timeout=5) as permit:
        permit.settle(tokens=900)
    assert led.balance("acme").used == {"tokens": 900}
