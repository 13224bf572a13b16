"""Quotas in units of your own (``Plan(units=...)``, ``charge(units=...)``), the same suite
against SQLite and a real redis-server; and a SQLite file of the schema before them."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import sqlite3
import subprocess
import sys

import pytest
import ratequeue as rq
from ledger_backends import Factory
from ratequeue.ledger import IdempotencyConflict, Plan, SqliteLedger

IMG = Plan("pro", tokens=1000, units={"images": 10, "usd_micros": 5_000})


def test_a_plan_counts_units_of_your_own(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", IMG)
    assert led.plan_of("acme") == IMG
    assert led.plan_of("acme").quota == {"tokens": 1000, "images": 10, "usd_micros": 5000}
    c = led.charge("r1", "acme", input_tokens=10, units={"images": 3, "usd_micros": 700})
    assert c.units == {"images": 3, "usd_micros": 700} and not c.replay
    again = led.charge("r1", "acme", input_tokens=10, units={"usd_micros": 700, "images": 3})
    assert again.replay and again.units == {"images": 3, "usd_micros": 700}
    led.charge("r2", "acme", input_tokens=5)  # none of them: 0 of each
    b = led.balance("acme")
    assert b.used == {"tokens": 15, "images": 3, "usd_micros": 700}
    assert b.remaining == {"tokens": 985, "images": 7, "usd_micros": 4300}


def test_out_of_quota_in_a_unit_of_your_own_takes_nothing(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", IMG)
    led.charge("a", "acme", units={"images": 9})
    with pytest.raises(rq.QuotaExceeded) as e:
        led.charge("b", "acme", input_tokens=100, units={"images": 2})
    assert e.value.unit == "images" and e.value.reset_at > clock.now()
    assert led.balance("acme").used == {"tokens": 0, "images": 9, "usd_micros": 0}
    led.charge("b", "acme", input_tokens=100, units={"images": 1})  # the id was not kept
    with pytest.raises(rq.QuotaExceeded):
        led.hold("h", "acme", units={"images": 1})


@pytest.mark.parametrize(
    "change",
    [{"images": 4}, {"images": 3, "videos": 1}, {}, {"usd_micros": 3}],
)
def test_same_id_with_other_units_is_a_conflict(make: Factory, clock, change: dict) -> None:
    led = make(clock)
    led.set_plan("acme", IMG)
    led.charge("r1", "acme", input_tokens=1, units={"images": 3})
    with pytest.raises(IdempotencyConflict):
        led.charge("r1", "acme", input_tokens=1, units=change)
    # a unit of 0 is the same payload as no unit
    led.charge("r2", "acme", input_tokens=1)
    assert led.charge("r2", "acme", input_tokens=1, units={"images": 0}).replay
    led.hold("h", "acme", units={"images": 1})
    with pytest.raises(IdempotencyConflict):
        led.hold("h", "acme", units={"images": 2})
    assert led.balance("acme").used["images"] == 4


def test_a_charge_without_units_keeps_its_fingerprint() -> None:
    # ids recorded before units existed must replay, not conflict: the digest of a
    # request without units is the one of the four built-in amounts, as it was
    from ratequeue.ledger._model import amounts, fingerprint, request_fingerprint

    am = amounts(1, 2, 1)
    old = {"tokens": 3, "input_tokens": 1, "output_tokens": 2, "calls": 1}
    assert request_fingerprint("charge", "a", am, "m", None, "") == fingerprint(
        "charge", "a", old, "m", None, ""
    )
    with_units = amounts(1, 2, 1, {"images": 1, "a_unit": 2})
    assert list(with_units) == [*old, "a_unit", "images"]
    assert request_fingerprint("charge", "a", with_units, "m", None, "") == fingerprint(
        "charge", "a", with_units, "m", None, ""
    )
    assert request_fingerprint("charge", "a", with_units, "m", None, "") != fingerprint(
        "charge", "a", old, "m", None, ""
    )


def test_hold_settle_release_and_expiry_per_unit(make: Factory, clock) -> None:
    led = make(clock, hold_ttl=30)
    led.set_plan("acme", IMG)
    h = led.hold("h1", "acme", input_tokens=100, units={"images": 5})
    assert h.units == {"images": 5}
    assert led.balance("acme").held == {"tokens": 100, "images": 5, "usd_micros": 0}
    with pytest.raises(rq.QuotaExceeded):
        led.hold("h2", "acme", units={"images": 6})
    c = led.settle("h1", input_tokens=40, output_tokens=0, units={"images": 2, "usd_micros": 9})
    assert c.units == {"images": 2, "usd_micros": 9}
    b = led.balance("acme")
    assert b.used == {"tokens": 40, "images": 2, "usd_micros": 9}
    assert b.held == {"tokens": 0, "images": 0, "usd_micros": 0}
    again = led.settle("h1", input_tokens=40, output_tokens=0, units={"images": 2, "usd_micros": 9})
    assert again.replay and again.units == {"images": 2, "usd_micros": 9}
    with pytest.raises(IdempotencyConflict):
        led.settle("h1", input_tokens=40, output_tokens=0, units={"images": 3, "usd_micros": 9})
    # released: every unit comes back
    led.hold("h3", "acme", units={"images": 8})
    led.release("h3")
    assert led.balance("acme").used["images"] == 2
    # expired: every unit comes back
    led.hold("h4", "acme", units={"images": 8, "usd_micros": 4000})
    clock.advance(31)
    b = led.balance("acme")
    assert b.used == {"tokens": 40, "images": 2, "usd_micros": 9}
    assert b.held == {"tokens": 0, "images": 0, "usd_micros": 0}
    # a settle past the quota records the work done (as for tokens)
    led.hold("h5", "acme", units={"images": 1})
    led.settle("h5", input_tokens=0, output_tokens=0, units={"images": 20})
    assert led.balance("acme").used["images"] == 22


def test_a_settle_without_units_records_none_of_them(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", IMG)
    led.hold("h", "acme", units={"images": 4})
    c = led.settle("h", input_tokens=3, output_tokens=0)
    assert c.units == {} and led.balance("acme").used["images"] == 0
    d = led.settle("direct", input_tokens=0, output_tokens=0, units={"images": 2}, account="acme")
    assert d.units == {"images": 2} and led.balance("acme").used["images"] == 2


def test_units_the_plan_does_not_name_are_recorded_and_count_against_nothing(
    make: Factory, clock
) -> None:
    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=100))
    c = led.charge("r", "acme", input_tokens=1, units={"images": 10**12})
    assert c.units == {"images": 10**12}
    assert led.balance("acme").used == {"tokens": 1}
    assert led.usage("acme").rows[0].units == {"images": 10**12}
    h = led.hold("h", "acme", units={"videos": 5})
    assert h.units == {"videos": 5}
    led.release("h")
    assert led.balance("acme").held == {"tokens": 0}


def test_usage_rows_totals_and_csv_carry_units(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", IMG)
    led.charge("u", "acme", input_tokens=1, units={"images": 1})
    clock.advance(1)
    led.charge("s1", "acme", input_tokens=2, model="dall", parent_id="u", units={"images": 2})
    clock.advance(1)
    led.charge("s2", "acme", input_tokens=3, model="gpt", parent_id="u", units={"usd_micros": 7})
    rows = led.usage("acme").rows
    assert [r.units for r in rows] == [{"images": 1}, {"images": 2}, {"usd_micros": 7}]
    req = led.request_usage("acme", "u")
    assert req.totals.units == {"images": 3, "usd_micros": 7} and req.totals.tokens == 6
    by_model = led.totals_by_model("acme")
    assert by_model["dall"].units == {"images": 2} and by_model["gpt"].units == {"usd_micros": 7}
    assert by_model[""].units == {"images": 1}
    out = io.StringIO()
    assert led.export_csv("acme", out) == 3
    got = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert [json.loads(r["units"]) for r in got] == [
        {"images": 1},
        {"images": 2},
        {"usd_micros": 7},
    ]


def test_charge_many_with_units(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", IMG)
    out = led.charge_many(
        [
            {"request_id": "a", "account": "acme", "units": {"images": 6}},
            {"request_id": "b", "account": "acme", "units": {"images": 6}},
            {"request_id": "a", "account": "acme", "units": {"images": 6}},
            {"request_id": "c", "account": "acme", "units": {"Bad": 1}},
        ]
    )
    assert isinstance(out[0], rq.ledger.Charge) and out[0].units == {"images": 6}
    assert isinstance(out[1], rq.QuotaExceeded)
    assert out[2].replay  # type: ignore[union-attr]
    assert isinstance(out[3], ValueError)
    assert led.balance("acme").used["images"] == 6


def test_warnings_fire_once_per_unit_of_your_own(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", IMG)
    for k in range(10):
        led.charge(f"r{k}", "acme", units={"images": 1})
    got = sorted((n.unit, n.threshold, n.used) for n in led.pending_notices())
    assert got == [("images", 0.8, 8), ("images", 0.95, 10)]
    ids = {n.id for n in led.pending_notices()}
    assert len(ids) == 2


def test_compensation_per_unit_of_your_own(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", IMG)
    led.charge("a", "acme", input_tokens=500, units={"images": 8, "usd_micros": 1000})
    dry = led.compensate("dry", dry_run=True)
    assert dry.credited == {"tokens": 500, "images": 8, "usd_micros": 1000}
    assert led.balance("acme").used["images"] == 8
    rep = led.compensate("inc", bonus=0.5)
    assert rep.bonus_added == {"tokens": 500, "images": 5, "usd_micros": 2500}
    b = led.balance("acme")
    assert b.used == {"tokens": 0, "images": 0, "usd_micros": 0}
    assert b.bonus == {"tokens": 500, "images": 5, "usd_micros": 2500}
    assert led.compensate("inc", bonus=0.5).already_done == 1
    # the bonus is spent after the plan quota, per unit
    led.charge("b", "acme", units={"images": 13})
    b = led.balance("acme")
    assert b.used["images"] == 10 and b.bonus["images"] == 2 and b.remaining["images"] == 2
    led.compensate("credit", credit=0.3)  # usage lowered by 3 images, never below 0
    assert led.balance("acme").used["images"] == 7


def test_units_in_the_asyncio_twins(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", IMG)

    async def main() -> None:
        c = await led.charge_async("a", "acme", units={"images": 2})
        assert c.units == {"images": 2}
        h = await led.hold_async("h", "acme", units={"images": 3})
        assert h.units == {"images": 3}
        s = await led.settle_async("h", input_tokens=0, output_tokens=0, units={"images": 1})
        assert s.units == {"images": 1}
        assert (await led.balance_async("acme")).used["images"] == 3

    asyncio.run(main())


@pytest.mark.parametrize(
    ("units", "exc"),
    [
        ({"tokens": 1}, ValueError),  # a built-in unit
        ({"calls": 1}, ValueError),
        ({"Images": 1}, ValueError),  # upper case
        ({"1st": 1}, ValueError),
        ({"a" * 33: 1}, ValueError),  # too long
        ({"im ages": 1}, ValueError),
        ({"im:ages": 1}, ValueError),  # separators of the stored forms
        ({"im=ages": 1}, ValueError),
        ({"im;ages": 1}, ValueError),
        ({"im|ages": 1}, ValueError),
        ({"": 1}, ValueError),
        ({f"u{k}": 1 for k in range(17)}, ValueError),  # too many
        ({"images": -1}, ValueError),
        ({"images": 2**63}, ValueError),
        ({"images": 1.0}, TypeError),
        ({"images": True}, TypeError),
        ({"images": "1"}, TypeError),
        ({1: 1}, TypeError),
        ([("images", 1)], TypeError),
    ],
)
def test_bad_units_are_clear_errors(make: Factory, clock, units: object, exc: type) -> None:
    led = make(clock)
    led.set_plan("acme", IMG)
    with pytest.raises(exc):
        led.charge("r", "acme", units=units)  # type: ignore[arg-type]
    with pytest.raises(exc):
        led.hold("h", "acme", units=units)  # type: ignore[arg-type]
    with pytest.raises(exc):
        led.settle("s", input_tokens=0, output_tokens=0, units=units, account="acme")  # type: ignore[arg-type]
    with pytest.raises(exc):
        Plan("p", units=units)  # type: ignore[arg-type]
    assert led.balance("acme").used == {"tokens": 0, "images": 0, "usd_micros": 0}


def test_sixteen_units_of_32_characters_are_fine(make: Factory, clock) -> None:
    names = [f"u{k:02d}" + "x" * 29 for k in range(16)]
    led = make(clock)
    led.set_plan("acme", Plan("wide", units=dict.fromkeys(names, 5)))
    c = led.charge("r", "acme", units=dict.fromkeys(names, 5))
    assert c.units == dict.fromkeys(names, 5)
    with pytest.raises(rq.QuotaExceeded):
        led.charge("r2", "acme", units={names[-1]: 1})


def test_redis_refuses_units_past_2_53(make: Factory, clock) -> None:
    led = make(clock)
    led.set_plan("acme", Plan("big", units={"images": 2**62}))
    if make.backend == "redis":  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match="2\\*\\*53"):
            led.charge("r", "acme", units={"images": 2**53})
        led.charge("r", "acme", units={"images": 2**53 - 1})
        assert led.balance("acme").used["images"] == 2**53 - 1
    else:
        led.charge("r", "acme", units={"images": 2**53})
        assert led.balance("acme").used["images"] == 2**53


def test_a_plan_with_units_round_trips() -> None:
    p = Plan("x", calls=3, units={"b": 2, "a": 0})
    assert p.quota == {"calls": 3, "a": 0, "b": 2}
    assert Plan.from_dict(json.loads(p.to_json())) == p
    with pytest.raises(ValueError):
        Plan("x", units={})


# -- a SQLite file of the schema before units ------------------------------------------

_V0_SCHEMA = """
CREATE TABLE accounts(
  account TEXT PRIMARY KEY, plan TEXT NOT NULL, anchor REAL, thresholds TEXT,
  b_tokens INTEGER NOT NULL DEFAULT 0, b_input_tokens INTEGER NOT NULL DEFAULT 0,
  b_output_tokens INTEGER NOT NULL DEFAULT 0, b_calls INTEGER NOT NULL DEFAULT 0,
  next_exp REAL);
CREATE TABLE periods(
  account TEXT NOT NULL, period TEXT NOT NULL, start REAL NOT NULL, end REAL NOT NULL,
  u_tokens INTEGER NOT NULL DEFAULT 0, u_input_tokens INTEGER NOT NULL DEFAULT 0,
  u_output_tokens INTEGER NOT NULL DEFAULT 0, u_calls INTEGER NOT NULL DEFAULT 0,
  h_tokens INTEGER NOT NULL DEFAULT 0, h_input_tokens INTEGER NOT NULL DEFAULT 0,
  h_output_tokens INTEGER NOT NULL DEFAULT 0, h_calls INTEGER NOT NULL DEFAULT 0,
  fired TEXT NOT NULL DEFAULT '', PRIMARY KEY(account, period)) WITHOUT ROWID;
CREATE TABLE requests(
  account TEXT NOT NULL, request_id TEXT NOT NULL, kind TEXT NOT NULL, status TEXT NOT NULL,
  at REAL NOT NULL, period TEXT NOT NULL, input_tokens INTEGER NOT NULL,
  output_tokens INTEGER NOT NULL, calls INTEGER NOT NULL, model TEXT, parent_id TEXT,
  meta TEXT, fp TEXT NOT NULL, sfp TEXT, parts TEXT, expires REAL,
  PRIMARY KEY(account, request_id)) WITHOUT ROWID;
"""


def test_a_file_of_the_old_schema_is_migrated_in_place(tmp_path, clock) -> None:
    path = tmp_path / "old.db"
    # a ledger file as the release before units wrote it: made by that schema, with a
    # charge recorded by the code of then (its fingerprint as it computed it)
    from ratequeue.ledger._model import amounts, request_fingerprint

    conn = sqlite3.connect(path)
    conn.executescript(_V0_SCHEMA)
    plan = Plan("pro", tokens=1000).to_json()
    conn.execute("INSERT INTO accounts(account, plan) VALUES ('acme', ?)", (plan,))
    fp = request_fingerprint("charge", "acme", amounts(10, 0, 1), None, None, "")
    conn.execute(
        "INSERT INTO periods(account, period, start, end, u_tokens, u_input_tokens, u_calls)"
        " VALUES ('acme', '2025-12', ?, ?, 10, 10, 1)",
        (clock.now(), clock.now() + 31 * 86400),
    )
    conn.execute(
        "INSERT INTO requests(account, request_id, kind, status, at, period, input_tokens,"
        " output_tokens, calls, fp) VALUES ('acme', 'old', 'charge', 'charged', ?, '2025-12',"
        " 10, 0, 1, ?)",
        (clock.now(), fp),
    )
    conn.commit()
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 0
    conn.close()

    led = SqliteLedger(path, clock=clock)
    assert led.charge("old", "acme", input_tokens=10).replay  # ids survive the upgrade
    assert led.usage("acme").rows[0].units == {}
    led.set_plan("acme", Plan("pro", tokens=1000, units={"images": 5}))
    led.charge("new", "acme", input_tokens=1, units={"images": 2})
    assert led.balance("acme").used == {"tokens": 11, "images": 2}
    led.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 1
    conn.close()
    again = SqliteLedger(path, clock=clock)  # opened again: nothing to migrate
    assert again.balance("acme").used == {"tokens": 11, "images": 2}
    again.close()


def test_cli_sets_shows_and_exports_units(tmp_path) -> None:
    db = str(tmp_path / "q.db")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ratequeue", "quota", "--db", db, *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    r = run("set-plan", "acme", "--tokens", "100", "--unit", "images=10", "--unit", "gpu_s=60")
    assert r.returncode == 0, r.stderr
    assert "images" in r.stdout and "gpu_s" in r.stdout
    led = SqliteLedger(db)
    assert led.plan_of("acme").quota == {"tokens": 100, "gpu_s": 60, "images": 10}
    led.charge("r", "acme", input_tokens=1, units={"images": 4})
    led.close()
    r = run("set-plan", "acme", "--unit", "images=20")  # other settings kept
    assert r.returncode == 0, r.stderr
    r = run("show", "acme")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("images"))
    assert line.split()[:3] == ["images", "20", "4"]
    r = run("usage", "acme")
    assert "images=4" in r.stdout
    r = run("export", "acme")
    assert r.returncode == 0 and '"{""images"": 4}"' in r.stdout
    r = run("set-plan", "acme", "--unit", "Tokens=5")
    assert r.returncode != 0 and "lower-case" in r.stderr
    r = run("set-plan", "acme", "--unit", "tokens=5")
    assert r.returncode != 0 and "built-in" in r.stderr


def test_a_unit_added_to_the_plan_and_counters_read_fresh(make: Factory, clock) -> None:
    # another ledger object on the same storage reads the counters without this one's
    # cache: a period row that never counted the unit, a campaign, a settle of a hold
    one, two = make(clock), make(clock)
    one.set_plan("acme", Plan("p", tokens=100))
    one.charge("a", "acme", input_tokens=1, units={"images": 3})  # not in the plan
    one.set_plan("acme", IMG)  # the unit now counts, from 0 in this period
    assert two.balance("acme").used == {"tokens": 1, "images": 0, "usd_micros": 0}
    one.hold("h", "acme", input_tokens=1)
    rep = two.compensate("c", bonus=0.5)
    assert rep.bonus_added == {"tokens": 500, "images": 5, "usd_micros": 2500}
    three = make(clock)
    three.settle("h", input_tokens=1, output_tokens=0, units={"images": 2})
    b = make(clock).balance("acme")
    assert b.used == {"tokens": 1, "images": 2, "usd_micros": 0}
    assert b.bonus == {"tokens": 500, "images": 5, "usd_micros": 2500}
