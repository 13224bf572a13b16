"""Exactly once from several processes: 4 processes x 2,000 charges, 30 % of them retried
(by another process, after a random delay) -> totals exact, each threshold notified once."""

from __future__ import annotations

import atexit
import multiprocessing
import random
import time
from collections import Counter
from typing import Any

import pytest
from forking import join_or_fail
from ledger_backends import shared_redis, stop_shared_redis
from ratequeue.ledger import Every, LedgerBase, Plan, RedisLedger, SqliteLedger

atexit.register(stop_shared_redis)

PROCS, PER_PROC, RETRY, ACCOUNTS = 4, 2_000, 0.3, 8
PERIOD = Every(10**8)
RETENTION = 2e8


def amount(g: int) -> int:
    return 1 + (g * 7919) % 50


def account(g: int) -> str:
    return f"acct-{g % ACCOUNTS}"


def open_ledger(spec: tuple[str, str, str]) -> LedgerBase:
    kind, where, name = spec
    if kind == "sqlite":
        return SqliteLedger(where, retention=RETENTION)
    import redis

    return RedisLedger(redis.Redis.from_url(where), name=name, retention=RETENTION)


def worker(spec: tuple[str, str, str], wid: int, seed: int) -> None:
    """Charges ids g = wid, wid + PROCS, ...; and retries the ids another worker sent."""
    led = open_ledger(spec)
    rng = random.Random(seed * 100 + wid)
    mine = range(wid, PROCS * PER_PROC, PROCS)
    # the ids of the previous worker this one re-sends (as a client's retry would)
    theirs = [g for g in range((wid - 1) % PROCS, PROCS * PER_PROC, PROCS) if rng.random() < RETRY]
    retries = iter(theirs)
    nxt = next(retries, None)
    for i, g in enumerate(mine):
        led.charge(f"req-{g}", account(g), input_tokens=amount(g), model=f"m{g % 3}")
        while nxt is not None and nxt <= g + rng.randrange(0, 400):
            if rng.random() < 0.2:
                time.sleep(rng.random() * 0.002)
            c = led.charge(
                f"req-{nxt}", account(nxt), input_tokens=amount(nxt), model=f"m{nxt % 3}"
            )
            assert c.input_tokens == amount(nxt)
            nxt = next(retries, None)
        if i % 500 == 0:
            time.sleep(rng.random() * 0.001)
    for g in retries:
        led.charge(f"req-{g}", account(g), input_tokens=amount(g), model=f"m{g % 3}")
    if nxt is not None:
        led.charge(f"req-{nxt}", account(nxt), input_tokens=amount(nxt), model=f"m{nxt % 3}")
    led.close()


def run_exactness(spec: tuple[str, str, str], seed: int = 1) -> dict[str, Any]:
    """Runs the workers; returns what the ledger holds afterwards."""
    total = Counter[str]()
    for g in range(PROCS * PER_PROC):
        total[account(g)] += amount(g)
    led = open_ledger(spec)
    for a, t in total.items():
        # 95 % is crossed, nothing is refused
        led.set_plan(a, Plan("p", tokens=t * 100 // 96, period=PERIOD))
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=worker, args=(spec, w, seed)) for w in range(PROCS)]
    for p in procs:
        p.start()
    join_or_fail(procs, 300)
    assert [p.exitcode for p in procs] == [0] * PROCS
    used = {a: led.balance(a).used["tokens"] for a in total}
    rows = sum(1 for a in total for _ in led.iter_usage(a))
    notices = Counter((n.account, n.threshold) for n in led.pending_notices(limit=10_000))
    led.close()
    return {"expected": dict(total), "used": used, "rows": rows, "notices": notices}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_processes_with_retries_count_exactly_once(kind: str, tmp_path: Any) -> None:
    if kind == "sqlite":
        spec = ("sqlite", str(tmp_path / "ledger.db"), "")
    else:
        server = shared_redis()
        spec = ("redis", server.url, f"procs-{time.monotonic_ns()}")
    out = run_exactness(spec)
    assert out["used"] == out["expected"]
    assert out["rows"] == PROCS * PER_PROC
    assert out["notices"] == Counter({(a, t): 1 for a in out["expected"] for t in (0.8, 0.95)})
