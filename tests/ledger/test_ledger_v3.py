"""The ledger's fast paths keep its promises: the fingerprint built without ``repr`` is the
same digest, a charge that returned survives a crash of its process (group commit never
answers before its commit), the writer batches plain charges and a mixed batch, and the
asyncio twins are one code path for both backends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import ratequeue as rq
from forking import join_or_fail
from hypothesis import given
from hypothesis import strategies as st
from ledger_backends import Factory
from ledger_blocking import sqlite_writer_blocked
from ratequeue.ledger import Every, LedgerBase, Plan, QuotaExceeded, SqliteLedger
from ratequeue.ledger._model import MAX_AMOUNT, amounts, fingerprint, request_fingerprint

PRO = Plan("pro", tokens=1_000, calls=100, period=Every(3_600))

ids = st.text(min_size=1, max_size=20).filter(str.isprintable)
small = st.integers(0, MAX_AMOUNT // 2)


@given(
    kind=st.sampled_from(["charge", "hold"]),
    account=ids,
    i=small,
    o=small,
    c=small,
    model=st.none() | ids,
    parent=st.none() | ids,
    meta=st.sampled_from(["", '{"a":1}', '{"k":"v\'\\\\"}']),
)
def test_request_fingerprint_is_the_generic_digest(
    kind: str, account: str, i: int, o: int, c: int, model: Any, parent: Any, meta: str
) -> None:
    """Ids stored by earlier versions keep matching: the same text is hashed."""
    am = amounts(i, o, c)
    args = (kind, account, am, model, parent, meta)
    assert request_fingerprint(*args) == fingerprint(*args)


def test_amounts_fast_path_refuses_what_the_checks_refuse() -> None:
    assert amounts(1, 2, 3) == {"tokens": 3, "input_tokens": 1, "output_tokens": 2, "calls": 3}
    for bad, err in (
        ((True, 0, 1), TypeError),
        ((1.0, 0, 1), TypeError),
        ((-1, 0, 1), ValueError),
        ((0, 0, -1), ValueError),
        ((MAX_AMOUNT, 1, 1), ValueError),
        ((0, 0, MAX_AMOUNT + 1), ValueError),
    ):
        with pytest.raises(err):
            amounts(*bad)


_CHILD = textwrap.dedent(
    """
    import os, sys, threading
    from ratequeue.ledger import Every, Plan, SqliteLedger
    led = SqliteLedger(sys.argv[1], retention=2e8)
    led.set_plan("acme", Plan("big", tokens=2**50, calls=2**50, period=Every(10**8)))
    out = int(sys.argv[2])

    def work(w):
        for i in range(10**6):
            rid = f"t{w}-{i}"
            led.charge(rid, "acme", input_tokens=1 + i % 7, model="m")
            os.write(out, (rid + "\\n").encode())  # only once the charge returned

    for w in range(8):
        threading.Thread(target=work, args=(w,), daemon=True).start()
    threading.Event().wait()
    """
)


def test_a_charge_that_returned_survives_kill_9(tmp_path: Path) -> None:
    """8 threads charge through the group commit; the process is killed (SIGKILL) in the
    middle: every charge it reported as returned is in the file, and the usage counter
    equals the sum of the rows (no transaction half-written)."""
    path = tmp_path / "q.db"
    r, w = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path), str(w)], pass_fds=(w,), close_fds=True
    )
    os.close(w)
    seen: list[str] = []
    buf = b""
    try:
        with os.fdopen(r, "rb", buffering=0) as f:
            while len(seen) < 3_000:
                chunk = f.read(65536)
                assert chunk, "the child ended before charging"
                buf += chunk
                *lines, buf = buf.split(b"\n")
                seen += [x.decode() for x in lines]
            child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(30)
    led = SqliteLedger(path, retention=2e8)
    rows = {c.request_id: c for c in led.iter_usage("acme")}
    assert set(seen) <= set(rows)
    b = led.balance("acme")
    assert b.used["tokens"] == sum(c.tokens for c in rows.values())
    assert b.used["calls"] == len(rows)
    led.close()


def test_a_mixed_batch_decides_each_call_as_alone(tmp_path: Path) -> None:
    """Plain charges, replays, conflicts, refusals and holds queued together in one
    transaction: each gets what it would have got alone."""
    clock = rq.ManualClock(1_764_547_200.0)
    led = SqliteLedger(tmp_path / "q.db", clock=clock)
    led.set_plan("acme", PRO)
    led.charge("seen", "acme", input_tokens=10)
    led._shared = 8  # contended: the calls below queue for the writer, none runs inline
    results: dict[str, Any] = {}

    def call(name: str, fn: Any) -> None:
        try:
            results[name] = fn()
        except Exception as e:
            results[name] = e

    calls = {
        "a": lambda: led.charge("a", "acme", input_tokens=100),
        "replay": lambda: led.charge("seen", "acme", input_tokens=10),
        "conflict": lambda: led.charge("seen", "acme", input_tokens=11),
        "too-big": lambda: led.charge("big", "acme", input_tokens=5_000),
        "hold": lambda: led.hold("h", "acme", input_tokens=300),
        "b": lambda: led.charge("b", "acme", input_tokens=200),
    }
    threads = []
    with sqlite_writer_blocked(led):  # the calls queue up behind a held transaction
        for name, fn in calls.items():
            th = threading.Thread(target=call, args=(name, fn))
            th.start()
            threads.append(th)
        while len(led._queue) < len(calls):
            threading.Event().wait(0.001)
    for th in threads:
        th.join(30)
    assert results["a"].tokens == 100 and not results["a"].replay
    assert results["replay"].replay
    assert type(results["conflict"]).__name__ == "IdempotencyConflict"
    assert isinstance(results["too-big"], QuotaExceeded)
    assert results["hold"].input_tokens == 300
    assert results["b"].tokens == 200
    b = led.balance("acme")
    assert b.used["tokens"] == 10 + 100 + 200 + 300 and b.held["tokens"] == 300
    led.close()


def test_async_twins_and_sync_calls_share_one_path(make: Factory, clock: Any) -> None:
    """Each backend provides calls and two runners; the public sync and asyncio methods
    are LedgerBase's own (no backend overrides them)."""
    import asyncio

    led = make(clock)
    for name in ("charge", "hold", "settle", "release", "balance"):
        for m in (name, name + "_async"):
            assert getattr(type(led), m) is getattr(LedgerBase, m), m
    led.set_plan("acme", PRO)

    async def main() -> None:
        await led.hold_async("h", "acme", input_tokens=100)
        assert led.balance("acme").held["tokens"] == 100
        s = await led.settle_async("h", input_tokens=40, output_tokens=2)
        assert s.tokens == 42 and led.balance("acme").used["tokens"] == 42

    asyncio.run(main())


def test_charge_many_answers_each_request_on_both(make: Factory, clock: Any) -> None:
    """The same batch, the same answers on SQLite (one transaction) and Redis (one
    pipelined round trip, each charge its own script)."""
    from ratequeue.ledger import Charge

    led = make(clock)
    led.set_plan("acme", Plan("p", tokens=100, period=Every(3_600)))
    led.charge("old", "acme", input_tokens=10)
    out = led.charge_many(
        [
            {"request_id": "a", "account": "acme", "input_tokens": 30},
            {"request_id": "old", "account": "acme", "input_tokens": 10},  # a replay
            {"request_id": "old", "account": "acme", "input_tokens": 11},  # a conflict
            {"request_id": "b", "account": "acme", "input_tokens": 70},  # out of quota
            {"request_id": "c", "account": "acme", "input_tokens": -1},  # invalid
            {"request_id": "d", "account": "nobody"},  # unknown account
            {"request_id": "e", "account": "acme", "tokens": 1},  # unknown key
            {"request_id": "a", "account": "acme", "input_tokens": 30},  # replay in batch
            {"request_id": "f", "account": "acme", "input_tokens": 60},
        ]
    )
    kinds = [type(x).__name__ for x in out]
    assert kinds == [
        "Charge",
        "Charge",
        "IdempotencyConflict",
        "QuotaExceeded",
        "ValueError",
        "UnknownAccount",
        "TypeError",
        "Charge",
        "Charge",
    ]
    assert [x.replay for x in out if isinstance(x, Charge)] == [False, True, True, False]
    assert led.balance("acme").used == {"tokens": 100}
    assert sorted(c.request_id for c in led.iter_usage("acme")) == ["a", "f", "old"]


def test_redis_charge_many_is_one_round_trip(make: Factory, clock: Any) -> None:
    led = make(clock)
    if type(led).__name__ != "RedisLedger":
        return  # SQLite: one transaction, covered above
    led.set_plan("acme", Plan("t", tokens=1_000, period=Every(3_600)))
    led.charge("warm", "acme", input_tokens=1)  # the plan is cached
    sent: list[int] = []
    real = led._pipeline  # type: ignore[attr-defined]

    def counting(steps: Any) -> Any:
        sent.append(len(steps))
        return real(steps)

    led._pipeline = counting  # type: ignore[attr-defined]
    reqs = [{"request_id": f"r{i}", "account": "acme", "input_tokens": 5} for i in range(50)]
    assert all(not c.replay for c in led.charge_many(reqs))
    assert sent == [50]
    assert all(c.replay for c in led.charge_many(reqs))
    assert led.balance("acme").used["tokens"] == 1 + 50 * 5
    more = [{"request_id": f"q{i}", "account": "acme", "input_tokens": 10} for i in range(80)]
    out = led.charge_many(more)  # crosses 80 % and 95 %, then runs out of quota
    assert sum(1 for c in out if isinstance(c, QuotaExceeded)) == 80 - 74
    assert led.balance("acme").used["tokens"] == 991
    assert sorted(n.threshold for n in led.pending_notices()) == [0.8, 0.95]


def test_redis_charge_many_after_a_script_flush(make: Factory, clock: Any) -> None:
    """NOSCRIPT in the middle of a pipeline: those charges are sent again, none twice."""
    led = make(clock)
    if type(led).__name__ != "RedisLedger":
        return
    led.set_plan("acme", PRO)
    led.charge("warm", "acme", input_tokens=1)
    led.client.script_flush()  # type: ignore[attr-defined]
    reqs = [{"request_id": f"s{i}", "account": "acme", "input_tokens": 3} for i in range(20)]
    out = led.charge_many(reqs)
    assert all(not isinstance(c, Exception) and not c.replay for c in out)
    assert led.balance("acme").used["tokens"] == 1 + 20 * 3


def test_redis_connections_per_thread_survive_fork_and_close(make: Factory, clock: Any) -> None:
    """Scripts go on a connection of each thread: a forked child charging through the
    parent's ledger object opens its own (replies never cross), and close() closes them."""
    import multiprocessing

    led = make(clock)
    if type(led).__name__ != "RedisLedger":
        return
    led.set_plan("acme", Plan("big", tokens=10**9, period=Every(3_600)))
    led.charge("p0", "acme", input_tokens=1)
    mine = led._thread_conn()  # type: ignore[attr-defined]

    def child() -> None:
        for i in range(200):
            led.charge(f"c{i}", "acme", input_tokens=2)
        assert led._thread_conn() is not mine  # type: ignore[attr-defined]

    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=child)
    p.start()
    for i in range(200):  # the parent keeps charging on its own socket meanwhile
        led.charge(f"p{i + 1}", "acme", input_tokens=3)
    join_or_fail([p], 60)
    assert p.exitcode == 0
    assert led.balance("acme").used["tokens"] == 1 + 200 * 3 + 200 * 2

    seen: list[Any] = []

    def other() -> None:
        led.charge("t", "acme", input_tokens=1)
        seen.append(led._thread_conn())  # type: ignore[attr-defined]

    t = threading.Thread(target=other)
    t.start()
    t.join(30)
    assert seen[0] is not mine
    led.close()
    assert mine.sock is None
