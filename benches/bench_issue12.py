"""Issue 12 (the restructuring) before/after, both builds side by side in one run.

Each build's interpreter (``--build LABEL=PYTHON``: the first is "before", the second
"after") measures every row in a subprocess; the builds alternate round by round (the
order rotating) and each row shows its best round. Per-call rows are CPU time of the
measuring process (every thread), which a descheduled process does not accrue; the
thread and gather rows give elapsed time too. One redis-server (loopback, a free port,
no persistence) serves both builds.

    .venv/bin/python benches/bench_issue12.py --build before=/tmp/before/bin/python \
        --build after=.venv/bin/python [--rounds 5] [--out benches/results/issue12_before_after.md]

Floors, measured by each build in the same round: one extension method call with no work
(``_Floor().noop()``, or ``Limiter._noop()`` where a build has no ``_Floor``), a plain
native getter both builds have (``ManualClock.now_ns()``), ``await`` of a coroutine that
returns at once, a future resolved by ``loop.call_soon`` (one asyncio wake per task),
``threading.Semaphore`` across 8 threads, and a bare ``INCRBY`` round trip on the Redis
limiter's own client. A regression is a ratio above the floor rows' own ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from _pairs import Machine, best, builds_from, cpu_per_call_us, redis_server, run_rounds, threads

BIG = 1_000_000_000
CALLS = 200_000
GATHER_TASKS = 10_000
THREADS = 8
THREAD_GRANTS = 20_000
REDIS_CALLS = 3_000
REDIS_CHUNKS = 6


def _quiet(measure: Callable[[], Any]) -> Any:
    """``measure()`` with the cyclic GC collected first and off meanwhile."""
    gc.collect()
    gc.disable()
    try:
        return measure()
    finally:
        gc.enable()


def _cpu(fn: Callable[[], object], n: int = CALLS) -> float:
    return float(_quiet(lambda: cpu_per_call_us(fn, n)))


def _cpu_async(make: Callable[[], Awaitable[object]], n: int = CALLS) -> float:
    """CPU µs per ``await make()`` in one coroutine's loop, in a fresh event loop."""

    async def loop() -> float:
        cpu = time.process_time
        c0 = cpu()
        for _ in range(n):
            await make()
        return (cpu() - c0) / n * 1e6

    return float(_quiet(lambda: asyncio.run(loop())))


def _cpu_async_with(make: Callable[[], Any], n: int = CALLS) -> float:
    async def loop() -> float:
        cpu = time.process_time
        c0 = cpu()
        for _ in range(n):
            async with make():
                pass
        return (cpu() - c0) / n * 1e6

    return float(_quiet(lambda: asyncio.run(loop())))


def _gather(acquire_for: Callable[[asyncio.AbstractEventLoop], Callable[[], Any]]) -> list[float]:
    """[elapsed s, CPU µs per task] for GATHER_TASKS tasks gathered at once, one await each."""

    async def main() -> list[float]:
        acq = acquire_for(asyncio.get_running_loop())

        async def task() -> None:
            await acq()

        c0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(task() for _ in range(GATHER_TASKS)))
        return [time.perf_counter() - t0, (time.process_time() - c0) / GATHER_TASKS * 1e6]

    return list(_quiet(lambda: asyncio.run(main())))


def _floor_call() -> Callable[[], object]:
    import ratequeue as rq
    from ratequeue import _ratequeue

    floor = getattr(_ratequeue, "_Floor", None)
    if floor is not None:
        return floor().noop
    return rq.Limiter(rq.Rate(BIG, per="second", burst=BIG))._noop


def _driver_stats() -> tuple[float, int]:
    """The ratequeue driver thread's CPU seconds and voluntary context switches so far
    (0 before it starts), from ``/proc/self/task``."""
    hz = os.sysconf("SC_CLK_TCK")
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() != "ratequeue-drive":
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            status = (task / "status").read_text()
        except OSError:
            continue
        switches = next(
            int(line.split()[1])
            for line in status.splitlines()
            if line.startswith("voluntary_ctxt_switches")
        )
        return (int(fields[11]) + int(fields[12])) / hz, switches
    return 0.0, 0


#: The worker's sections (``--only``): each a group of rows measured together; ``keyed``
#: (the keyed and Concurrency rows with their floors) is part of ``rest``, alone for a
#: quick look at those rows.
SECTIONS = ("calls", "threads", "rest", "keyed")


def worker(redis_url: str, only: set[str]) -> dict[str, float]:
    """One round of the rows of the sections in ``only`` in this interpreter."""
    import ratequeue as rq

    out: dict[str, float] = {}
    out["floor"] = _cpu(_floor_call())
    out["floor_now"] = _cpu(rq.ManualClock().now_ns)

    lim = rq.Limiter(rq.Rate(BIG, per="second", burst=BIG))
    out["try_acquire"] = _cpu(lim.try_acquire)
    two = rq.Limiter(
        rq.Rate(BIG, per="second", burst=BIG),
        rq.Rate(BIG, per="second", burst=BIG, unit="tokens"),
    )
    out["try_acquire_tokens"] = _cpu(functools.partial(two.try_acquire, tokens=100))
    if "calls" in only:
        out["try_acquire_both"] = _cpu(functools.partial(two.try_acquire, 1, tokens=100))
        out["try_acquire_requests"] = _cpu(functools.partial(lim.try_acquire, requests=1))
        out["retry_after_tokens"] = _cpu(functools.partial(two.retry_after, tokens=100))
    if "threads" in only:
        out.update(_thread_rows(rq))
    if "keyed" in only and "rest" not in only:
        out.update(_sem_rows())
        out.update(_keyed_rows(rq))
    if "rest" not in only:
        return out
    out["acquire"] = _cpu(lim.acquire)

    def with_acquire() -> None:
        with lim.acquire():
            pass

    out["with_acquire"] = _cpu(with_acquire)

    tok = rq.Limiter(rq.Rate(BIG, per="second", burst=BIG, unit="tokens"))
    permit = tok.acquire(tokens=1_000)
    flip = [500, 1_000]
    i = [0]

    def settle() -> None:
        i[0] ^= 1
        permit.settle(tokens=flip[i[0]])

    out["settle"] = _cpu(settle)

    async def nothing() -> None:
        return None

    out["await_floor"] = _cpu_async(nothing)
    out["await_acquire"] = _cpu_async(lim.acquire_async)

    def one_wake(loop: asyncio.AbstractEventLoop) -> Callable[[], Any]:
        def acq() -> asyncio.Future[None]:
            f = loop.create_future()
            loop.call_soon(f.set_result, None)
            return f

        return acq

    out["gather_floor_s"], out["gather_floor_cpu"] = _gather(one_wake)
    out["gather_s"], out["gather_cpu"] = _gather(
        lambda _loop: rq.Limiter(rq.Rate(50_000, per="second", burst=10)).acquire_async
    )

    if "threads" not in only:
        out.update(_thread_rows(rq))

    policy = rq.Policy(
        {"rate": rq.Limiter(rq.Rate(BIG, per="second", burst=BIG)), "conc": rq.Concurrency(BIG)}
    )

    def policy_acquire() -> None:
        with policy.acquire():
            pass

    out["policy"] = _cpu(policy_acquire, CALLS // 4)
    out["policy_async"] = _cpu_async_with(policy.acquire_async, CALLS // 4)

    out.update(_keyed_rows(rq))
    out.update(_redis_rows(rq, redis_url))

    pool = rq.Pool([rq.Provider("only", rpm=BIG, tpm=BIG, burst=BIG, token_burst=BIG)])

    def pool_acquire() -> Awaitable[Any]:
        return pool.acquire_async(tokens=100)

    out["pool_async"] = _cpu_async(pool_acquire, CALLS // 4)
    return out


def _keyed_rows(rq: Any) -> dict[str, float]:
    """KeyedLimiter.try_acquire over 1,000 keys in turn, and Concurrency(2) on one
    thread and across 8 (the ``keyed`` section, also part of ``rest``)."""
    out: dict[str, float] = {}
    keyed = rq.KeyedLimiter(rq.Rate(BIG, per="second", burst=BIG))
    str_keys = [f"user-{k}" for k in range(1_000)] * (CALLS // 1_000)
    int_keys = list(range(1_000)) * (CALLS // 1_000)
    for k in str_keys[:1_000] + int_keys[:1_000]:
        keyed.try_acquire(k)
    out["keyed_str"] = _quiet(lambda: _cpu_over(keyed.try_acquire, str_keys))
    out["keyed_int"] = _quiet(lambda: _cpu_over(keyed.try_acquire, int_keys))

    conc = rq.Concurrency(2)

    def conc_once() -> None:
        with conc.acquire():
            pass

    out["conc"] = _cpu(conc_once)

    def conc_work(n: int) -> None:
        for _ in range(n):
            with conc.acquire():
                pass

    elapsed, out["conc_threads_cpu"] = threads(conc_work, THREADS, THREAD_GRANTS)
    out["conc_threads_us"] = elapsed / THREAD_GRANTS * 1e6
    return out


def _sem_rows() -> dict[str, float]:
    """The floor of the thread rows: ``threading.Semaphore(2)`` across 8 threads."""
    out: dict[str, float] = {}
    sem = threading.Semaphore(2)

    def sem_work(n: int) -> None:
        for _ in range(n):
            with sem:
                pass

    elapsed, out["sem_threads_cpu"] = threads(sem_work, THREADS, THREAD_GRANTS)
    out["sem_threads_us"] = elapsed / THREAD_GRANTS * 1e6
    return out


def _thread_rows(rq: Any) -> dict[str, float]:
    """8 threads of blocking acquires at 10,000/s (with the driver thread's share and
    wake-ups), beside ``threading.Semaphore`` across the same threads."""
    out = _sem_rows()
    rated = rq.Limiter(rq.Rate(10_000, per="second", burst=10))
    now = rq.MonotonicClock().now
    late: list[float] = []

    def rated_work(n: int) -> None:
        mine: list[float] = []
        for _ in range(n):
            arrival = now()
            waited = rated.acquire().waited
            if waited > 0:
                mine.append(now() - arrival - waited)
        late.extend(mine)

    cpu0, woke0 = _driver_stats()
    out["rate_threads_s"], out["rate_threads_cpu"] = threads(rated_work, THREADS, THREAD_GRANTS)
    cpu1, woke1 = _driver_stats()
    out["rate_driver_cpu"] = (cpu1 - cpu0) / THREAD_GRANTS * 1e6
    out["rate_driver_wakes"] = (woke1 - woke0) / THREAD_GRANTS
    late.sort()
    if late:
        out["rate_late_p50"] = late[len(late) // 2] * 1e6
        out["rate_late_p99"] = late[min(len(late) - 1, len(late) * 99 // 100)] * 1e6
    return out


def _cpu_over(fn: Callable[[Any], object], args: list[Any]) -> float:
    cpu = time.process_time
    c0 = cpu()
    for a in args:
        fn(a)
    return (cpu() - c0) / len(args) * 1e6


def _redis_rows(rq: Any, url: str) -> dict[str, float]:
    """The Redis limiter's try_acquire beside an INCRBY round trip on its own client."""
    from ratequeue.redis import RedisLimiter, connect

    client = connect(url, timeout=5.0)
    tag = f"{time.monotonic_ns()}"
    lim = RedisLimiter(client, rq.Rate(BIG, per="second", burst=BIG), name=f"bench12-{tag}")
    for _ in range(100):
        lim.try_acquire()
        client.incrby(f"bench12-floor-{tag}", 1)
    calls = {
        "redis_floor": functools.partial(client.incrby, f"bench12-floor-{tag}", 1),
        "redis": lim.try_acquire,
    }
    cpu = dict.fromkeys(calls, 0.0)
    wall = dict.fromkeys(calls, 0.0)
    chunk = REDIS_CALLS // REDIS_CHUNKS
    for _ in range(REDIS_CHUNKS):  # alternating, so a busy moment of the server hits both
        for key, fn in calls.items():
            t0 = time.perf_counter()
            cpu[key] += _cpu(fn, chunk) / REDIS_CHUNKS
            wall[key] += (time.perf_counter() - t0) / chunk * 1e6 / REDIS_CHUNKS
    out = {f"{k}_cpu": v for k, v in cpu.items()} | {f"{k}_wall": v for k, v in wall.items()}
    client.close()
    return out


# (key, what, the floor row its ratio is read against; None for a floor)
ROWS: list[tuple[str, str, str | None]] = [
    (
        "floor",
        "floor: one extension method call with no work (`_Floor().noop()` / `_noop()`)",
        None,
    ),
    ("floor_now", "floor: `ManualClock.now_ns()` (a native getter both builds have)", None),
    ("try_acquire", "`lim.try_acquire()`", "floor"),
    ("try_acquire_tokens", "`lim.try_acquire(tokens=100)`, two rates (requests, tokens)", "floor"),
    ("try_acquire_both", "`lim.try_acquire(1, tokens=100)`, two rates", "floor"),
    ("try_acquire_requests", "`lim.try_acquire(requests=1)`, one rate", "floor"),
    (
        "retry_after_tokens",
        "`lim.retry_after(tokens=100)`, two rates (no vectorcall entry)",
        "floor",
    ),
    ("acquire", "`lim.acquire()`, admitted at once", "floor"),
    ("with_acquire", "`with lim.acquire(): pass`, admitted at once", "floor"),
    ("settle", "`permit.settle(tokens=...)` (refund, then charge)", "floor"),
    ("await_floor", "floor: `await` of a coroutine that returns at once", None),
    ("await_acquire", "`await lim.acquire_async()`, uncontended", "await_floor"),
    ("gather_floor_cpu", "floor: 10,000 tasks gathered, each awaits a `call_soon` future", None),
    ("gather_floor_s", "floor: (same) elapsed", None),
    (
        "gather_cpu",
        "10,000 tasks gathered, `await acquire_async()`, 50,000/s burst 10",
        "gather_floor_cpu",
    ),
    ("gather_s", "(same) elapsed (ideal 0.2)", "gather_floor_s"),
    ("sem_threads_cpu", "floor: 8 threads x 2,500 `with threading.Semaphore(2)`", None),
    ("sem_threads_us", "floor: (same) elapsed per grant", None),
    (
        "rate_threads_cpu",
        "8 threads x 2,500 blocking `acquire()`, 10,000/s burst 10",
        "sem_threads_cpu",
    ),
    ("rate_threads_s", "(same) elapsed (ideal 2.0)", None),
    ("rate_driver_cpu", "(same) the driver thread's CPU per grant", "sem_threads_cpu"),
    ("rate_driver_wakes", "(same) the driver thread's wake-ups per grant", None),
    ("rate_late_p50", "(same) wake lateness of queued grants, p50", None),
    ("rate_late_p99", "(same) wake lateness of queued grants, p99", None),
    ("conc_threads_cpu", "8 threads x 2,500 `with Concurrency(2).acquire()`", "sem_threads_cpu"),
    ("conc_threads_us", "(same) elapsed per grant", "sem_threads_us"),
    ("policy", "`with policy.acquire(): pass`, Policy(rate, Concurrency)", "floor"),
    ("policy_async", "`async with policy.acquire_async(): pass`, same policy", "await_floor"),
    ("keyed_str", "`KeyedLimiter.try_acquire(key)`, 1,000 str keys in turn", "floor"),
    ("keyed_int", "`KeyedLimiter.try_acquire(key)`, 1,000 int keys in turn", "floor"),
    ("conc", "`with Concurrency(2).acquire(): pass`, one thread", "floor"),
    ("pool_async", "`await pool.acquire_async(tokens=100)`, one provider", "await_floor"),
    ("redis_floor_cpu", "floor: `client.incrby(key, 1)` (redis-py), one round trip", None),
    ("redis_floor_wall", "floor: (same) elapsed per call", None),
    ("redis_cpu", "`RedisLimiter.try_acquire()`, one EVALSHA round trip", "redis_floor_cpu"),
    ("redis_wall", "(same) elapsed per call", "redis_floor_wall"),
]
ELAPSED = {
    "rate_late_p50",
    "rate_late_p99",
    "gather_floor_s",
    "gather_s",
    "rate_threads_s",
    "sem_threads_us",
    "conc_threads_us",
    "redis_floor_wall",
    "redis_wall",
}
#: A row regressed when its ratio exceeds its floor's ratio by more than this.
FLAG = 1.10


def table(labels: list[str], figures: dict[str, dict[str, float]]) -> list[str]:
    """Markdown rows: each build's figure, the last/first ratio, and that ratio over its
    floor's (flagged past ``FLAG``)."""
    lines = [
        "| row | unit | " + " | ".join(labels) + " | ratio | over its floor's ratio |",
        "|---|---|" + "--:|" * len(labels) + "--:|--:|",
    ]

    def ratio(key: str) -> float | None:
        a, b = figures[labels[0]].get(key), figures[labels[-1]].get(key)
        return b / a if a and b else None

    for key, what, floor in ROWS:
        vals = [figures[label].get(key) for label in labels]
        if all(v is None for v in vals):
            continue
        unit = "s" if key.endswith("_s") else "µs wall" if key in ELAPSED else "µs CPU"
        if key.endswith("_wakes"):
            unit = "per grant"
        cells = " | ".join("cannot run" if v is None else f"{v:.3f}" for v in vals)
        r = ratio(key)
        rf = ratio(floor) if floor is not None else None
        over = ""
        if r is not None and rf is not None:
            over = f"{r / rf:.2f}" + (" **regressed**" if r / rf > FLAG else "")
        shown = "-" if r is None else f"{r:.2f}x"
        lines.append(f"| {what} | {unit} | {cells} | {shown} | {over} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", metavar="REDIS_URL", help=argparse.SUPPRESS)
    ap.add_argument("--build", action="append", default=[], help="LABEL=PYTHON (repeatable)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--note", default="", help="a paragraph appended under the table")
    ap.add_argument(
        "--only",
        default="calls,threads,rest",
        help=f"comma-separated sections to measure, of {', '.join(SECTIONS)} (default: all)",
    )
    a = ap.parse_args()
    only = set(a.only.split(","))
    if not only <= set(SECTIONS):
        raise SystemExit(f"--only takes sections of {SECTIONS}, got {a.only!r}")
    if a.worker:
        print(json.dumps(worker(a.worker, only)))
        return
    builds = builds_from(a.build, this=None) or [("this build", sys.executable)]
    labels = [label for label, _ in builds]
    machine = Machine()
    t0 = time.perf_counter()
    with redis_server() as url:
        args = ["--worker", url, "--only", a.only]
        runs = run_rounds(__file__, builds, a.rounds, {"": args})[""]
    figures = {label: best(r) for label, r in runs.items()}
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Issue 12 before/after (`benches/bench_issue12.py`)",
        "",
        f"Generated on {when}: {machine.summary()}; sections {a.only}; {a.rounds} "
        "interleaved rounds, best "
        f"round per row; total {time.perf_counter() - t0:.0f} s. Builds: "
        + ", ".join(f"{label} = `{p}`" for label, p in builds)
        + ".",
        "",
        *table(labels, figures),
    ]
    if a.note:
        lines += ["", a.note]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
