"""The quota ledger: SQLite charges/s beside a plain INSERT + UPDATE transaction loop, a
Redis charge beside a bare INCRBY round trip, and the exactness run (10^5 charges from 4
processes, 30 % retried at random delays), in one run; with ``--baseline DIR`` (a copy of
an earlier ``ratequeue`` package, e.g. main's) its figures run beside today's as
"before" rows, each in a child process whose ``ratequeue`` is that copy.

SQLite (a temp file, WAL): every candidate writes the same rows; the floor is the plain
loop ``BEGIN; INSERT row; UPDATE balance; COMMIT`` through Python's ``sqlite3`` (the least
any durable per-request ledger does), and the same loop committing every 100 rows. The
ledger's figures: ``charge()`` from one thread, from 8 threads (group commit: the writer
thread takes the calls queued meanwhile into one transaction), ``charge_async`` with 500
in flight on one event loop (beside the loop's own cost for 500 no-op awaits), and
``charge_many`` of 100 (one transaction). ``synchronous=NORMAL`` and ``FULL`` (an fsync
per commit: where group commit matters) are both measured.

Redis: interleaved rounds (A B A B ...); the median time per call and its ratio to
``client.incrby(key, 1)`` on the same client, the floor of any one-round-trip operation
through redis-py; beside it two floors for a script: ``EVALSHA`` of
``return redis.call('INCRBY', ...)``, and a script doing the least a charge needs (one
``SET NX EX``, two ``HMGET``, one ``HSET``, one ``XADD``), both sent packed on a held
connection; and the wire's floors: ``INCRBY`` packed on redis-py's connection and on the
ledger's own (``_Wire``: its socket written and read by the ledger). Each row also gives
the CPU time per call of this process (the client) and of redis-server (``INFO cpu``)
with their sum's ratio to INCRBY's, steadier than wall time on a loaded machine; the
server's time inside each command comes from ``INFO commandstats``.

Usage::

    .venv/bin/python benches/bench_ledger.py [--quick] [--baseline DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
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
import redis.asyncio
from ratequeue.ledger import Every, LedgerBase, Plan, RedisLedger, SqliteLedger
from redis.connection import _HiredisParser, _RESP2Parser

RESULTS = Path(__file__).resolve().parent / "results" / "ledger.md"
RESULTS_REDIS = RESULTS.with_name("ledger_redis.md")
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

    def counting(*a: Any) -> None:
        commits[0] += 1
        real(*a)

    led._commit_batch = counting  # type: ignore[method-assign]

    def work(w: int) -> None:
        for i in range(per):
            led.charge(f"t{w}-{i}", "acme", input_tokens=100, output_tokens=20, model="m")

    rate = per * threads / _in_threads(threads, work)
    led.close()
    return rate, per * threads / max(1, commits[0])


def _in_threads(threads: int, work: Callable[[int], None]) -> float:
    """Seconds for ``threads`` threads to run ``work(w)`` each."""
    ts = [threading.Thread(target=work, args=(w,)) for w in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def handoff_floor(path: str, n: int, sync: str, threads: int = 8) -> tuple[float, float]:
    """Calls/s of ``threads`` threads through the ledger's writer thread with nothing to
    do in the transaction: what the handoff itself (Python threads, the GIL) costs."""
    led = SqliteLedger(path, synchronous=sync, retention=RETENTION)
    commits = [0]

    def empty(batch: Any) -> None:
        commits[0] += 1
        for op in batch:
            op.result = None

    led._commit_batch = empty  # type: ignore[method-assign]
    led._shared = threads  # contended from the first call: every call goes to the writer
    per = n // threads

    def nothing(_conn: Any) -> None:
        return None

    def work(_w: int) -> None:
        for _ in range(per):
            led._run(nothing)

    rate = per * threads / _in_threads(threads, work)
    led.close()
    return rate, per * threads / max(1, commits[0])


async def _in_flight(n: int, width: int, call: Callable[[int], Any]) -> float:
    """Per second: ``n`` awaits of ``call(i)``, ``width`` at a time on this loop."""
    t0 = time.perf_counter()
    for b in range(0, n, width):
        await asyncio.gather(*(call(i) for i in range(b, min(n, b + width))))
    return n / (time.perf_counter() - t0)


def ledger_async(path: str, n: int, sync: str, width: int = 500) -> float:
    led = SqliteLedger(path, synchronous=sync, retention=RETENTION)
    led.set_plan("acme", BIG)

    def call(i: int) -> Any:
        return led.charge_async(f"a{i}", "acme", input_tokens=100, output_tokens=20, model="m")

    rate = asyncio.run(_in_flight(n, width, call))
    led.close()
    return rate


def asyncio_floor(n: int, width: int = 500) -> float:
    """The loop's own cost: ``n`` no-op awaits, ``width`` at a time."""

    async def nop(_i: int) -> None:
        await asyncio.sleep(0)

    return asyncio.run(_in_flight(n, width, nop))


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


def _child(baseline: str | None, *args: str) -> list[float]:
    """Runs ``--measure args`` in a child process whose ``ratequeue`` is ``baseline``."""
    env = dict(os.environ)
    if baseline:
        env["PYTHONPATH"] = baseline
    out = subprocess.run(
        [sys.executable, __file__, "--measure", *args],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [float(x) for x in out.split()]


SQLITE_ROWS = (
    ("floor1", "plain INSERT + UPDATE, COMMIT each (floor)", "one transaction per row"),
    (
        "floor8",
        "plain INSERT + UPDATE, COMMIT every 8",
        "the most 8 synchronous threads can share",
    ),
    ("floor100", "plain INSERT + UPDATE, COMMIT every 100", "the batched floor"),
    (
        "handoff",
        "8 threads through the writer, empty transactions (floor)",
        "the handoff alone: Python threads and the GIL",
    ),
    ("single_old", "before: ledger.charge, 1 thread", "main: one transaction per charge"),
    ("single", "ledger.charge, 1 thread", "alone: its own transaction, in its thread"),
    ("threads_old", "before: ledger.charge, 8 threads", "main: leader-based group commit"),
    ("threads", "ledger.charge, 8 threads (group commit)", "the writer thread's batches"),
    ("async_floor", "asyncio: 500 no-op awaits in flight (floor)", "the event loop's own cost"),
    ("async_old", "before: ledger.charge_async, 500 in flight", "main: on worker threads"),
    ("async", "ledger.charge_async, 500 in flight", "futures resolved by the writer"),
    ("many_old", "before: ledger.charge_many(100)", "main"),
    ("many", "ledger.charge_many(100)", "one transaction per 100"),
)


def _with_cpu(fn: Callable[..., Any], *args: Any) -> tuple[float, float, float]:
    """(calls/s, calls per transaction or 0, CPU seconds of this process) of ``fn``."""
    c0 = time.process_time()
    r = fn(*args)
    cpu = time.process_time() - c0
    rate, tx = r if isinstance(r, tuple) else (r, 0.0)
    return rate, tx, cpu


def sqlite_section(
    quick: bool, baseline: str | None, rounds: int = 7
) -> tuple[list[str], dict[str, float]]:
    """Each candidate on a fresh file per round, rounds interleaved (A B C ... A B C ...)
    so that the drifts of a shared machine hit every candidate alike; medians. The CPU
    time per charge (every thread of the process) is the steadier figure on a loaded
    machine: waiting for a core does not count in it."""
    rows: list[str] = []
    figures: dict[str, float] = {}
    for sync, n in (("NORMAL", 5_000 if quick else 21_000), ("FULL", 1_400 if quick else 4_200)):
        per = n // rounds
        got: dict[str, list[tuple[float, float, float]]] = {}
        for _ in range(rounds):
            d = tempfile.mkdtemp(prefix="rq-bench-sqlite-")
            try:

                def fresh(name: str, d: str = d) -> str:
                    return os.path.join(d, f"{name}.db")

                def run(key: str, fn: Callable[..., Any], *args: Any, got: Any = got) -> None:
                    got.setdefault(key, []).append(_with_cpu(fn, *args))

                for every in (1, 8, 100):
                    run(f"floor{every}", floor_loop, fresh(f"floor{every}"), per, sync, every)
                run("handoff", handoff_floor, fresh("handoff"), per, sync)
                run("single", ledger_single, fresh("single"), per, sync)
                run("threads", ledger_threads, fresh("threads"), per, sync)
                run("async_floor", asyncio_floor, per)
                run("async", ledger_async, fresh("async"), per, sync)
                run("many", ledger_many, fresh("many"), per, sync)
                if baseline:
                    for kind in ("single", "threads", "async", "many"):
                        path = fresh(kind + "_old")
                        vals = _child(baseline, "sqlite", kind, path, str(per), sync)
                        got.setdefault(kind + "_old", []).append((vals[0], vals[1], vals[2]))
            finally:
                shutil.rmtree(d, ignore_errors=True)
        med = {k: statistics.median(x[0] for x in v) for k, v in got.items()}
        for k, v in med.items():
            figures[f"{sync}.{k}"] = v
            figures[f"{sync}.{k}.cpu"] = statistics.median(x[2] for x in got[k]) / per * 1e6
        floor1, floor8 = med["floor1"], med["floor8"]
        for key, name, note in SQLITE_ROWS:
            if key not in med:
                continue
            tx = statistics.median(x[1] for x in got[key])
            if tx:
                note += f"; {tx:.1f} calls per transaction"
            rate = med[key]
            best = max(x[0] for x in got[key])
            rows.append(
                f"| {sync} | {name} | {rate:,.0f} | {best:,.0f} |"
                f" {figures[f'{sync}.{key}.cpu']:.1f} | {rate / floor1:.2f} |"
                f" {rate / floor8:.2f} | {note} |"
            )
    return rows, figures


# -- Redis -------------------------------------------------------------------------------

#: The least a charge does in Redis: idempotency (SET NX EX), the plan version and bonus
#: (HMGET), the period's usage and flags (HMGET), the new usage (HSET), the row (XADD).
MIN_CHARGE_LUA = """
local a = redis.call('HMGET', KEYS[1], 'ver', 'nx', 'b_tokens', 'b_calls')
if not redis.call('SET', KEYS[2], ARGV[1], 'NX', 'EX', ARGV[2]) then return {'REPLAY'} end
local p = redis.call('HMGET', KEYS[3], 'end', 'u_tokens', 'u_calls', 'f:tokens:8000')
redis.call('HSET', KEYS[3], 'u_tokens', (tonumber(p[2]) or 0) + 120,
  'u_calls', (tonumber(p[3]) or 0) + 1)
redis.call('XADD', KEYS[4], 'MAXLEN', '~', 100000, '*', 'id', ARGV[3], 'r', ARGV[1])
return {'OK', 0}
"""
INCR_LUA = "return redis.call('INCRBY', KEYS[1], ARGV[1])"
ONE_LUA = "return 1"
#: Charges per ``charge_many`` call in the Redis rows.
MANY = 100


_HELD: dict[int, Any] = {}


def _raw_call(client: redis.Redis, args: tuple[Any, ...]) -> Any:
    """A command packed once and sent on a connection held for the client, as the ledger
    sends its scripts (no pool get/release per call)."""
    parts = [b"*%d\r\n" % len(args)]
    for x in args:
        b = x if isinstance(x, bytes) else str(x).encode()
        parts.append(b"$%d\r\n%b\r\n" % (len(b), b))
    conn = _HELD.get(id(client))
    if conn is None:
        pool = client.connection_pool
        conn = _HELD[id(client)] = pool.connection_class(**pool.connection_kwargs)
    conn.send_packed_command([b"".join(parts)])
    return conn.read_response()


def _old_redis(
    baseline: str, url: str, what: str, n: int, start: int
) -> tuple[float, float, float]:
    """The baseline's wall, client CPU and server CPU seconds per call, measured around
    its loop in a child process."""
    wall, cpu, server = _child(baseline, "redis", what, url, str(n), str(start))
    return wall, cpu, server


def _server_cpu(client: redis.Redis) -> float:
    """The redis-server process's CPU seconds so far (user + system, all its threads)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def redis_section(
    url: str, rounds: int, batch: int, baseline: str | None
) -> tuple[list[str], dict[str, float]]:
    """Candidates interleaved round by round; each row's ratio is to INCRBY through the
    same reply parser (redis-py's own, or hiredis)."""
    client = redis.Redis.from_url(url, parser_class=_RESP2Parser)
    hclient = redis.Redis.from_url(url, parser_class=_HiredisParser)
    led = RedisLedger(client, name="bench", retention=RETENTION)
    hled = RedisLedger(hclient, name="bench", retention=RETENTION)
    led.set_plan("acme", BIG)
    led.charge("warm", "acme", input_tokens=1)
    hled.charge("warm2", "acme", input_tokens=1)
    one_sha = client.script_load(ONE_LUA)
    incr_sha = client.script_load(INCR_LUA)
    min_sha = client.script_load(MIN_CHARGE_LUA)
    record = "\x1f".join(["charge", "charged", "0" * 24, "", "1764547200.5", "p", "100", "20"])
    record += "\x1f1\x1fm\x1f\x1f\x1f\x1f"
    counter = [0]

    def incrby() -> None:
        client.incrby("bench:incr", 1)

    def incrby_h() -> None:
        hclient.incrby("bench:incr", 1)

    def incrby_raw() -> None:
        _raw_call(client, ("INCRBY", "bench:incr", 1))

    # (imported here: a ``--baseline`` child runs this file with a package without them)
    from ratequeue.redis._ledger_codec import _pack_items
    from ratequeue.redis._ledger_wire import _Wire

    wire = _Wire(client.connection_pool)
    incr_packed = _pack_items(["INCRBY", "bench:incr", 1])

    def incrby_wire() -> None:
        wire.call(incr_packed)

    def evalsha_one() -> None:
        _raw_call(client, ("EVALSHA", one_sha, 0))

    def evalsha_incr() -> None:
        _raw_call(client, ("EVALSHA", incr_sha, 1, "bench:incr2", 1))

    def min_charge() -> None:
        counter[0] += 1
        k = "{m}"
        _raw_call(
            client,
            (
                "EVALSHA",
                min_sha,
                4,
                k + "a",
                f"{k}r:{counter[0]}",
                k + "p",
                k + "s",
                record,
                100000,
                f"m{counter[0]}",
            ),
        )

    def charge() -> None:
        counter[0] += 1
        led.charge(f"c{counter[0]}", "acme", input_tokens=100, output_tokens=20, model="m")

    fake = RedisLedger(client, name="bench", retention=RETENTION)
    fake.charge("warm3", "acme", input_tokens=1)
    fake._send_eval = lambda step: 0  # type: ignore[method-assign]
    fake._send_packed = lambda packed: 0  # type: ignore[method-assign]

    def charge_client() -> None:
        counter[0] += 1
        fake.charge(f"f{counter[0]}", "acme", input_tokens=100, output_tokens=20, model="m")

    # the charge's own script calls, made by the client beforehand and sent as they are:
    # the round trip and the script without the client's work
    scripted: list[bytes] = []
    capture = RedisLedger(client, name="bench", retention=RETENTION)
    capture.charge("warm4", "acme", input_tokens=1)
    capture._send_packed = lambda packed: scripted.append(packed) or 0  # type: ignore[method-assign]
    for i in range(2 * rounds * batch + 2000):
        capture.charge(f"s{i}", "acme", input_tokens=100, output_tokens=20, model="m")
    scripts = iter(scripted)

    def charge_script() -> None:
        wire.call(next(scripts))

    def least_then_client() -> None:
        min_charge()
        charge_client()

    def script_then_client() -> None:
        charge_script()
        charge_client()

    def charge_h() -> None:
        counter[0] += 1
        hled.charge(f"c{counter[0]}", "acme", input_tokens=100, output_tokens=20, model="m")

    def charge_many() -> None:  # MANY charges per call: the row shows the time per charge
        counter[0] += 1
        b = counter[0]
        led.charge_many(
            [
                {
                    "request_id": f"b{b}-{i}",
                    "account": "acme",
                    "input_tokens": 100,
                    "output_tokens": 20,
                    "model": "m",
                }
                for i in range(MANY)
            ]
        )

    def hold_settle() -> None:
        counter[0] += 1
        rid = f"h{counter[0]}"
        led.hold(rid, "acme", input_tokens=500)
        led.settle(rid, input_tokens=100, output_tokens=20)

    def replay() -> None:
        led.charge("c1", "acme", input_tokens=100, output_tokens=20, model="m")

    aclient = redis.asyncio.Redis.from_url(url)
    aled = RedisLedger(client, name="bench", retention=RETENTION, async_client=aclient)
    loop = asyncio.new_event_loop()

    def async_incr() -> None:
        loop.run_until_complete(aclient.incrby("bench:incr3", 1))

    def async_charge() -> None:
        counter[0] += 1
        loop.run_until_complete(
            aled.charge_async(f"x{counter[0]}", "acme", input_tokens=100, output_tokens=20)
        )

    py, hi = "INCRBY round trip (floor)", "INCRBY round trip, hiredis parser (floor)"
    # (name, function, calls per function call, the floor of its ratio, note)
    cands: list[tuple[str, Callable[[], None] | None, int, str, str]] = [
        (py, incrby, 1, py, "`client.incrby(key, 1)`, redis-py's own reply parser"),
        (hi, incrby_h, 1, hi, "the same through hiredis (`pip install hiredis`)"),
        (
            "INCRBY packed, on a held connection",
            incrby_raw,
            1,
            py,
            "the wire's floor through redis-py's connection: no command machinery per call",
        ),
        (
            WIRE,
            incrby_wire,
            1,
            py,
            "the same on the ledger's own connection and reply reader (how it sends scripts)",
        ),
        (
            "bare EVALSHA returning 1 (script floor)",
            evalsha_one,
            1,
            py,
            "`return 1`: a script call's own cost, packed and sent as the ledger sends",
        ),
        (
            "EVALSHA of `return redis.call('INCRBY', ...)`",
            evalsha_incr,
            1,
            py,
            "the cheapest script that writes",
        ),
        (
            "EVALSHA of the least a charge does (script floor)",
            min_charge,
            1,
            py,
            "SET NX EX, 2 HMGET, HSET, XADD; no plan, no thresholds, no checks",
        ),
        (
            "ledger.charge's own script call, sent as made",
            charge_script,
            1,
            py,
            "the charge's EVALSHA (op `c`) made beforehand by the client: round trip + script",
        ),
        (
            "the least script, then the client side alone",
            least_then_client,
            1,
            py,
            "the floor of a charge that does this client work: the least script's round trip"
            " after the client's work, back to back",
        ),
        (
            "the same script call, then the client side alone",
            script_then_client,
            1,
            py,
            "the two rows above and below back to back: the charge's parts without its code"
            " path, paying the round trip after the client's work as a charge does",
        ),
        ("before: ledger.charge", None, 1, py, "main"),
        (
            "ledger.charge",
            charge,
            1,
            py,
            "new request id: op `c`, 1 EVALSHA packed in one piece, on the thread's own wire",
        ),
        (
            "ledger.charge, hiredis parser",
            charge_h,
            1,
            hi,
            "the same with a hiredis client (the ledger reads its scripts' replies itself)",
        ),
        (
            "ledger.charge, its client side alone",
            charge_client,
            1,
            py,
            "the script's reply faked (no round trip): validation, fingerprint, encoding",
        ),
        (
            f"ledger.charge_many({MANY}), per charge",
            charge_many,
            MANY,
            py,
            "one round trip: the scripts pipelined, each charge its own script",
        ),
        ("ledger.charge (a replay)", replay, 1, py, "the same id again: the first record"),
        ("ledger.hold + settle", hold_settle, 1, py, "hold, then settle: 2 EVALSHA"),
        ("asyncio: await INCRBY (floor)", async_incr, 1, py, "`redis.asyncio`, one loop step"),
        ("ledger.charge_async", async_charge, 1, py, "on `redis.asyncio`"),
    ]
    if not baseline:
        cands = [c for c in cands if c[1] is not None]
    times: dict[str, list[float]] = {c[0]: [] for c in cands}
    # CPU seconds per call: this process's (the client's), and redis-server's
    ccpu: dict[str, list[float]] = {c[0]: [] for c in cands}
    scpu: dict[str, list[float]] = {c[0]: [] for c in cands}
    for r in range(rounds):
        for name, fn, per_call, _floor, _note in cands:
            s0 = _server_cpu(client)
            if fn is None:
                assert baseline is not None
                wall, cpu, server = _old_redis(baseline, url, "charge", batch, 10**7 * (r + 1))
                times[name].append(wall)
                ccpu[name].append(cpu)
                scpu[name].append(server)
                continue
            calls = max(1, batch // per_call)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(calls):
                fn()
            n = calls * per_call
            times[name].append((time.perf_counter() - t0) / n)
            ccpu[name].append((time.process_time() - c0) / n)
            scpu[name].append((_server_cpu(client) - s0) / n)
    rows = []
    figures: dict[str, float] = {}
    for name, _fn, _per, floor_name, note in cands:
        med = statistics.median(times[name])
        ratio = med / statistics.median(times[floor_name])
        cc, sc = statistics.median(ccpu[name]), statistics.median(scpu[name])
        cpu_ratio = (cc + sc) / (
            statistics.median(ccpu[floor_name]) + statistics.median(scpu[floor_name])
        )
        figures[name] = ratio
        figures["cpu " + name] = cpu_ratio
        figures["client cpu us " + name] = cc * 1e6
        figures["server cpu us " + name] = sc * 1e6
        rows.append(
            f"| {name} | {med * 1e6:.1f} | {min(times[name]) * 1e6:.1f} | {1 / med:,.0f} | "
            f"{ratio:.2f} | {cc * 1e6:.1f} | {sc * 1e6:.1f} | {cpu_ratio:.2f} | {note} |"
        )
    # the server's own time per call: each script alone, INFO commandstats
    server: list[tuple[str, float]] = []
    for label, fn in (
        ("INCRBY", incrby),
        ("EVALSHA `return 1`", evalsha_one),
        ("EVALSHA `return INCRBY`", evalsha_incr),
        ("EVALSHA least charge", min_charge),
        ("EVALSHA ledger.charge", charge_script),
        ("EVALSHA before: ledger.charge", None),
    ):
        if fn is None and not baseline:
            continue
        client.config_resetstat()
        if fn is None:
            assert baseline is not None
            _old_redis(baseline, url, "charge", 2000, 9 * 10**8)
        else:
            for _ in range(2000):
                fn()
        stats = client.info("commandstats")
        cmd = "incrby" if label == "INCRBY" else "evalsha"
        us = stats.get(f"cmdstat_{cmd}", {}).get("usec_per_call", 0.0)
        server.append((label, us))
        figures["server " + label] = us
    rows.append(
        "| (server side, INFO commandstats, us per call) | "
        + ", ".join(f"{k} {v:.1f}" for k, v in server)
        + " | | | | | | | what each costs inside Redis, beyond the round trip |"
    )
    loop.run_until_complete(aclient.aclose())
    loop.close()
    led.close()
    hled.close()
    return rows, figures


def measure(args: list[str]) -> None:
    """``--measure``: one figure for the parent (run with the baseline's package)."""
    kind = args[0]
    if kind == "sqlite":
        what, path, n, sync = args[1], args[2], int(args[3]), args[4]
        fn = {
            "single": ledger_single,
            "threads": ledger_threads,
            "many": ledger_many,
            "async": ledger_async,
        }[what]
        print(*_with_cpu(fn, path, n, sync))
        return
    what, url, n, start = args[1], args[2], int(args[3]), int(args[4])
    client = redis.Redis.from_url(url, parser_class=_RESP2Parser)
    led = RedisLedger(client, name="bench", retention=RETENTION)
    led.charge(f"o{start}", "acme", input_tokens=1)  # connected, plan cached
    s0 = _server_cpu(client)
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(start + 1, start + 1 + n):
        led.charge(f"o{i}", "acme", input_tokens=100, output_tokens=20, model="m")
    wall, cpu = (time.perf_counter() - t0) / n, (time.process_time() - c0) / n
    print(wall, cpu, (_server_cpu(client) - s0) / n)


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


WIRE = "INCRBY packed, on the ledger's wire"


def _redis_target(rfig: dict[str, float]) -> list[str]:
    """The Redis target's lines: the ratio (wall time and CPU time), and where it goes."""
    ratio = rfig["ledger.charge"]
    before = rfig.get("before: ledger.charge")
    incr, charge = "INCRBY round trip (floor)", "ledger.charge"
    script = rfig["ledger.charge's own script call, sent as made"]

    def cpu(kind: str, name: str) -> float:
        return rfig[f"{kind} cpu us {name}"]

    extra_server = cpu("server", charge) - cpu("server", incr)
    saved_client = cpu("client", incr) - cpu("client", charge)
    return [
        f"- Redis: one charge {ratio:.2f} x INCRBY in wall time (hiredis:"
        f" {rfig['ledger.charge, hiredis parser']:.2f} x INCRBY through hiredis), and"
        f" {rfig['cpu ' + charge]:.2f} x in CPU time (client + server); target <= 1.3:"
        f" {'met' if ratio <= 1.3 else 'not met'} in wall time"
        + (
            f" (before: {before:.2f} x wall, {rfig['cpu before: ledger.charge']:.2f} x CPU)"
            if before is not None
            else ""
        )
        + f". Where it goes: the charge's client CPU is {cpu('client', charge):.1f} us against"
        f" redis-py's {cpu('client', incr):.1f} us for INCRBY ({saved_client:.1f} us less),"
        f" while its script costs redis-server {cpu('server', charge):.1f} us of CPU against"
        f" {cpu('server', incr):.1f} us for INCRBY ({extra_server:.1f} us more; INFO"
        f" commandstats: the least charge {rfig['server EVALSHA least charge']:.1f} us, the"
        f" charge {rfig['server EVALSHA ledger.charge']:.1f} us, INCRBY"
        f" {rfig['server INCRBY']:.1f} us). The charge's own script call sent alone on the"
        f" ledger's wire is {script:.2f} x INCRBY, the least a charge does as a script"
        f" {rfig['EVALSHA of the least a charge does (script floor)']:.2f} x, the wire's floor"
        f" {rfig[WIRE]:.2f} x.",
    ]


def redis_only(args: argparse.Namespace, baseline: str | None) -> int:
    """``--redis-only``: the Redis table alone, in more interleaved rounds."""
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load0 = os.getloadavg()[0]
    with redis_server() as url:
        rows, rfig = redis_section(url, 11 if args.quick else 31, 300, baseline)
    load1 = os.getloadavg()[0]
    out = [
        "# Quota ledger: one Redis charge vs a bare INCRBY round trip",
        "",
        "Measured by `benches/bench_ledger.py --redis-only"
        + (f" --baseline {args.baseline}" if baseline else "")
        + f"` on {when}: CPython {platform.python_version()}, {platform.machine()},"
        f" {os.cpu_count()} CPUs (a shared machine, load average {load0:.1f} -> {load1:.1f}"
        f" during the run: read the ratios), redis-server on loopback (no persistence),"
        f" redis-py {_version('redis')}, hiredis {_version('hiredis')}. Candidates"
        " interleaved round by round; median (and least) time per call; each ratio is to"
        " INCRBY through the same reply parser."
        + (' "before": main\'s ledger, in a child process per round.' if baseline else ""),
        "",
        "| candidate | median us/call | min | calls/s | x INCRBY | client CPU us | server CPU us"
        " | CPU x INCRBY | what it does |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        *rows,
        "",
        "## Target",
        "",
        *_redis_target(rfig),
        "",
    ]
    text = "\n".join(out)
    print(text)
    Path(args.out if args.out != str(RESULTS) else RESULTS_REDIS).write_text(text)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller runs")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--baseline", default=None, help="a directory holding an earlier ratequeue")
    ap.add_argument(
        "--redis-only",
        action="store_true",
        help=f"only the Redis charge against INCRBY, more rounds (to {RESULTS_REDIS.name})",
    )
    ap.add_argument("--measure", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        measure(args.measure)
        return 0
    baseline = os.path.abspath(args.baseline) if args.baseline else None
    if args.redis_only:
        return redis_only(args, baseline)
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
    sq_rows, figs = sqlite_section(args.quick, baseline)
    with redis_server() as url:
        rd_rows, rfig = redis_section(
            url, 7 if args.quick else 21, 200 if args.quick else 400, baseline
        )
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
        "Seven interleaved rounds per candidate, each on a fresh file; median (and best)"
        " charges/s, and the median CPU time per charge (all threads; steadier than the"
        ' rate on a loaded machine); ratios of the medians. "before" rows: main\'s ledger'
        + (f" (`--baseline {args.baseline}`)" if baseline else " (not run: no `--baseline`)")
        + ", in a child process per round.",
        "",
        "| synchronous | candidate | charges/s (median) | best | CPU us per charge |"
        " x floor (COMMIT each) | x COMMIT every 8 | notes |",
        "|---|---|---:|---:|---:|---:|---:|---|",
        *sq_rows,
        "",
        "## Redis: one charge vs a bare INCRBY round trip",
        "",
        "| candidate | median us/call | min | calls/s | x INCRBY | client CPU us | server CPU us"
        " | CPU x INCRBY | what it does |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
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
    exact = (ex_sqlite, ex_redis)
    many = rfig[f"ledger.charge_many({MANY}), per charge"]
    load = os.getloadavg()
    out += [
        "",
        "## Targets",
        "",
        f"- SQLite >= 50,000 charges/s from 8 threads (medians): {figs['NORMAL.threads']:,.0f}/s"
        f" ({figs['NORMAL.threads'] / figs['NORMAL.threads_old']:.2f} x before)"
        if baseline
        else f"- SQLite >= 50,000 charges/s from 8 threads: {figs['NORMAL.threads']:,.0f}/s",
        f"  beside its floors in the same run: the plain loop committing every 8 (the largest"
        f" transaction 8 synchronous threads can share) {figs['NORMAL.floor8']:,.0f}/s, and the"
        f" handoff alone (8 threads through the writer, empty transactions)"
        f" {figs['NORMAL.handoff']:,.0f}/s, which together allow at most"
        f" {1 / (1 / figs['NORMAL.floor8'] + 1 / figs['NORMAL.handoff']):,.0f}/s before any"
        f" ledger work; `charge_many(100)` {figs['NORMAL.many']:,.0f}/s,"
        f" `charge_async` (500 in flight) {figs['NORMAL.async']:,.0f}/s: "
        f"{'met' if figs['NORMAL.threads'] >= 50_000 else 'not met on this machine'}"
        f" (load average {load[0]:.1f} on {os.cpu_count()} CPUs during the run). In CPU time"
        f" per charge: 8 threads {figs['NORMAL.threads.cpu']:.1f} us"
        + (f" (before {figs['NORMAL.threads_old.cpu']:.1f} us)" if baseline else "")
        + f"; the floors {figs['NORMAL.floor8.cpu']:.1f} us (COMMIT every 8) +"
        f" {figs['NORMAL.handoff.cpu']:.1f} us (handoff); 50,000/s leaves 20 us of wall time"
        " per charge",
        *_redis_target(rfig),
        f"  Batched, `charge_many({MANY})` costs {many:.2f} x one INCRBY per charge",
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
