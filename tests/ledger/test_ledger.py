"""The quota ledger's behaviour, the same suite against SQLite and a real redis-server."""

from __future__ import annotations

import asyncio
import atexit
import io
import threading
import time
from datetime import datetime, timezone

import pytest
import ratequeue as rq
from forking import join_or_fail
from ledger_backends import T0, Factory, shared_redis, stop_shared_redis
from ledger_blocking import sqlite_writer_blocked
from ratequeue.ledger import (
    Daily,
    Every,
    IdempotencyConflict,
    LedgerError,
    Monthly,
    Notice,
    Plan,
    RedisLedger,
    SqliteLedger,
    UnknownAccount,
    UnknownRequest,
)

atexit.register(stop_shared_redis)

PRO = Plan("pro", tokens=1000, calls=100)


def ts(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()


# -- idempotent deduction ------------------------------------------------------------------


def test_charge_counts_once_per_request_id_and_says_replay(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", PRO)
    first = led.charge("r1", "acme", input_tokens=100, output_tokens=50, model="m", meta={"k": 1})
    assert not first.replay and first.tokens == 150
    clock.advance(5)
    again = led.charge("r1", "acme", input_tokens=100, output_tokens=50, model="m", meta={"k": 1})
    assert again.replay and again.at == first.at and again.tokens == 150
    assert again.meta == {"k": 1} and again.model == "m"
    assert led.balance("acme").used == {"tokens": 150, "calls": 1}


@pytest.mark.parametrize(
    "change",
    [
        {"input_tokens": 101},
        {"output_tokens": 51},
        {"calls": 2},
        {"model": "other"},
        {"parent_id": "p"},
        {"meta": {"k": 2}},
    ],
)
def test_same_id_with_another_payload_is_refused(make: Factory, clock, change: dict) -> None:
    led = make(clock)
    led.set_plan("acme", PRO)
    base = {"input_tokens": 100, "output_tokens": 50, "model": "m", "meta": {"k": 1}}
    led.charge("r1", "acme", **base)
    with pytest.raises(IdempotencyConflict):
        led.charge("r1", "acme", **{**base, **change})
    assert led.balance("acme").used["tokens"] == 150


def test_a_charge_id_cannot_be_reused_as_a_hold(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", PRO)
    led.charge("r1", "acme", input_tokens=10)
    with pytest.raises(IdempotencyConflict):
        led.hold("r1", "acme", input_tokens=10)


def test_out_of_quota_charges_nothing_and_says_when_it_resets(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", PRO)
    led.charge("a", "acme", input_tokens=900)
    with pytest.raises(rq.QuotaExceeded) as e:
        led.charge("b", "acme", input_tokens=101)
    assert isinstance(e.value, rq.RateQueueError)
    assert e.value.reset_at == ts("2026-01-01T00:00:00") and e.value.unit == "tokens"
    assert e.value.retry_after == pytest.approx(31 * 86400)
    assert e.value.account == "acme"
    assert led.balance("acme").used == {"tokens": 900, "calls": 1}
    # the refused id was not recorded: the same id later is a fresh charge
    led.charge("b", "acme", input_tokens=100)
    assert led.balance("acme").remaining == {"tokens": 0, "calls": 98}


def test_every_unit_must_fit_all_or_nothing(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=1000, calls=2))
    led.charge("a", "acme", input_tokens=1, calls=2)
    with pytest.raises(rq.QuotaExceeded) as e:
        led.charge("b", "acme", input_tokens=5)
    assert e.value.unit == "calls"
    assert led.balance("acme").used == {"tokens": 1, "calls": 2}


def test_bonus_is_spent_after_the_plan_quota(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=100))
    led.compensate("gift", ["acme"], reset_usage=False, bonus=0.5)
    assert led.balance("acme").bonus == {"tokens": 50}
    led.charge("a", "acme", input_tokens=80)
    assert led.balance("acme").bonus == {"tokens": 50}
    led.charge("b", "acme", input_tokens=40)
    b = led.balance("acme")
    assert b.used == {"tokens": 100} and b.bonus == {"tokens": 30} and b.remaining["tokens"] == 30
    with pytest.raises(rq.QuotaExceeded):
        led.charge("c", "acme", input_tokens=31)
    # the bonus outlives the period; the plan quota renews
    clock.set(ts("2026-01-01T00:00:00"))
    assert led.balance("acme").remaining == {"tokens": 130}


def test_unknown_account_and_default_plan(make: Factory, clock) -> None:
    led = make(clock)
    with pytest.raises(UnknownAccount):
        led.charge("a", "nobody", input_tokens=1)
    with pytest.raises(UnknownAccount):
        led.balance("nobody")
    auto = make(clock, default_plan=Plan("free", tokens=10))
    auto.charge("a", "newbie", input_tokens=4)
    assert auto.balance("newbie").used == {"tokens": 4}
    assert auto.plan_of("newbie").name == "free"
    assert "newbie" in list(auto.accounts())


def test_a_new_plan_takes_effect_in_every_process(make: Factory, clock) -> None:
    one, two = make(clock), make(clock)
    one.set_plan("acme", Plan("small", tokens=10))
    two.charge("a", "acme", input_tokens=10)  # `two` caches the small plan
    one.set_plan("acme", Plan("big", tokens=1000))
    two.charge("b", "acme", input_tokens=500)
    assert two.balance("acme").plan == "big" and two.balance("acme").used == {"tokens": 510}


# -- hold and settle -----------------------------------------------------------------------


def test_holds_stop_concurrent_overspend_and_settle_corrects(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=1000))
    h = led.hold("h1", "acme", input_tokens=600)
    assert h.expires_at == T0 + 600 and not h.replay
    assert led.hold("h1", "acme", input_tokens=600).replay
    assert led.balance("acme").held == {"tokens": 600}
    with pytest.raises(rq.QuotaExceeded):
        led.hold("h2", "acme", input_tokens=500)
    c = led.settle("h1", input_tokens=100, output_tokens=50, model="m")
    assert (c.input_tokens, c.output_tokens, c.model, c.replay) == (100, 50, "m", False)
    b = led.balance("acme")
    assert b.used == {"tokens": 150} and b.held == {"tokens": 0}
    assert led.settle("h1", input_tokens=100, output_tokens=50, model="m").replay
    with pytest.raises(IdempotencyConflict):
        led.settle("h1", input_tokens=999, output_tokens=0)
    rows = led.usage("acme").rows
    assert [(r.request_id, r.tokens) for r in rows] == [("h1", 150)]


def test_settle_above_the_estimate_records_the_work_past_the_quota(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=100))
    led.hold("h", "acme", input_tokens=90)
    led.settle("h", input_tokens=90, output_tokens=60)
    b = led.balance("acme")
    assert b.used == {"tokens": 150} and b.remaining == {"tokens": 0}
    with pytest.raises(rq.QuotaExceeded):
        led.charge("next", "acme", input_tokens=1)


def test_release_gives_the_hold_back_and_is_idempotent(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=100))
    led.hold("h", "acme", input_tokens=70)
    led.release("h")
    led.release("h")
    led.release("never-held")
    assert led.balance("acme").used == {"tokens": 0}
    assert led.balance("acme").held == {"tokens": 0}
    # a late settle still records what was used
    led.settle("h", input_tokens=5, output_tokens=0)
    assert led.balance("acme").used == {"tokens": 5}
    led.release("h")
    assert led.balance("acme").used == {"tokens": 5}


def test_a_hold_never_settled_expires_and_gives_back(make: Factory, clock) -> None:
    led = make(clock, hold_ttl=30)
    led.set_plan("acme", Plan("p", tokens=100))
    led.hold("h", "acme", input_tokens=80)
    clock.advance(29)
    assert led.balance("acme").used == {"tokens": 80}
    clock.advance(1)
    b = led.balance("acme")
    assert b.used == {"tokens": 0} and b.held == {"tokens": 0}
    led.charge("x", "acme", input_tokens=100)  # the whole quota is free again
    # settled after its expiry: the actual usage is recorded, past the quota if need be
    led.settle("h", input_tokens=10, output_tokens=0)
    assert led.balance("acme").used == {"tokens": 110}


def test_expire_holds_sweeps_every_account(make: Factory, clock) -> None:
    led = make(clock, hold_ttl=10)
    for a in ("a", "b"):
        led.set_plan(a, Plan("p", tokens=100))
        led.hold(f"h-{a}", a, input_tokens=50)
    clock.advance(11)
    assert led.expire_holds() >= 1
    assert led.balance("a").held == {"tokens": 0} and led.balance("b").used == {"tokens": 0}


def test_hold_bonus_part_comes_back_to_the_bonus(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=100))
    led.compensate("g", ["acme"], reset_usage=False, bonus=0.2)
    led.charge("a", "acme", input_tokens=90)
    led.hold("h", "acme", input_tokens=25)  # 10 from the plan, 15 from the bonus
    assert led.balance("acme").bonus == {"tokens": 5}
    led.release("h")
    b = led.balance("acme")
    assert b.bonus == {"tokens": 20} and b.used == {"tokens": 90}


def test_settle_without_a_hold(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", PRO)
    with pytest.raises(UnknownRequest):
        led.settle("nothing", input_tokens=1, output_tokens=1)
    c = led.settle("direct", input_tokens=3, output_tokens=4, account="acme")
    assert c.tokens == 7 and not c.replay
    assert led.settle("direct", input_tokens=3, output_tokens=4, account="acme").replay
    assert led.balance("acme").used == {"tokens": 7, "calls": 1}


def test_a_hold_settled_by_another_process(make: Factory, clock) -> None:
    one, two = make(clock), make(clock)
    one.set_plan("acme", PRO)
    one.hold("h", "acme", input_tokens=500, parent_id="user-req", meta={"route": "/chat"})
    c = two.settle("h", input_tokens=20, output_tokens=30)
    assert c.account == "acme" and c.parent_id == "user-req" and c.meta == {"route": "/chat"}
    two.release("h")
    assert one.balance("acme").used == {"tokens": 50, "calls": 1}


# -- periods -----------------------------------------------------------------------------


def test_calendar_month_renews_and_warnings_fire_again(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=100))
    led.charge("a", "acme", input_tokens=100)
    assert led.balance("acme").period == "2025-12"
    clock.set(ts("2025-12-31T23:59:59"))
    with pytest.raises(rq.QuotaExceeded) as e:
        led.charge("b", "acme", input_tokens=1)
    assert e.value.retry_after == pytest.approx(1.0)
    clock.set(ts("2026-01-01T00:00:00"))
    led.charge("b", "acme", input_tokens=100)
    b = led.balance("acme")
    assert b.period == "2026-01" and b.used == {"tokens": 100}
    assert sorted((n.period, n.threshold) for n in led.pending_notices()) == [
        ("2025-12", 0.8),
        ("2025-12", 0.95),
        ("2026-01", 0.8),
        ("2026-01", 0.95),
    ]


def test_months_anchored_to_the_purchase_date(make: Factory, clock) -> None:
    led = make(clock)
    clock.set(ts("2026-01-31T10:00:00"))
    led.set_plan("acme", Plan("p", tokens=100, period=Monthly(anchored=True)), anchor=clock.now())
    b = led.balance("acme")
    assert (b.period_start, b.reset_at) == (ts("2026-01-31T10:00:00"), ts("2026-02-28T10:00:00"))
    led.charge("a", "acme", input_tokens=100)
    clock.set(ts("2026-02-28T09:59:59"))
    with pytest.raises(rq.QuotaExceeded):
        led.charge("b", "acme", input_tokens=1)
    clock.set(ts("2026-02-28T10:00:00"))
    b = led.balance("acme")
    assert b.used == {"tokens": 0} and b.reset_at == ts("2026-03-31T10:00:00")


def test_daily_in_a_time_zone_and_custom_periods(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("tokyo", Plan("d", calls=2, period=Daily(tz="Asia/Tokyo")))
    led.set_plan("hourly", Plan("h", calls=1, period=Every(3600)))
    b = led.balance("tokyo")  # 2025-12-01T00:00Z is 09:00 in Tokyo
    assert b.period == "2025-12-01" and b.reset_at == ts("2025-12-01T15:00:00")
    led.charge("a", "tokyo")
    led.charge("b", "tokyo")
    clock.set(ts("2025-12-01T15:00:00"))
    led.charge("c", "tokyo")
    led.charge("x", "hourly")
    with pytest.raises(rq.QuotaExceeded):
        led.charge("y", "hourly")
    clock.advance(3600)
    led.charge("y", "hourly")


def test_retention_must_cover_the_period(make: Factory, clock) -> None:
    led = make(clock, retention=2 * 86_400.0)
    with pytest.raises(ValueError, match="retention"):
        led.set_plan("acme", PRO)
    led.set_plan("acme", Plan("d", tokens=10, period=Daily()))


# -- warnings ----------------------------------------------------------------------------


def test_thresholds_fire_exactly_once_per_account_and_period(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=100))
    led.set_plan("beta", Plan("p", tokens=100), thresholds=[0.5])
    for i in range(10):
        led.charge(f"a{i}", "acme", input_tokens=10)
        led.charge(f"b{i}", "beta", input_tokens=10)
    got = led.pending_notices()
    assert sorted((n.account, n.threshold, n.used) for n in got) == [
        ("acme", 0.8, 80),
        ("acme", 0.95, 100),
        ("beta", 0.5, 50),
    ]
    # compensation resets usage but not the notices of the period
    led.compensate("c", ["acme"])
    for i in range(10):
        led.charge(f"again{i}", "acme", input_tokens=10)
    assert len(led.pending_notices()) == 3


def test_outbox_delivers_at_least_once_with_a_stable_id(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=100))
    led.charge("a", "acme", input_tokens=96)
    seen: list[Notice] = []

    def flaky(n: Notice) -> None:
        seen.append(n)
        if len(seen) == 1:
            raise RuntimeError("receiver down")

    with pytest.raises(RuntimeError):
        led.deliver(flaky)
    assert len(led.pending_notices()) == 2  # nothing acknowledged is lost
    assert led.deliver(flaky) == 2
    assert led.pending_notices() == [] and led.deliver(flaky) == 0
    ids = [n.id for n in seen]
    assert ids[0] in ids[1:] and len(set(ids)) == 2
    assert {n.threshold for n in seen} == {0.8, 0.95}


def test_async_delivery_to_async_and_sync_callbacks(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=100))
    led.charge("a", "acme", input_tokens=85)
    got: list[str] = []

    async def receiver(n: Notice) -> None:
        await asyncio.sleep(0)
        got.append(n.id)

    assert asyncio.run(led.deliver_async(receiver)) == 1
    led.charge("b", "acme", input_tokens=10)
    assert led.deliver(receiver) == 1  # an async callback from sync code
    assert got == ["acme|2025-12|tokens|8000", "acme|2025-12|tokens|9500"]


# -- usage detail ------------------------------------------------------------------------


def test_usage_rows_paginate_by_time_range(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=10**6))
    for i in range(25):
        clock.advance(60)
        led.charge(f"r{i:02}", "acme", input_tokens=i, model="a" if i % 2 else "b")
    seen, cursor = [], None
    while True:
        page = led.usage("acme", limit=7, cursor=cursor)
        seen += [r.request_id for r in page.rows]
        if page.cursor is None:
            break
        cursor = page.cursor
    assert seen == [f"r{i:02}" for i in range(25)]
    rng = led.usage("acme", start=T0 + 60 * 5, end=T0 + 60 * 8).rows
    assert [r.request_id for r in rng] == ["r04", "r05", "r06"]
    totals = led.totals_by_model("acme")
    assert totals["a"].input_tokens == sum(range(1, 25, 2)) and totals["b"].requests == 13
    out = io.StringIO()
    assert led.export_csv("acme", out, start=T0 + 60 * 5, end=T0 + 60 * 7) == 2
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("request_id,parent_id,account") and lines[1].startswith("r04,")


def test_one_user_request_with_its_sub_calls(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", PRO)
    led.charge("user-1", "acme", input_tokens=5)
    led.charge("sub-a", "acme", input_tokens=10, output_tokens=1, parent_id="user-1", model="x")
    led.hold("sub-b", "acme", input_tokens=100, parent_id="user-1")
    led.settle("sub-b", input_tokens=20, output_tokens=2)
    led.charge("other", "acme", input_tokens=99)
    u = led.request_usage("acme", "user-1")
    assert sorted(r.request_id for r in u.rows) == ["sub-a", "sub-b", "user-1"]
    assert (u.totals.input_tokens, u.totals.output_tokens, u.totals.requests) == (35, 3, 3)


# -- compensation ------------------------------------------------------------------------


def test_reset_plus_bonus_is_idempotent_and_audited(make: Factory, clock) -> None:
    led = make(clock)
    for a in ("a", "b", "c"):
        led.set_plan(a, Plan("p", tokens=1000))
        led.charge("x", a, input_tokens=400)
    dry = led.compensate("pm-1", dry_run=True)
    assert dry.dry_run and dry.changed == 3 and dry.bonus_added == {"tokens": 750}
    assert led.balance("a").used == {"tokens": 400} and led.audit("pm-1", "a") is None
    calls: list[tuple[int, int]] = []
    rep = led.compensate("pm-1", progress=lambda done, total: calls.append((done, total)))
    assert rep.changed == 3 and rep.credited == {"tokens": 1200}
    assert calls[-1] == (3, 3)
    b = led.balance("b")
    assert b.used == {"tokens": 0} and b.bonus == {"tokens": 250}
    audit = led.audit("pm-1", "b")
    assert audit is not None and audit["before"]["used"] == {"tokens": 400}
    assert audit["after"]["bonus"] == {"tokens": 250}
    again = led.compensate("pm-1")
    assert again.changed == 0 and again.already_done == 3
    assert led.balance("b").bonus == {"tokens": 250}
    with pytest.raises(IdempotencyConflict):
        led.compensate("pm-1", bonus=0.5)


def test_a_campaign_resumes_where_it_stopped(make: Factory, clock) -> None:
    led = make(clock)
    accounts = [f"acct-{i:03}" for i in range(30)]
    for a in accounts:
        led.set_plan(a, Plan("p", tokens=100))
        led.charge("x", a, input_tokens=60)
    led.compensate("pm", accounts[:12], batch=5)  # as if it crashed after 12
    rep = led.compensate("pm", batch=7)
    assert (rep.already_done, rep.changed) == (12, 18)
    assert all(led.balance(a).bonus == {"tokens": 25} for a in accounts)


def test_credit_never_drives_usage_negative(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("low", Plan("p", tokens=1000))
    led.set_plan("high", Plan("p", tokens=1000))
    led.charge("x", "low", input_tokens=100)
    led.charge("x", "high", input_tokens=900)
    rep = led.compensate("credit", credit=0.25)
    assert led.balance("low").used == {"tokens": 0}
    assert led.balance("high").used == {"tokens": 650}
    assert led.balance("low").bonus == {"tokens": 0}
    assert rep.credited == {"tokens": 350}
    led.hold("h", "low", input_tokens=10)
    led.compensate("reset", ["low"])
    led.release("h")  # the give-back after a reset stays at 0
    assert led.balance("low").used == {"tokens": 0}


def test_compensation_skips_accounts_without_a_plan(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("a", PRO)
    rep = led.compensate("c", ["a", "ghost"])
    assert (rep.changed, rep.skipped) == (1, 1)


# -- arguments ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "exc"),
    [
        ({"input_tokens": -1}, ValueError),
        ({"input_tokens": True}, TypeError),
        ({"input_tokens": 1.5}, TypeError),
        ({"input_tokens": "1"}, TypeError),
        ({"output_tokens": 2**63}, ValueError),
        ({"input_tokens": 2**62, "output_tokens": 2**62}, ValueError),
        ({"calls": -1}, ValueError),
        ({"model": "m" * 300}, ValueError),
        ({"parent_id": ""}, ValueError),
        ({"meta": {"x": "y" * 5000}}, ValueError),
        ({"meta": {"x": object()}}, ValueError),
        ({"meta": [1]}, TypeError),
    ],
)
def test_bad_arguments_are_clear_errors(make: Factory, clock, kw: dict, exc: type) -> None:
    led = make(clock)
    led.set_plan("acme", PRO)
    with pytest.raises(exc):
        led.charge("r", "acme", **kw)
    with pytest.raises(exc):
        led.hold("r", "acme", **kw)
    assert led.balance("acme").used == {"tokens": 0, "calls": 0}


def test_bad_ids_and_plans(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", PRO)
    for bad in ("", "x" * 257):
        with pytest.raises(ValueError):
            led.charge(bad, "acme")
        with pytest.raises(ValueError):
            led.charge("r", bad)
    with pytest.raises(TypeError):
        led.charge(1, "acme")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Plan("p")
    with pytest.raises(ValueError):
        Plan("p", tokens=-1)
    with pytest.raises(ValueError):
        Plan("p", tokens=1, thresholds=[1.5])
    with pytest.raises(TypeError):
        led.set_plan("acme", "pro")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        led.usage("acme", limit=0)


def test_redis_refuses_amounts_past_2_53(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=2**62))
    if make.backend == "redis":  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match="2\\*\\*53"):
            led.charge("r", "acme", input_tokens=2**53)
    else:
        led.charge("r", "acme", input_tokens=2**53)
        assert led.balance("acme").used == {"tokens": 2**53}


def test_braces_in_account_names(make: Factory, clock) -> None:
    led = make(clock)
    for a in ("{x}", "a}b{", "tenant:{7}"):
        led.set_plan(a, Plan("p", tokens=10))
        led.charge("r", a, input_tokens=10)
        assert led.balance(a).used == {"tokens": 10}
    assert len(led.pending_notices()) == 6


# -- concurrency and asyncio -------------------------------------------------------------


def test_threads_with_retries_count_exactly(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=10**9))
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(150):
                for _ in range(1 + (i % 3 == 0)):  # a third retried
                    led.charge(f"{w}-{i}", "acme", input_tokens=i, output_tokens=1)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert led.balance("acme").used == {"tokens": 6 * sum(i + 1 for i in range(150))}


def test_async_twins(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", PRO)

    async def main() -> None:
        c = await led.charge_async("a", "acme", input_tokens=10)
        assert not c.replay
        h = await led.hold_async("h", "acme", input_tokens=100)
        assert h.account == "acme"
        s = await led.settle_async("h", input_tokens=1, output_tokens=2)
        assert s.tokens == 3
        await led.release_async("h")
        b = await led.balance_async("acme")
        assert b.used == {"tokens": 13, "calls": 2}

    asyncio.run(main())


def test_a_cancelled_hold_async_is_given_back(make: Factory, clock, monkeypatch) -> None:
    """Cancelled after the hold was made but before its caller saw it: given back."""
    led = make(clock)
    led.set_plan("acme", PRO)
    gate, given_back = threading.Event(), threading.Event()
    real_release = led.release

    def release(request_id: str) -> None:
        real_release(request_id)
        given_back.set()

    monkeypatch.setattr(led, "release", release)
    if make.backend == "sqlite":  # type: ignore[attr-defined]
        # the hold runs in the writer thread's transaction while its caller is cancelled
        real_hold_fn, real_release_fn = led._hold_call, led._release_call  # type: ignore[attr-defined]

        def hold_fn(*a):
            fn = real_hold_fn(*a)

            def slow(conn):
                made.set()
                gate.wait(10)
                return fn(conn)

            return slow

        def release_fn(rid, account=None):
            fn = real_release_fn(rid, account)

            def counted(conn):
                fn(conn)
                given_back.set()

            return counted

        monkeypatch.setattr(led, "_hold_call", hold_fn)
        monkeypatch.setattr(led, "_release_call", release_fn)
        made = threading.Event()  # type: ignore[assignment]
    else:  # redis.asyncio: the script runs, then the reply is late
        made = asyncio.Event()  # type: ignore[assignment]
        real_aexec = led._aexec  # type: ignore[attr-defined]

        async def slow_aexec(client, step):
            r = await real_aexec(client, step)
            if step[0] == "eval":
                made.set()
                await asyncio.sleep(30)
            return r

        monkeypatch.setattr(led, "_aexec", slow_aexec)
        real_release_flow = led._release_call  # type: ignore[attr-defined]

        def release_flow(rid, account=None):
            yield from real_release_flow(rid, account)
            given_back.set()

        monkeypatch.setattr(led, "_release_call", release_flow)

    async def main() -> None:
        task = asyncio.ensure_future(led.hold_async("h", "acme", input_tokens=500))
        await asyncio.sleep(0.05)
        if make.backend == "redis":  # type: ignore[attr-defined]
            await asyncio.wait_for(made.wait(), 10)
            assert led.balance("acme").held["tokens"] == 500
        else:
            assert await asyncio.to_thread(made.wait, 10)  # in the transaction
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()  # the hold is made after its caller left, on a closed loop

    asyncio.run(main())
    assert given_back.wait(30)
    b = led.balance("acme")
    assert b.used == {"tokens": 0, "calls": 0} and b.held == {"tokens": 0, "calls": 0}


def test_sqlite_survives_reopen_and_is_one_file(tmp_path, clock) -> None:
    path = tmp_path / "q.db"
    led = SqliteLedger(path, clock=clock)
    led.set_plan("acme", PRO)
    led.charge("a", "acme", input_tokens=7)
    led.close()
    again = SqliteLedger(path, clock=clock)
    assert again.charge("a", "acme", input_tokens=7).replay
    assert again.balance("acme").used == {"tokens": 7, "calls": 1}
    again.close()


def test_sqlite_rows_are_kept_for_the_retention_window(tmp_path, clock) -> None:
    led = SqliteLedger(tmp_path / "q.db", clock=clock, retention=3 * 86400)
    led.set_plan("acme", Plan("d", tokens=100, period=Daily()))
    led.charge("old", "acme", input_tokens=1)
    clock.advance(86400 + 3 * 86400 - 1)  # the period ended; kept `retention` after that
    assert led.charge("old", "acme", input_tokens=1).replay
    clock.advance(2)
    led.charge("new", "acme", input_tokens=1)
    clock.advance(3600)  # purges run at most every retention / 100 (<= 1 h)
    led.charge("newer", "acme", input_tokens=1)
    assert [r.request_id for r in led.usage("acme").rows] == ["new", "newer"]
    led.close()


def test_notifier_delivers_in_the_background(make: Factory, clock) -> None:
    from ratequeue.ledger import Notifier

    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=100))
    got: list[str] = []
    arrived = threading.Event()
    calls = {"n": 0}

    async def receiver(n: Notice) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("first delivery fails")
        got.append(n.id)
        if len(got) == 2:
            arrived.set()

    with Notifier(led, receiver, interval=0.05) as notifier:
        led.charge("a", "acme", input_tokens=96)  # wakes the notifier at once
        assert arrived.wait(30)
    assert sorted(got) == ["acme|2025-12|tokens|8000", "acme|2025-12|tokens|9500"]
    assert notifier.failures == 1 and notifier.delivered == 2
    assert led.pending_notices() == []
    with pytest.raises(ValueError):
        Notifier(led, receiver, interval=0)


def test_redis_notices_survive_a_lost_hint(clock) -> None:
    server = shared_redis()
    name = f"hint-{time.monotonic_ns()}"
    led = RedisLedger(server.client(timeout=5.0), name=name, clock=clock)
    led.set_plan("acme", Plan("p", tokens=100))
    led.charge("a", "acme", input_tokens=90)
    led.client.delete(led._prefix + "notify")  # as if the process died before SADD
    fresh = RedisLedger(server.client(timeout=5.0), name=name, clock=clock)
    seen: list[Notice] = []
    assert fresh.deliver(seen.append) == 1 and seen[0].threshold == 0.8  # swept
    led.close()
    fresh.close()


def test_a_forked_child_uses_the_same_ledger_object(make: Factory, clock) -> None:
    import multiprocessing

    led = make(clock)
    led.set_plan("acme", PRO)
    led.charge("parent", "acme", input_tokens=5)

    def child() -> None:
        led.charge("child", "acme", input_tokens=7)
        led.charge("parent", "acme", input_tokens=5)  # a replay, seen from the child

    p = multiprocessing.get_context("fork").Process(target=child)
    p.start()
    join_or_fail([p], 60)
    assert p.exitcode == 0
    assert led.balance("acme").used == {"tokens": 12, "calls": 2}
    assert led.charge("child", "acme", input_tokens=7).replay


@pytest.mark.parametrize(
    ("period", "t", "anchor", "start", "end"),
    [
        (Monthly(), "2024-02-10T00:00:00", None, "2024-02-01T00:00:00", "2024-03-01T00:00:00"),
        (Monthly(), "2024-12-31T23:59:59", None, "2024-12-01T00:00:00", "2025-01-01T00:00:00"),
        # New York: midnight local is 05:00Z in winter, 04:00Z in summer
        (
            Monthly(tz="America/New_York"),
            "2024-03-15T12:00:00",
            None,
            "2024-03-01T05:00:00",
            "2024-04-01T04:00:00",
        ),
        # a day with the spring DST change is 23 hours long
        (
            Daily(tz="Europe/Paris"),
            "2024-03-31T12:00:00",
            None,
            "2024-03-30T23:00:00",
            "2024-03-31T22:00:00",
        ),
        # anchored on the 29th of February: the 28th in common years, the 29th in leap years
        (
            Monthly(anchored=True),
            "2025-02-28T12:00:00",
            "2024-02-29T10:00:00",
            "2025-02-28T10:00:00",
            "2025-03-29T10:00:00",
        ),
        (
            Monthly(anchored=True),
            "2025-02-28T09:00:00",
            "2024-02-29T10:00:00",
            "2025-01-29T10:00:00",
            "2025-02-28T10:00:00",
        ),
        (
            Every(3600, origin=1800),
            "2024-01-01T00:10:00",
            None,
            "2023-12-31T23:30:00",
            "2024-01-01T00:30:00",
        ),
    ],
)
def test_period_boundaries(period, t, anchor, start, end) -> None:
    span = period.at(ts(t), None if anchor is None else ts(anchor))
    assert (span.start, span.end) == (ts(start), ts(end))
    assert span.start <= ts(t) < span.end


def test_plans_round_trip_through_their_description() -> None:
    for period in (Monthly(tz="Asia/Tokyo", anchored=True), Daily(), Every(60, origin=5)):
        plan = Plan("p", tokens=5, calls=2, period=period, thresholds=[0.5, 0.9])
        again = Plan.from_dict(plan.to_dict())
        assert again == plan and again.thresholds == (0.5, 0.9)
        assert repr(again) == repr(plan)


def test_ctrl_c_inside_a_transaction_records_nothing_and_never_hangs(tmp_path) -> None:
    state = {"t": T0, "interrupt": False}

    def clock_fn() -> float:
        if state["interrupt"]:
            state["interrupt"] = False
            raise KeyboardInterrupt
        return state["t"]

    led = SqliteLedger(tmp_path / "q.db", clock=clock_fn)
    led.set_plan("acme", Plan("big", tokens=10**6, calls=10**6))
    state["interrupt"] = True
    with pytest.raises(KeyboardInterrupt):
        led.charge("a", "acme", input_tokens=5)
    assert led.balance("acme").used == {"tokens": 0, "calls": 0}
    assert not led.charge("a", "acme", input_tokens=5).replay  # the lead was handed back
    errors: list[BaseException] = []
    done: list[str] = []

    def worker(w: int) -> None:
        try:
            for i in range(50):
                led.charge(f"{w}-{i}", "acme", input_tokens=1)
                done.append(f"{w}-{i}")
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    state["interrupt"] = True  # the first transaction of the threads is interrupted
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    assert not state["interrupt"] and len(errors) >= 1
    rows = {r.request_id: r.tokens for r in led.iter_usage("acme")}
    assert set(rows) == {"a", *done}  # every call that returned counted, no other
    assert led.balance("acme").used == {"tokens": sum(rows.values()), "calls": len(rows)}
    assert all(isinstance(e, (KeyboardInterrupt, LedgerError)) for e in errors), errors
    led.close()


def test_a_campaign_over_many_accounts_in_batches(make: Factory, clock) -> None:
    led = make(clock)
    accounts = [f"u{i:05}" for i in range(1200)]
    for a in accounts:
        led.set_plan(a, Plan("p", tokens=400))
    for a in accounts[::7]:
        led.charge("x", a, input_tokens=100)
    seen: list[tuple[int, int]] = []
    rep = led.compensate("big", progress=lambda d, t: seen.append((d, t)), batch=500)
    assert (rep.accounts, rep.changed) == (1200, 1200)
    assert rep.bonus_added == {"tokens": 1200 * 100} and rep.credited == {"tokens": 172 * 100}
    assert seen == [(500, 1200), (1000, 1200), (1200, 1200)]
    assert len(rep.actions) == 1000  # the report keeps the first 1,000 actions
    assert led.balance(accounts[7]).used == {"tokens": 0}
    assert led.compensate("big").already_done == 1200


def test_sqlite_group_commit_decides_queued_charges_together(tmp_path, clock) -> None:
    led = SqliteLedger(tmp_path / "q.db", clock=clock)
    led.set_plan("acme", Plan("p", tokens=100))
    led.charge("old", "acme", input_tokens=10)
    grouped: list[int] = []
    real = led._charge_batch

    def counting(conn, ops):
        grouped.append(len(ops))
        return real(conn, ops)

    led._charge_batch = counting  # type: ignore[method-assign]
    calls = [
        ("a", 30),
        ("old", 10),  # a replay
        ("old", 11),  # a conflict
        ("a", 30),  # a replay of a charge in the same transaction
        ("b", 70),  # out of quota
        ("c", 60),
    ]
    results: dict[int, object] = {}

    def call(k: int, rid: str, n: int) -> None:
        try:
            results[k] = led.charge(rid, "acme", input_tokens=n)
        except Exception as e:
            results[k] = e

    threads = []
    with sqlite_writer_blocked(led):
        for k, (rid, n) in enumerate(calls):  # queued in this order behind the writer
            t = threading.Thread(target=call, args=(k, rid, n))
            t.start()
            threads.append(t)
            for _ in range(1000):
                if len(led._queue) == k + 1:
                    break
                time.sleep(0.001)
        assert len(led._queue) == len(calls)
    for t in threads:
        t.join(30)
    kinds = [type(results[k]).__name__ for k in range(len(calls))]
    assert kinds == ["Charge", "Charge", "IdempotencyConflict", "Charge", "QuotaExceeded", "Charge"]
    assert [results[k].replay for k in (0, 1, 3, 5)] == [False, True, True, False]
    assert led.balance("acme").used == {"tokens": 100}
    assert sorted(r.request_id for r in led.iter_usage("acme")) == ["a", "c", "old"]
    assert grouped == [6]  # the six queued charges were decided in one go
    led.close()


def test_the_ledger_package_exports_its_all() -> None:
    import ratequeue.ledger as ledger

    assert len(ledger.__all__) == len(set(ledger.__all__))
    for name in ledger.__all__:
        assert getattr(ledger, name) is not None
    assert ledger.QuotaExceeded is rq.QuotaExceeded
    assert issubclass(rq.QuotaExceeded, rq.RateQueueError)
    assert {"SqliteLedger", "RedisLedger", "QuotaPolicy", "QuotaLevel", "Notifier"} <= set(
        ledger.__all__
    )
