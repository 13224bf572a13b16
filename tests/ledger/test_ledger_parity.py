"""Random histories of ledger calls give the same answers on SQLite and Redis, and keep
the invariants: usage and bonus never negative, the rows add up to what was charged,
each threshold notified at most once per account, unit and period."""

from __future__ import annotations

import atexit
import itertools
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import ratequeue as rq
from hypothesis import given, settings
from hypothesis import strategies as st
from ledger_backends import T0, shared_redis, stop_shared_redis
from ratequeue.ledger import Daily, LedgerBase, Plan, RedisLedger, SqliteLedger

atexit.register(stop_shared_redis)

ACCOUNTS = ("a", "b")
IDS = tuple(f"r{i}" for i in range(6))
_names = itertools.count()

op = st.one_of(
    st.tuples(
        st.just("charge"),
        st.sampled_from(IDS),
        st.sampled_from(ACCOUNTS),
        st.integers(0, 60),
        st.integers(0, 30),
    ),
    st.tuples(st.just("hold"), st.sampled_from(IDS), st.sampled_from(ACCOUNTS), st.integers(0, 80)),
    st.tuples(st.just("settle"), st.sampled_from(IDS), st.integers(0, 90), st.integers(0, 20)),
    st.tuples(st.just("release"), st.sampled_from(IDS)),
    st.tuples(
        st.just("settle_to"), st.sampled_from(IDS), st.sampled_from(ACCOUNTS), st.integers(0, 50)
    ),
    st.tuples(st.just("expire")),
    st.tuples(st.just("advance"), st.sampled_from([1.0, 30.0, 200.0, 43_200.0])),
    st.tuples(st.just("compensate"), st.sampled_from(["c1", "c2"]), st.booleans()),
)


def run(led: LedgerBase, clock: rq.ManualClock, ops: list[tuple[Any, ...]]) -> list[Any]:
    """Applies ``ops``; returns what each answered (a value or an error type name)."""
    out: list[Any] = []
    for o in ops:
        try:
            if o[0] == "charge":
                c = led.charge(o[1], o[2], input_tokens=o[3], output_tokens=o[4])
                r: Any = ("charge", c.tokens, c.replay, c.period)
            elif o[0] == "hold":
                h = led.hold(o[1], o[2], input_tokens=o[3])
                r = ("hold", h.input_tokens, h.replay)
            elif o[0] == "settle":
                c = led.settle(o[1], input_tokens=o[2], output_tokens=o[3])
                r = ("settle", c.account, c.tokens, c.replay)
            elif o[0] == "settle_to":
                c = led.settle(o[1], input_tokens=o[3], output_tokens=0, account=o[2])
                r = ("settle", c.account, c.tokens, c.replay)
            elif o[0] == "expire":
                r = ("expired", led.expire_holds())
            elif o[0] == "release":
                led.release(o[1])
                r = "released"
            elif o[0] == "advance":
                clock.advance(o[1])
                r = "advanced"
            else:
                rep = led.compensate(o[1], credit=0.25 if o[2] else None)
                r = ("compensate", rep.changed, rep.already_done)
        except (rq.RateQueueError, LookupError, ValueError) as e:
            r = type(e).__name__
        out.append(r)
        out.append([(b.used, b.held, b.bonus) for b in map(led.balance, ACCOUNTS)])
    out.append(sorted((n.id, n.used, n.quota) for n in led.pending_notices()))
    # rows of one instant come in insertion order (Redis) or by id (SQLite)
    out.append(
        [
            sorted((r.at, r.request_id, r.tokens, r.period) for r in led.iter_usage(a))
            for a in ACCOUNTS
        ]
    )
    return out


def fresh(kind: str, clock: rq.ManualClock, d: str) -> LedgerBase:
    led: LedgerBase
    if kind == "sqlite":
        led = SqliteLedger(Path(d) / "q.db", clock=clock, hold_ttl=100, retention=10 * 86_400)
    else:
        led = RedisLedger(
            shared_redis().client(timeout=5.0),
            name=f"parity-{next(_names)}",
            clock=clock,
            hold_ttl=100,
            retention=10 * 86_400,
        )
    led.set_plan("a", Plan("p", tokens=100, calls=6, period=Daily()))
    led.set_plan("b", Plan("q", tokens=40, period=Daily()), thresholds=[0.5])
    return led


@settings(max_examples=int(os.environ.get("RATEQUEUE_LEDGER_EXAMPLES", "25")), deadline=None)
@given(st.lists(op, min_size=1, max_size=30))
def test_sqlite_and_redis_answer_alike_and_keep_the_invariants(ops: list[tuple[Any, ...]]) -> None:
    results = {}
    for kind in ("sqlite", "redis"):
        clock = rq.ManualClock(T0)
        with tempfile.TemporaryDirectory() as d:
            led = fresh(kind, clock, d)
            try:
                results[kind] = run(led, clock, ops)
                for a in ACCOUNTS:
                    b = led.balance(a)
                    assert all(v >= 0 for v in (*b.used.values(), *b.bonus.values()))
                    assert all(v >= 0 for v in b.held.values())
                notices = Counter(
                    (n.account, n.period, n.unit, n.threshold) for n in led.pending_notices()
                )
                assert all(v == 1 for v in notices.values())
                # the rows of the current period add up to its usage when nothing is held
                # and no compensation or bonus moved it
                if not any(o[0] in ("hold", "compensate") for o in ops):
                    for a in ACCOUNTS:
                        b = led.balance(a)
                        rows = [r for r in led.iter_usage(a) if r.period == b.period]
                        assert sum(r.tokens for r in rows) == b.used["tokens"]
            finally:
                led.close()
    assert results["sqlite"] == results["redis"]
