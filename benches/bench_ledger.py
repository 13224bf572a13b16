"""The quota ledger: SQLite charges/s beside a plain INSERT + UPDATE transaction loop, a
Redis charge beside a bare INCRBY round trip, and the exactness run (10^5 charges from 4
processes, 30 % retried at random delays), in one run.

SQLite (a temp file, WAL): every candidate writes the same rows; the floor is the plain
loop ``BEGIN; INSERT row; UPDATE balance; COMMIT`` through Python's ``sqlite3`` (the least
any durable per-request ledger does), and the same loop committing every 100 rows. The
ledger's figures: ``charge()`` from one thread (one transaction each), from 8 threads
(group commit: calls arriving while a transaction commits share the next one), and
``charge_many`` of 100 (one transaction). ``synchronous=NORMAL`` and ``FULL`` (an fsync
per commit: where group commit matters) are both measured.

Redis: interleaved rounds (A B A B ...) on one client; the median time per call and its
ratio to ``client.incrby(key, 1)`` on the same client, the floor of any one-round-trip
operation through redis-py.

Usage::

    .venv/bin/python benches/bench_ledger.py [--quick] [--out benches/results/ledger.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import multiprocessing
import os
import platform
import random
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
from ratequeue.ledger import Every, LedgerBase, Plan, RedisLedger, SqliteLedger

RESULTS = Path(__file__).resolve().parent / "results" / "ledger.md"
PERIOD = Every(10**8)
RETENTION = 2e8
BIG = Plan("big", tokens=2**50, calls=2**50, period=PERIOD)


@contextmanager
def redis_server() -> Iterator[str]:
    binary = os.environ.get("RATEQUEUE_REDIS_SERVER") or shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server not found (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="rq-bench-ledger-")
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        for _ in range(500):
            try:
                if redis.Redis.from_url(url).ping():
                    break
            except redis.exceptions.ConnectionError:
                time.sleep(0.01)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


# -- SQLite ------------------------------------------------------------------------------


def floor_loop(path: str, n: int, sync: str, every: int) -> float:
    """Charges/s of a plain INSERT + UPDATE loop committing every ``every`` rows."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={sync}")
    conn.execute(
        "CREATE TABLE rows(account TEXT, request_id TEXT, at REAL, input_tokens INTEGER,"
        " output_tokens INTEGER, calls INTEGER, model TEXT, PRIMARY KEY(account, request_id))"
    )
    conn.execute("CREATE TABLE balance(account TEXT PRIMARY KEY, used INTEGER)")
    conn.execute("INSERT INTO balance VALUES ('acme', 0)")
    t0 = time.perf_counter()
    for i in range(n):
        if i % every == 0:
            conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "INSERT INTO rows VALUES (?, ?, ?, ?, ?, ?, ?)",
            ("acme", f"r{i}", time.time(), 100, 20, 1, "m"),
        )
        conn.execute("UPDATE balance SET used=used+? WHERE account=?", (120, "acme"))
        if i % every == every - 1 or i == n - 1:
            conn.execute("COMMIT")
    dt_ = time.perf_counter() - t0
    conn.close()
    return n / dt_


def ledger_single(path: str, n: int, sync: str) -> float:
    led = SqliteLedger(path, synchronous=sync, retention=RETENTION)
    led.set_plan("acme", BIG)
    t0 = time.perf_counter()
    for i in range(n):
        led.charge(f"r{i}", "acme", input_tokens=100, output_tokens=20, model="m")
    rate = n / (time.perf_counter() - t0)
    led.close()
    return rate


def ledger_threads(path: str, n: int, sync: str, threads: int = 8) -> tuple[float, float]:
    """Charges/s from ``threads`` threads, and the mean charges per transaction."""
    led = SqliteLedger(path, synchronous=sync, retention=RETENTION)
    led.set_plan("acme", BIG)
    per = n // threads
    commits = [0]
    real = led._commit_batch

    def counting(batch: Any, mine: Any) -> None:
        commits[0] += 1
        real(batch, mine)

    led._commit_batch = counting  # type: ignore[method-assign]

    def work(w: int) -> None:
        for i in range(per):
            led.charge(f"t{w}-{i}", "acme", input_tokens=100, output_tokens=20, model="m")

    ts = [threading.Thread(target=work, args=(w,)) for w in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    rate = per * threads / (time.perf_counter() - t0)
    led.close()
    return rate, per * threads / max(1, commits[0])


def ledger_many(path: str, n: int, sync: str, size: int = 100) -> float:
    led = SqliteLedger(path, synchronous=sync, retention=RETENTION)
    led.set_plan("acme", BIG)
    t0 = time.perf_counter()
    for b in range(0, n, size):
        led.charge_many(
            [
                {
                    "request_id": f"m{i}",
                    "account": "acme",
                    "input_tokens": 100,
                    "output_tokens": 20,
                    "model": "m",
                }
                for i in range(b, min(n, b + size))
            ]
        )
    rate = n / (time.perf_counter() - t0)
    led.close()
    return rate


def sqlite_section(quick: bool, rounds: int = 5) -> tuple[list[str], dict[str, float]]:
    """Each candidate on a fresh file per round, rounds interleaved (A B C ... A B C ...)
    so that the drifts of a shared machine hit every candidate alike; medians."""
    rows: list[str] = []
    figures: dict[str, float] = {}
    for sync, n in (("NORMAL", 5_000 if quick else 20_000), ("FULL", 1_000 if quick else 4_000)):
        per = n // rounds
        got: dict[str, list[float]] = {}
        per_tx: list[float] = []
        for _ in range(rounds):
            d = tempfile.mkdtemp(prefix="rq-bench-sqlite-")
            try:

                def fresh(name: str, d: str = d) -> str:
                    return os.path.join(d, f"{name}.db")

                got.setdefault("floor1", []).append(floor_loop(fresh("floor1"), per, sync, 1))
                got.setdefault("floor100", []).append(floor_loop(fresh("floor100"), per, sync, 100))
                got.setdefault("single", []).append(ledger_single(fresh("single"), per, sync))
                rate, tx = ledger_threads(fresh("threads"), per, sync)
                got.setdefault("threads", []).append(rate)
                per_tx.append(tx)
                got.setdefault("many", []).append(ledger_many(fresh("many"), per, sync))
            finally:
                shutil.rmtree(d, ignore_errors=True)
        med = {k: statistics.median(v) for k, v in got.items()}
        for k, v in med.items():
            figures[f"{sync}.{k}"] = v
        floor1, floor100 = med["floor1"], med["floor100"]
        for key, name, note in (
            ("floor1", "plain INSERT + UPDATE, COMMIT each (floor)", "one transaction per row"),
            ("floor100", "plain INSERT + UPDATE, COMMIT every 100", "the batched floor"),
            ("single", "ledger.charge, 1 thread", "one transaction per charge"),
            (
                "threads",
                "ledger.charge, 8 threads (group commit)",
                f"{statistics.median(per_tx):.1f} charges per transaction",
            ),
            ("many", "ledger.charge_many(100)", "one transaction per 100"),
        ):
            rate = med[key]
            rows.append(
                f"| {sync} | {name} | {rate:,.0f} | {max(got[key]):,.0f} | {rate / floor1:.2f} | "
                f"{rate / floor100:.2f} | {note} |"
            )
    return rows, figures


# -- Redis -------------------------------------------------------------------------------


def redis_section(url: str, rounds: int, batch: int) -> tuple[list[str], float]:
    client = redis.Redis.from_url(url)
    led = RedisLedger(client, name="bench", retention=RETENTION)
    led.set_plan("acme", BIG)
    led.charge("warm", "acme", input_tokens=1)
    counter = [0]

    def incrby() -> None:
        client.incrby("bench:incr", 1)

    def charge() -> None:
        counter[0] += 1
        led.charge(f"c{counter[0]}", "acme", input_tokens=100, output_tokens=20, model="m")

    def hold_settle() -> None:
        counter[0] += 1
        rid = f"h{counter[0]}"
        led.hold(rid, "acme", input_tokens=500)
        led.settle(rid, input_tokens=100, output_tokens=20)

    def replay() -> None:
        led.charge("c1", "acme", input_tokens=100, output_tokens=20, model="m")

    cands: list[tuple[str, Callable[[], None], str]] = [
        ("INCRBY round trip (floor)", incrby, "`client.incrby(key, 1)` on the same client"),
        ("ledger.charge", charge, "new request id: check, deduct, row, thresholds; 1 EVALSHA"),
        ("ledger.charge (a replay)", replay, "the same id again: returns the first record"),
        (
            "ledger.hold + settle",
            hold_settle,
            "hold, then settle: 2 EVALSHA (the hold also indexes its id)",
        ),
    ]
    times: dict[str, list[float]] = {c[0]: [] for c in cands}
    client.config_resetstat()
    for _ in range(rounds):
        for name, fn, _note in cands:
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            times[name].append((time.perf_counter() - t0) / batch)
    floor = statistics.median(times[cands[0][0]])
    rows = []
    ratio = 0.0
    for name, _fn, note in cands:
        med = statistics.median(times[name])
        r = med / floor
        if name == "ledger.charge":
            ratio = r
        rows.append(
            f"| {name} | {med * 1e6:.1f} | {min(times[name]) * 1e6:.1f} | {1 / med:,.0f} | "
            f"{r:.2f} | {note} |"
        )
    stats = client.info("commandstats")
    server = {
        k: stats.get(f"cmdstat_{k}", {}).get("usec_per_call", 0.0) for k in ("incrby", "evalsha")
    }
    rows.append(
        f"| (server side, from INFO commandstats) | INCRBY {server['incrby']:.1f} us, "
        f"EVALSHA of the ledger {server['evalsha']:.1f} us per call | | | | "
        "the script's own work: what a charge costs beyond the round trip |"
    )
    led.close()
    return rows, ratio


# -- exactness ----------------------------------------------------------------------------

PROCS, RETRY, ACCOUNTS = 4, 0.3, 16


def _amount(g: int) -> int:
    return 1 + (g * 7919) % 50


def _account(g: int) -> str:
    return f"acct-{g % ACCOUNTS}"


def _open(spec: tuple[str, str]) -> LedgerBase:
    kind, where = spec
    if kind == "sqlite":
        return SqliteLedger(where, retention=RETENTION)
    return RedisLedger(redis.Redis.from_url(where), name="exact", retention=RETENTION)


def _worker(spec: tuple[str, str], wid: int, total: int, seed: int) -> None:
    led = _open(spec)
    rng = random.Random(seed * 100 + wid)
    theirs = [g for g in range((wid - 1) % PROCS, total, PROCS) if rng.random() < RETRY]
    rng.shuffle(theirs)
    due: list[tuple[int, int]] = sorted((rng.randrange(total // PROCS), g) for g in theirs)
    k = 0
    for i, g in enumerate(range(wid, total, PROCS)):
        led.charge(f"req-{g}", _account(g), input_tokens=_amount(g))
        while k < len(due) and due[k][0] <= i:
            g2 = due[k][1]
            if rng.random() < 0.05:
                time.sleep(rng.random() * 0.002)
            led.charge(f"req-{g2}", _account(g2), input_tokens=_amount(g2))
            k += 1
    for _, g2 in due[k:]:
        led.charge(f"req-{g2}", _account(g2), input_tokens=_amount(g2))
    led.close()


def exactness(spec: tuple[str, str], total: int) -> dict[str, Any]:
    expected = Counter[str]()
    for g in range(total):
        expected[_account(g)] += _amount(g)
    led = _open(spec)
    for a, t in expected.items():
        led.set_plan(a, Plan("p", tokens=t * 100 // 96, period=PERIOD))
    ctx = multiprocessing.get_context("fork")
    ps = [ctx.Process(target=_worker, args=(spec, w, total, 7)) for w in range(PROCS)]
    t0 = time.perf_counter()
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    elapsed = time.perf_counter() - t0
    used = {a: led.balance(a).used["tokens"] for a in expected}
    notices = Counter((n.account, n.threshold) for n in led.pending_notices(limit=100_000))
    rows = sum(1 for a in expected for _ in led.iter_usage(a))
    led.close()
    sent = total + int(total * RETRY)
    return {
        "exact": used == dict(expected),
        "rows": rows,
        "once": notices == Counter({(a, t): 1 for a in expected for t in (0.8, 0.95)}),
        "notices": sum(notices.values()),
        "elapsed": elapsed,
        "sent": sent,
        "ok": [p.exitcode for p in ps] == [0] * PROCS,
    }


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller runs")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    total = 20_000 if args.quick else 100_000
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    server_version = (
        subprocess.run(
            [shutil.which("redis-server") or "redis-server", "--version"],
            capture_output=True,
            text=True,
            check=False,
        )
        .stdout.split()[2]
        .removeprefix("v=")
    )
    sq_rows, figs = sqlite_section(args.quick)
    with redis_server() as url:
        rd_rows, ratio = redis_section(url, 7 if args.quick else 21, 200 if args.quick else 400)
        ex_redis = exactness(("redis", url), total)
    d = tempfile.mkdtemp(prefix="rq-bench-exact-")
    try:
        ex_sqlite = exactness(("sqlite", os.path.join(d, "ledger.db")), total)
    finally:
        shutil.rmtree(d, ignore_errors=True)

    out = [
        "# Quota ledger: SQLite vs a plain INSERT + UPDATE loop, Redis vs INCRBY, exactness",
        "",
        f"Measured by `benches/bench_ledger.py` on {when}: CPython {platform.python_version()},"
        f" {platform.machine()}, {os.cpu_count()} CPUs (a shared machine: read the ratios),"
        f" SQLite {sqlite3.sqlite_version} (WAL), redis-server {server_version} on loopback"
        f" (no persistence), redis-py {_version('redis')}.",
        "",
        "## SQLite: charges per second",
        "",
        "Five interleaved rounds per candidate, each on a fresh file; median (and best)"
        " charges/s; ratios of the medians.",
        "",
        "| synchronous | candidate | charges/s (median) | best | x floor (COMMIT each) |"
        " x COMMIT every 100 | notes |",
        "|---|---|---:|---:|---:|---:|---|",
        *sq_rows,
        "",
        "## Redis: one charge vs a bare INCRBY round trip",
        "",
        "| candidate | median us/call | min | calls/s | x INCRBY | what it does |",
        "|---|---:|---:|---:|---:|---|",
        *rd_rows,
        "",
        "## Exactness: 4 processes, 30 % of the requests retried by another process",
        "",
        "| backend | unique charges | sent (with retries) | wall s | totals exact | rows |"
        " notices | each threshold once per account |",
        "|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for name, ex in (("SQLite", ex_sqlite), ("Redis", ex_redis)):
        out.append(
            f"| {name} | {total:,} | ~{ex['sent']:,} | {ex['elapsed']:.1f} | "
            f"{'yes' if ex['exact'] and ex['ok'] else 'NO'} | {ex['rows']:,} | {ex['notices']} |"
            f" {'yes' if ex['once'] else 'NO'} |"
        )
    best = max(figs["NORMAL.threads"], figs["NORMAL.many"])  # medians
    exact = (ex_sqlite, ex_redis)
    out += [
        "",
        "## Targets",
        "",
        f"- SQLite >= 50,000 charges/s in one process with group commit (medians): "
        f"{best:,.0f}/s (`charge_many`: {figs['NORMAL.many']:,.0f}/s; 8 threads: "
        f"{figs['NORMAL.threads']:,.0f}/s) beside the floor's {figs['NORMAL.floor1']:,.0f}/s"
        f" (COMMIT each) and {figs['NORMAL.floor100']:,.0f}/s (COMMIT every 100): "
        f"{'met' if best >= 50_000 else 'not met'}",
        f"- Redis: one charge {ratio:.2f} x INCRBY (target <= 1.3): "
        f"{'met' if ratio <= 1.3 else 'not met'}",
        "- Exactness: totals exact and each threshold notified once per account on both: "
        + ("met" if all(e["exact"] and e["once"] and e["ok"] for e in exact) else "NOT MET"),
        "",
    ]
    text = "\n".join(out)
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
