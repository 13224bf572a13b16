"""Issue 14's second round: the Redis ledger under ``ratequeue.redis`` with its plain-charge
script path and ``redis.asyncio`` twins, the SQLite writer thread, ``LedgerBase`` as an
``abc.ABC`` and ``ratequeue quota set-plan``."""

from __future__ import annotations

import asyncio
import atexit
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import ratequeue as rq
from ledger_backends import T0, Factory, shared_redis, stop_shared_redis
from ledger_blocking import sqlite_writer_blocked
from ratequeue.__main__ import main
from ratequeue.ledger import (
    Daily,
    Every,
    IdempotencyConflict,
    LedgerBase,
    Monthly,
    Plan,
    SqliteLedger,
)
from ratequeue.ledger._model import request_fingerprint

atexit.register(stop_shared_redis)

PRO = Plan("pro", tokens=1000, calls=100)


# -- where the Redis ledger lives ----------------------------------------------------------


def test_the_redis_ledger_lives_in_ratequeue_redis_and_is_re_exported() -> None:
    import ratequeue.ledger as ledger
    import ratequeue.redis as rqredis
    import ratequeue.redis.ledger as redis_ledger

    assert ledger.RedisLedger is rqredis.RedisLedger is redis_ledger.RedisLedger
    assert "RedisLedger" in rqredis.__all__ and "RedisLedger" in ledger.__all__
    lua = Path(rqredis.__file__).with_name("ledger.lua").read_text()
    assert "if ARGV[1] == 'c' then" in lua
    assert redis_ledger.LUA_SHA and "--" not in redis_ledger.LUA.split("\n")[0]


def test_importing_the_ledger_needs_no_redis_py() -> None:
    code = (
        "import sys, ratequeue.ledger as l; "
        "assert 'redis' not in sys.modules, 'redis imported'; "
        "l.SqliteLedger; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# -- LedgerBase is an abstract base ------------------------------------------------------------


def test_ledger_base_is_abstract() -> None:
    import abc

    assert isinstance(LedgerBase, abc.ABCMeta)
    with pytest.raises(TypeError, match="abstract"):
        LedgerBase()  # type: ignore[abstract]

    class Half(LedgerBase):
        def _charge_call(self, *args: Any) -> Any:
            raise AssertionError

    with pytest.raises(TypeError, match="abstract"):
        Half()  # type: ignore[abstract]
    names = LedgerBase.__abstractmethods__
    calls = {"_charge_call", "_hold_call", "_settle_call", "_release_call", "_balance_call"}
    assert calls | {"_call", "_call_async", "_settings"} <= names


# -- the Redis plain-charge path and its fallback ---------------------------------------------


def _redis(clock: rq.ManualClock, name: str, **kw: Any) -> Any:
    from ratequeue.redis import RedisLedger

    return RedisLedger(shared_redis().client(timeout=5.0), name=name, clock=clock, **kw)


def test_redis_plain_charges_decide_like_the_general_script(clock: rq.ManualClock) -> None:
    """The fast path (op c) and the general op it falls back to agree, call for call,
    with SQLite on every outcome: bonus, thresholds, replays, conflicts, refusals, a new
    period, a plan changed behind the client's cache."""
    import tempfile

    red = _redis(clock, f"v2-{id(clock)}")
    sql = SqliteLedger(Path(tempfile.mkdtemp()) / "q.db", clock=clock)
    plan = Plan("p", tokens=100, calls=10, period=Daily(), thresholds=[0.5, 0.9])

    def both(fn: Any) -> tuple[Any, Any]:
        out = []
        for led in (red, sql):
            try:
                out.append(fn(led))
            except Exception as e:  # compared by type and text
                out.append((type(e).__name__, str(e)))
        return out[0], out[1]

    def same(fn: Any) -> Any:
        a, b = both(fn)
        assert a == b
        return a

    for led in (red, sql):
        led.set_plan("acme", plan)
    same(lambda led: led.charge("a", "acme", input_tokens=10))  # a new period: general op
    same(lambda led: led.charge("b", "acme", input_tokens=45, output_tokens=5))  # crosses 50 %
    same(lambda led: led.charge("b", "acme", input_tokens=45, output_tokens=5))  # a replay
    assert same(lambda led: led.charge("b", "acme", input_tokens=44))[0] == "IdempotencyConflict"
    same(lambda led: led.compensate("c1", ["acme"], reset_usage=False, bonus=0.3))
    same(lambda led: led.charge("c", "acme", input_tokens=60))  # 40 from the plan, 20 bonus
    same(lambda led: led.charge("d", "acme", input_tokens=30))  # refused: 10 bonus left
    same(lambda led: led.charge("c", "acme", input_tokens=60))  # a replay past the quota
    same(lambda led: led.balance("acme"))
    same(lambda led: sorted((n.id, n.used) for n in led.pending_notices()))
    for led in (red, sql):  # behind the Redis client's cached plan
        led.set_plan("acme", Plan("p2", tokens=500, calls=10, period=Daily()))
    red._info["acme"] = red._drive(red._info_flow("acme", True))
    for led in (red, sql):
        led.set_plan("acme", Plan("p3", tokens=200, calls=10, period=Daily()))
    same(lambda led: led.charge("e", "acme", input_tokens=10))  # STALE, read again
    clock.advance(86_400)
    same(lambda led: led.charge("f", "acme", input_tokens=10))  # the next day
    same(lambda led: led.balance("acme"))
    same(lambda led: [(c.request_id, c.tokens, c.period) for c in led.iter_usage("acme")])
    red.close()
    sql.close()


def _half_done(flow: Any, steps: int, exec_: Any) -> tuple[Any, bool]:
    """Runs ``steps`` steps of a call's flow; (the next step, or the result, and whether
    the flow ended)."""
    step = next(flow)
    for _ in range(steps):
        try:
            step = flow.send(exec_(step))
        except StopIteration as stop:
            return stop.value, True
    return step, False


def _finish(flow: Any, step: Any, exec_: Any) -> Any:
    while True:
        try:
            step = flow.send(exec_(step))
        except StopIteration as stop:
            return stop.value


@pytest.mark.parametrize("how", ["default plan", "set_plan"])
def test_a_new_account_is_never_seen_half_made(clock: rq.ManualClock, how: str) -> None:
    """Another process charging a new account while this one makes it (its first charge
    storing the default plan, or ``set_plan``), stopped after any of its Redis commands:
    the charge lands once, never 'the plan keeps changing' (it did: the plan was stored
    before its version, three reads in the gap and the charge failed; a cancelled
    asyncio charge finished on a worker thread was dropped so, under load)."""
    name = f"mk-{how[0]}-{id(clock)}"
    a = _redis(clock, name, default_plan=PRO)
    b = _redis(clock, name, default_plan=PRO)
    for k in range(1, 20):
        acct = f"acct{k}"
        if how == "set_plan":
            flow: Any = a._store_plan_flow(acct, PRO, None, None)
        else:
            args = a._request_args("first", acct, 1)
            flow = a._charge_call(*args, request_fingerprint("charge", *args[1:]))
        step, ended = _half_done(flow, k, a._exec)
        if ended:
            break
        assert b.charge("other", acct, input_tokens=2).tokens == 2  # made, or half made
        _finish(flow, step, a._exec)
        want = 2 if how == "set_plan" else 3
        assert b.balance(acct).used["tokens"] == want, k
        assert a.balance(acct).used["tokens"] == want, k
        assert a.plan_of(acct) == PRO
    else:
        raise AssertionError("the flow never ended")
    assert k >= 2  # it was stopped in the middle at least once
    a.close()
    b.close()


def test_a_plan_left_without_its_version_is_given_one(clock: rq.ManualClock) -> None:
    """An account whose plan an older client stored without its version (stopped between
    its two commands): charged, it gets version 1 and the charge lands."""
    for default in (PRO, None):
        led = _redis(clock, f"nover-{default is None}-{id(clock)}", default_plan=default)
        led.client.hset(led._pfx("acme") + "a", "plan", PRO.to_json())
        assert led.charge("a", "acme", input_tokens=4).tokens == 4
        assert led.charge("a", "acme", input_tokens=4).replay
        assert led.client.hget(led._pfx("acme") + "a", "ver") == b"1"
        assert list(led.accounts()) == ["acme"]
        assert led.balance("acme").used["tokens"] == 4
        led.close()


def test_redis_plain_charge_with_odd_ids_and_meta(clock: rq.ManualClock) -> None:
    led = _redis(clock, f"odd-{id(clock)}")
    led.set_plan("ünï{code}", PRO)
    c = led.charge("réq-1", "ünï{code}", input_tokens=3, meta={"k": "v"}, model="m")
    assert led.charge("réq-1", "ünï{code}", input_tokens=3, meta={"k": "v"}, model="m").replay
    with pytest.raises(IdempotencyConflict):
        led.charge("réq-1", "ünï{code}", input_tokens=3, meta={"k": "w"}, model="m")
    assert c.meta == {"k": "v"}
    rows = list(led.iter_usage("ünï{code}"))
    assert [(r.request_id, r.meta, r.model) for r in rows] == [("réq-1", {"k": "v"}, "m")]
    led.close()


# -- asyncio twins without worker threads ---------------------------------------------------


def test_async_twins_use_no_worker_thread(make: Factory, clock, monkeypatch) -> None:
    import ratequeue.ledger._base as base
    import ratequeue.redis._ledger_core as redis_ledger

    def no_threads() -> Any:
        raise AssertionError("an asyncio twin used a worker thread")

    monkeypatch.setattr(base, "_executor", no_threads)
    monkeypatch.setattr(redis_ledger, "_executor", no_threads)
    led = make(clock)
    led.set_plan("acme", PRO)

    async def main_() -> None:
        c = await led.charge_async("a", "acme", input_tokens=10)
        assert not c.replay and (await led.charge_async("a", "acme", input_tokens=10)).replay
        h = await led.hold_async("h", "acme", input_tokens=100)
        assert h.input_tokens == 100
        s = await led.settle_async("h", input_tokens=7, output_tokens=3)
        assert s.tokens == 10
        await led.release_async("h")
        b = await led.balance_async("acme")
        assert b.used == {"tokens": 20, "calls": 2}
        with pytest.raises(rq.QuotaExceeded):
            await led.charge_async("big", "acme", input_tokens=10_000)
        with pytest.raises(ValueError):
            await led.charge_async("neg", "acme", input_tokens=-1)

    asyncio.run(main_())
    if make.backend == "redis":  # type: ignore[attr-defined]

        async def again() -> None:  # a second loop gets its own asyncio client
            assert (await led.charge_async("a", "acme", input_tokens=10)).replay
            await led.aclose()  # type: ignore[attr-defined]

        asyncio.run(again())


def test_sqlite_async_charges_share_transactions(tmp_path: Path, clock) -> None:
    led = SqliteLedger(tmp_path / "q.db", clock=clock)
    led.set_plan("acme", Plan("p", tokens=10**9, calls=10**9))
    sizes: list[int] = []
    real = led._commit_batch

    def counting(batch: Any) -> None:
        sizes.append(len(batch))
        real(batch)

    led._commit_batch = counting  # type: ignore[method-assign]

    async def main_() -> list[Any]:
        return await asyncio.gather(
            *(led.charge_async(f"r{i}", "acme", input_tokens=1) for i in range(300))
        )

    out = asyncio.run(main_())
    assert [c.request_id for c in out] == [f"r{i}" for i in range(300)]
    assert sum(sizes) == 300 and len(sizes) < 300 and max(sizes) > 1
    assert led.balance("acme").used == {"tokens": 300, "calls": 300}
    led.close()


def test_sqlite_a_cancelled_queued_charge_counts_nothing(tmp_path: Path, clock) -> None:
    led = SqliteLedger(tmp_path / "q.db", clock=clock)
    led.set_plan("acme", PRO)

    async def main_() -> None:
        task = asyncio.ensure_future(led.charge_async("q", "acme", input_tokens=5))
        for _ in range(100):
            await asyncio.sleep(0.001)
            if led._queue:
                break
        assert len(led._queue) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not led._queue  # withdrawn before any transaction took it

    with sqlite_writer_blocked(led):
        asyncio.run(main_())
    assert led.balance("acme").used == {"tokens": 0, "calls": 0}
    assert not led.charge("q", "acme", input_tokens=5).replay
    led.close()


def test_sqlite_threads_share_the_writer_and_close_drains_it(tmp_path: Path, clock) -> None:
    led = SqliteLedger(tmp_path / "q.db", clock=clock)
    led.set_plan("acme", Plan("p", tokens=10**9, calls=10**9))

    def work(w: int) -> None:
        for i in range(100):
            led.charge(f"{w}-{i}", "acme", input_tokens=1)

    ts = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
        assert not t.is_alive()
    assert led.balance("acme").used == {"tokens": 800, "calls": 800}
    led.close()
    assert led._writer is None and led._conn is None
    again = SqliteLedger(tmp_path / "q.db", clock=clock)  # a closed ledger reopens the file
    assert again.balance("acme").used["tokens"] == 800
    again.close()


# -- ratequeue quota set-plan ----------------------------------------------------------------


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["quota", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
def test_set_plan_creates_and_updates_an_account(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ratequeue.redis import RedisLedger

    if backend == "sqlite":
        where = ["--db", str(tmp_path / "new.db")]  # set-plan may create the file

        def open_() -> LedgerBase:
            return SqliteLedger(tmp_path / "new.db")
    else:
        name = f"cli{id(tmp_path)}"
        where = ["--redis", shared_redis().url, "--name", name]

        def open_() -> LedgerBase:
            return RedisLedger(shared_redis().client(timeout=5.0), name=name)

    code, out, err = _cli(capsys, *where, "set-plan", "acme", "--tokens", "1000", "--calls", "5")
    assert code == 0, err
    assert "created account acme" in out
    led = open_()
    plan, anchor, own = led.settings("acme")
    assert plan.quota == {"tokens": 1000, "calls": 5} and plan.name == "default"
    assert isinstance(plan.period, Monthly) and plan.thresholds == (0.8, 0.95)
    assert anchor is None and own is None
    led.charge("r1", "acme", input_tokens=100)
    code, out, err = _cli(capsys, *where, "set-plan", "acme", "--tokens", "2000")
    assert code == 0, err
    assert led.plan_of("acme").quota == {"tokens": 2000, "calls": 5}
    assert led.balance("acme").used["tokens"] == 100  # usage kept

    code, out, err = _cli(
        capsys,
        *where,
        "set-plan",
        "acme",
        "--plan",
        "pro",
        "--tokens",
        "5000",
        "--period",
        "anchored",
        "--anchor",
        "2025-01-31",
        "--thresholds",
        "0.5,0.75",
        "--account-thresholds",
        "0.9",
    )
    assert code == 0, err
    assert "updated account acme" in out
    plan, anchor, own = led.settings("acme")
    assert plan.name == "pro" and plan.quota == {"tokens": 5000, "calls": 5}  # calls kept
    assert plan.period.to_dict() == {"kind": "monthly", "tz": "UTC", "anchored": True}
    assert anchor == 1_738_281_600.0 and own == (0.9,) and plan.thresholds == (0.5, 0.75)

    code, out, err = _cli(capsys, *where, "set-plan", "acme", "--tz", "Europe/Paris")
    assert code == 0, err
    plan, anchor, own = led.settings("acme")
    assert plan.period.to_dict()["tz"] == "Europe/Paris" and anchor == 1_738_281_600.0

    code, out, err = _cli(
        capsys, *where, "set-plan", "acme", "--replace", "--calls", "9", "--period", "every:3600"
    )
    assert code == 0, err
    plan, anchor, own = led.settings("acme")
    assert plan.quota == {"calls": 9} and isinstance(plan.period, Every)
    assert anchor is None and own is None and plan.thresholds == (0.8, 0.95)
    led.close()


def test_set_plan_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bad values are usage errors (exit 2, a message, no traceback); nothing is stored."""
    db = ["--db", str(tmp_path / "q.db")]
    for argv in (
        ["acme"],  # no quota at all
        ["acme", "--tokens", "-5"],
        ["acme", "--tokens", "10", "--period", "weekly"],
        ["acme", "--tokens", "10", "--period", "every:60", "--tz", "UTC"],
        ["acme", "--tokens", "10", "--tz", "No/Where"],
        ["acme", "--tokens", "10", "--thresholds", "2"],
        ["acme", "--tokens", "10", "--thresholds", "x"],
        ["acme", "--tokens", "10", "--anchor", "someday"],
        ["bad\nid", "--tokens", "10"],
    ):
        with pytest.raises(SystemExit) as e:
            _cli(capsys, *db, "set-plan", *argv)
        assert e.value.code == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err and "error" in err, argv
    led = SqliteLedger(tmp_path / "q.db")
    assert list(led.accounts()) == []
    led.close()


def test_set_plan_from_the_command_line(tmp_path: Path) -> None:
    db = str(tmp_path / "q.db")
    out = subprocess.run(
        [sys.executable, "-m", "ratequeue", "quota", "--db", db, "set-plan", "u", "--calls", "3"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    led = SqliteLedger(db)
    assert led.plan_of("u").quota == {"calls": 3}
    led.close()


def test_settings_of_an_unknown_account(make: Factory, clock) -> None:
    led = make(clock)
    with pytest.raises(LookupError):
        led.settings("nobody")
    led.set_plan("acme", PRO, anchor=T0, thresholds=[0.6])
    assert led.settings("acme") == (PRO, T0, (0.6,))
