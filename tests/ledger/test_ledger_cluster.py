"""The Redis ledger on a real three-node Redis Cluster: an account's keys share a slot,
accounts spread over the nodes, campaigns and notices work across them."""

from __future__ import annotations

import asyncio
import time

import ratequeue as rq
from ledger_backends import T0
from ratequeue.ledger import Daily, Notice, Plan, RedisLedger
from redis.cluster import RedisCluster
from redis.crc import key_slot


def test_the_ledger_on_a_cluster(cluster: RedisCluster) -> None:
    clock = rq.ManualClock(T0)
    led = RedisLedger(cluster, name=f"c{time.monotonic_ns()}", clock=clock, hold_ttl=60)
    accounts = [f"tenant-{i}" for i in range(12)]
    for a in accounts:
        led.set_plan(a, Plan("p", tokens=100, period=Daily()))
    slots = {key_slot(led._pfx(a).encode() + b"a") for a in accounts}
    assert len(slots) > 1  # accounts spread over slots (and so nodes)
    for a in accounts:
        pfx = led._pfx(a).encode()
        assert {key_slot(pfx + k) for k in (b"a", b"p:x", b"r:y", b"rows", b"o", b"h")} == {
            key_slot(pfx + b"a")
        }
        led.charge("r1", a, input_tokens=85)
        assert led.charge("r1", a, input_tokens=85).replay
        led.hold("h-" + a, a, input_tokens=10)
    # a hold made yesterday expires today: the script reaches yesterday's period key
    clock.advance(86_400)
    b = led.balance("tenant-3")
    assert b.used == {"tokens": 0} and b.held == {"tokens": 0}
    led.settle("h-tenant-4", input_tokens=3, output_tokens=0)
    got: list[Notice] = []
    assert led.deliver(got.append) == 24  # 80 % and 95 % (the hold counts)
    assert {n.account for n in got} == set(accounts)
    rep = led.compensate("camp", batch=5)
    assert rep.changed == 12 and led.compensate("camp").already_done == 12
    assert led.balance("tenant-0").bonus == {"tokens": 25}
    assert [r.request_id for r in led.usage("tenant-4").rows] == ["r1", "h-tenant-4"]


def test_the_asyncio_twins_on_a_cluster(cluster: RedisCluster) -> None:
    """The asyncio twins use a redis.asyncio cluster client made for the same nodes."""
    clock = rq.ManualClock(T0)
    led = RedisLedger(cluster, name=f"a{time.monotonic_ns()}", clock=clock)
    accounts = [f"t-{i}" for i in range(6)]
    for a in accounts:
        led.set_plan(a, Plan("p", tokens=100, period=Daily()))

    async def main() -> None:
        for a in accounts:
            assert not (await led.charge_async("r", a, input_tokens=50)).replay
            assert (await led.charge_async("r", a, input_tokens=50)).replay
            await led.hold_async("h-" + a, a, input_tokens=20)
            c = await led.settle_async("h-" + a, input_tokens=5, output_tokens=5)
            assert c.tokens == 10
            assert (await led.balance_async(a)).used == {"tokens": 60}
        await led.aclose()

    asyncio.run(main())
    assert sorted(led.balance(a).used["tokens"] for a in accounts) == [60] * 6


def test_units_of_your_own_on_a_cluster(cluster: RedisCluster) -> None:
    """Charges, holds and a campaign in units of your own, through the cluster client
    (each account's script on its node)."""
    clock = rq.ManualClock(T0)
    led = RedisLedger(cluster, name=f"u{time.monotonic_ns()}", clock=clock)
    accounts = [f"studio-{i}" for i in range(6)]
    for a in accounts:
        led.set_plan(a, Plan("art", tokens=100, units={"images": 10}, period=Daily()))
        assert led.charge("r", a, units={"images": 8}).units == {"images": 8}
        assert led.charge("r", a, units={"images": 8}).replay
        led.hold("h-" + a, a, units={"images": 2})
        assert led.settle("h-" + a, input_tokens=1, output_tokens=0, units={"images": 1}).units == {
            "images": 1
        }
    assert {led.balance(a).used["images"] for a in accounts} == {9}
    got: list[Notice] = []
    led.deliver(got.append)
    assert {(n.unit, n.threshold) for n in got} == {("images", 0.8), ("images", 0.95)}
    rep = led.compensate("camp", batch=4)
    assert rep.bonus_added == {"tokens": 150, "images": 12}
    assert led.balance("studio-0").remaining == {"tokens": 125, "images": 12}
