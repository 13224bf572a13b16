"""QuotaPolicy: a ledger account as a policy level, all or nothing, every branch."""

from __future__ import annotations

import asyncio
import atexit
from typing import Any

import pytest
import ratequeue as rq
from ledger_backends import Factory, stop_shared_redis
from ratequeue.ledger import Plan, QuotaLevel, QuotaPolicy

atexit.register(stop_shared_redis)


def setup(make: Factory, clock: rq.ManualClock, *, quota: int = 1000) -> tuple[Any, Any, Any]:
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=quota))
    cluster = rq.Limiter(
        rq.Rate(3, per="minute"), rq.Rate(90_000, per="minute", unit="tokens"), clock=clock
    )
    policy = rq.Policy(
        {"user": rq.KeyedLimiter(rq.Rate(60, per="minute"), clock=clock), "cluster": cluster}
    )
    return led, policy, QuotaPolicy(policy, QuotaLevel(led, key="tenant"))


def test_try_acquire_then_settle_settles_both(make: Factory, clock) -> None:
    led, _policy, qp = setup(make, clock)
    p = qp.try_acquire(user="a", tenant="acme", tokens=800, request_id="req-1")
    assert p is not None and p.request_id == "req-1"
    assert led.balance("acme").held == {"tokens": 800}
    c = p.settle(tokens=300)
    assert c.tokens == 300 and p.settle(tokens=300) is c
    assert led.balance("acme").used == {"tokens": 300}
    assert led.balance("acme").held == {"tokens": 0}


def test_quota_refusal_gives_the_policy_permit_back(make: Factory, clock) -> None:
    led, policy, qp = setup(make, clock, quota=100)
    with pytest.raises(rq.QuotaExceeded) as e:
        qp.try_acquire(user="a", tenant="acme", tokens=500)
    assert e.value.reset_at > clock.now()
    # the cluster's 3 requests/minute are all still there: nothing was lost
    permits = [qp.try_acquire(user="a", tenant="acme", tokens=10) for _ in range(3)]
    assert all(p is not None for p in permits)
    assert led.balance("acme").used == {"tokens": 30}
    assert policy.try_acquire(user="a", tokens=1) is None


def test_policy_refusal_takes_no_quota(make: Factory, clock) -> None:
    led, _policy, qp = setup(make, clock)
    for _ in range(3):
        assert qp.try_acquire(user="a", tenant="acme", tokens=10) is not None
    assert qp.try_acquire(user="a", tenant="acme", tokens=10) is None
    assert led.balance("acme").used == {"tokens": 30}


def test_release_and_cancel_give_the_hold_back(make: Factory, clock) -> None:
    led, _policy, qp = setup(make, clock)
    p = qp.try_acquire(user="a", tenant="acme", tokens=400)
    assert p is not None
    p.release()
    assert led.balance("acme").used == {"tokens": 0}
    p.release()  # idempotent
    q = qp.try_acquire(user="a", tenant="acme", tokens=400)
    assert q is not None
    q.cancel()
    assert led.balance("acme").used == {"tokens": 0}
    # cancel gave the cluster its request back too: 2 more fit
    assert qp.try_acquire(user="a", tenant="acme", tokens=1) is not None
    assert qp.try_acquire(user="a", tenant="acme", tokens=1) is not None


def test_a_block_settles_the_estimate_or_gives_back_on_error(make: Factory, clock) -> None:
    led, _policy, qp = setup(make, clock)
    with qp.acquire(user="a", tenant="acme", tokens=200):
        pass
    assert led.balance("acme").used == {"tokens": 200}
    with pytest.raises(RuntimeError), qp.acquire(user="a", tenant="acme", tokens=300):
        raise RuntimeError("the call failed")
    assert led.balance("acme").used == {"tokens": 200}
    with qp.acquire(user="a", tenant="acme", tokens=300) as p:
        p.settle(input_tokens=10, output_tokens=5)
    assert led.balance("acme").used == {"tokens": 215}
    rows = led.usage("acme").rows
    assert sorted((r.input_tokens, r.output_tokens) for r in rows) == [(10, 5), (200, 0)]


def test_acquire_refused_by_quota_after_waiting(make: Factory, clock) -> None:
    led, policy, qp = setup(make, clock, quota=10)
    with pytest.raises(rq.QuotaExceeded):
        qp.acquire(user="a", tenant="acme", tokens=50, timeout=0.5)
    assert led.balance("acme").used == {"tokens": 0}
    assert policy.try_acquire(user="b", tokens=1) is not None  # the permit came back


def test_acquire_async_paths(make: Factory, clock) -> None:
    led, _policy, qp = setup(make, clock, quota=500)

    async def main() -> None:
        async with qp.acquire_async(user="a", tenant="acme", tokens=100) as p:
            await p.settle_async(tokens=40)
        p2 = await qp.acquire_async(user="a", tenant="acme", tokens=100)
        await p2.release_async()
        p3 = await qp.acquire_async(user="a", tenant="acme", tokens=100)
        await p3.cancel_async()
        with pytest.raises(rq.QuotaExceeded):
            await qp.acquire_async(user="a", tenant="acme", tokens=1000)
        async with qp.acquire_async(user="a", tenant="acme", tokens=60):
            pass
        with pytest.raises(KeyError):
            async with qp.acquire_async(user="a", tenant="acme", tokens=60):
                raise KeyError("boom")

    asyncio.run(main())
    assert led.balance("acme").used == {"tokens": 100}


def test_fixed_account_and_account_fn(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=100))
    policy = rq.Policy({"tenant": rq.KeyedConcurrency(4)})
    byfn = QuotaPolicy(policy, QuotaLevel(led, account_fn=lambda kw: "acme", shared=False))
    with byfn.acquire(tenant="t1", tokens=30):
        pass
    q = QuotaPolicy(policy, QuotaLevel(led, "acme", unit="tokens", shared=False))
    with q.acquire(tenant="t1") as permit:
        permit.settle(input_tokens=7)
    assert led.balance("acme").used == {"tokens": 37}


def test_quota_level_arguments(make: Factory, clock) -> None:
    led = make(clock)
    with pytest.raises(ValueError):
        QuotaLevel(led)
    with pytest.raises(ValueError):
        QuotaLevel(led, "a", key="tenant")
    with pytest.raises(TypeError):
        QuotaLevel("not a ledger")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        QuotaPolicy(object(), QuotaLevel(led, "a"))
    qp = QuotaPolicy(rq.Policy({"tenant": rq.KeyedConcurrency(4)}), QuotaLevel(led, key="tenant"))
    with pytest.raises(TypeError, match="tenant"):
        qp.try_acquire(tokens=1)
    with pytest.raises(TypeError):
        qp.try_acquire(tenant="a", tokens=1.5)
