"""A QuotaPermit's settle is applied exactly once, however it is cancelled or retried:
the policy permit is settled once, and the ledger's settle (idempotent per request id)
is always sent with the first call's amounts, on both backends."""

from __future__ import annotations

import asyncio
import atexit
import threading
from typing import Any

import pytest
import ratequeue as rq
from ledger_backends import Factory, stop_shared_redis
from ledger_blocking import CLIENT_TIMEOUT, eventually, until_waiting, writes_blocked
from ratequeue.ledger import LedgerBase, Plan, QuotaLevel, QuotaPolicy

atexit.register(stop_shared_redis)


class CountingPermit:
    """A policy permit that counts what is done to it."""

    def __init__(self, permit: Any, log: list[tuple[str, dict[str, Any]]]) -> None:
        self.permit, self.log = permit, log

    def settle(self, **costs: Any) -> Any:
        self.log.append(("settle", costs))
        return self.permit.settle(**costs)

    def release(self) -> None:
        self.log.append(("release", {}))
        self.permit.release()

    def cancel(self) -> None:
        self.log.append(("cancel", {}))
        self.permit.cancel()

    def __exit__(self, *exc: Any) -> Any:
        return self.permit.__exit__(*exc)


class CountingPolicy:
    """An ``rq.Policy`` whose permits count their settles."""

    def __init__(self, policy: rq.Policy) -> None:
        self.policy = policy
        self.levels = policy.levels
        self.log: list[tuple[str, dict[str, Any]]] = []

    def try_acquire(self, **kw: Any) -> CountingPermit | None:
        p = self.policy.try_acquire(**kw)
        return None if p is None else CountingPermit(p, self.log)

    def acquire(self, **kw: Any) -> CountingPermit:
        return CountingPermit(self.policy.acquire(**kw), self.log)

    async def acquire_async(self, **kw: Any) -> CountingPermit:
        return CountingPermit(await self.policy.acquire_async(**kw), self.log)

    def settles(self) -> list[dict[str, Any]]:
        return [costs for what, costs in self.log if what == "settle"]


def setup(make: Factory, clock: rq.ManualClock) -> tuple[LedgerBase, CountingPolicy, QuotaPolicy]:
    led = make(clock, redis_timeout=CLIENT_TIMEOUT)
    led.set_plan("acme", Plan("pro", tokens=1000, calls=100))
    tokens = rq.Limiter(rq.Rate(90_000, per="minute", unit="tokens"), clock=clock)
    policy = CountingPolicy(rq.Policy({"cluster": tokens}))
    return led, policy, QuotaPolicy(policy, QuotaLevel(led, key="tenant"))


def test_a_cancelled_settle_async_then_a_retry_settles_once(
    make: Factory, clock: rq.ManualClock
) -> None:
    led, policy, qp = setup(make, clock)
    permit = qp.try_acquire(tenant="acme", tokens=500, request_id="q")
    assert permit is not None

    async def main() -> None:
        with writes_blocked(led, make.backend) as waiting:
            task = asyncio.ensure_future(permit.settle_async(tokens=120))
            await until_waiting(waiting)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        # a retry (other amounts, as a confused caller might send) is the first settle
        again = await permit.settle_async(tokens=300)
        assert again.tokens == 120
        assert await permit.settle_async(tokens=120) is again

    asyncio.run(main())
    assert policy.settles() == [{"tokens": 120}]
    assert eventually(lambda: led.balance("acme").held["tokens"] == 0)
    assert led.balance("acme").used == {"tokens": 120, "calls": 1}
    assert permit.settle(tokens=999).tokens == 120
    assert policy.settles() == [{"tokens": 120}]


def test_a_settle_whose_ledger_call_failed_retries_only_the_ledger(
    make: Factory, clock: rq.ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    led, policy, qp = setup(make, clock)
    permit = qp.try_acquire(tenant="acme", tokens=500, request_id="q")
    assert permit is not None
    real = led.settle
    calls: list[int] = []

    def flaky(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("lost the ledger")
        return real(*a, **kw)

    monkeypatch.setattr(led, "settle", flaky)
    with pytest.raises(ConnectionError):
        permit.settle(tokens=120)
    assert led.balance("acme").held["tokens"] == 500  # the hold waits for the retry
    c = permit.settle(tokens=120)
    assert c.tokens == 120 and not c.replay
    assert policy.settles() == [{"tokens": 120}]
    assert led.balance("acme").used == {"tokens": 120, "calls": 1}
    assert led.balance("acme").held["tokens"] == 0


def test_a_settle_async_cancelled_inside_the_block_is_not_given_back(
    make: Factory, clock: rq.ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The block's exit after a cancelled settle leaves the hold to that settle (which
    still completes) instead of releasing it: the work done is counted, once."""
    led, policy, qp = setup(make, clock)
    released: list[str] = []
    real_release = led.release_async

    async def release_async(rid: str) -> None:
        released.append(rid)
        await real_release(rid)

    monkeypatch.setattr(led, "release_async", release_async)

    async def main() -> None:
        permit = await qp.acquire_async(tenant="acme", tokens=500, request_id="q")

        async def use() -> None:
            async with permit:
                await permit.settle_async(tokens=120)

        with writes_blocked(led, make.backend) as waiting:
            task = asyncio.ensure_future(use())
            await until_waiting(waiting)
            task.cancel()
            await asyncio.sleep(0.05)  # the block's exit runs now
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await permit.settle_async()).tokens == 120

    asyncio.run(main())
    assert policy.settles() == [{"tokens": 120}]
    assert released == []
    assert eventually(lambda: led.balance("acme").held["tokens"] == 0)
    assert led.balance("acme").used == {"tokens": 120, "calls": 1}
    assert led.settle("q", input_tokens=120, output_tokens=0).replay


def test_concurrent_settles_from_threads_apply_once(make: Factory, clock: rq.ManualClock) -> None:
    led, policy, qp = setup(make, clock)
    permit = qp.try_acquire(tenant="acme", tokens=500, request_id="q")
    assert permit is not None
    got: list[Any] = []
    go = threading.Barrier(4)

    def settle(n: int) -> None:
        go.wait()
        got.append(permit.settle(tokens=100 + n))

    ts = [threading.Thread(target=settle, args=(n,)) for n in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert len(got) == 4 and len({c.tokens for c in got}) == 1
    assert len(policy.settles()) == 1
    assert led.balance("acme").used["tokens"] == got[0].tokens
