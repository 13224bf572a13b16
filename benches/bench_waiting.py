"""Waiting under contention: ratequeue's queue against the peers users pick today.

Everything runs in ONE process, one scenario after the other; the tables are printed and
written to ``benches/results/waiting.md``::

    .venv/bin/python benches/bench_waiting.py [--tasks 100000] [--cap 60] [--out PATH]
    .venv/bin/python benches/bench_waiting.py --quick          # a small run, for iteration
    .venv/bin/python benches/bench_waiting.py --sections gather --also OTHER_PYTHON=main

0. asyncio gather at once (the harness of issue 13): N tasks (default 100,000) created at
   once through ``asyncio.gather``, each awaiting one acquire at 50,000/s, burst 10 (ideal
   (N - 10) / 50,000 s). Floor rows in the same run: nothing awaited (task creation and
   gather only) and a future resolved by ``loop.call_soon`` (the floor of one wake); then
   ratequeue, aiolimiter (burst-10 form), the ``asyncio.Lock`` bucket and asyncio-throttle.
   Elapsed from before ``gather`` to its end (task creation included, as in the floor
   rows); % of the rate = ideal / elapsed; CPU per grant = ``time.process_time()`` (all
   threads, the driver's included) / N; "above one wake" = CPU per grant minus the
   call_soon row's. ``--also PYTHON=LABEL`` measures the ratequeue and floor rows again
   under another interpreter (e.g. a venv with main's build), the runs interleaved with
   this one's, for a before/after in one run.
1. asyncio contended: N tasks (default 100,000) each acquire once at 50,000/s, burst 10.
   Rows: ratequeue; aiolimiter in its 50,000-per-1-s form (its burst is ``max_rate``) and
   in the 10-per-0.2-ms form that matches burst 10; the classic ``asyncio.Lock`` token
   bucket written inline; asyncio-throttle in both forms; and a "no limiter" floor (the
   cost of creating, running and gathering the tasks, paid by every row).

   * achieved rate: ``(grants - burst) / elapsed``, elapsed from the first acquire call
     to the last grant (task resumed); 100 % means the configured rate was delivered.
   * CPU per grant: ``time.process_time()`` over the whole run (all threads, so
     ratequeue's driver thread counts) / grants; the loop thread's share is
     ``time.thread_time()``.
   * out of order: ``(grants - longest subsequence completed in arrival order) / grants``
     (tasks first run, and so reach the limiter, in index order); "rank != index" is the
     share of grants whose completion rank differs from their index (a magnifying
     measure: one early grant shifts the rank of every task it overtakes).

   A row whose first run takes under ``FAST_S`` seconds is run ``--repeat`` times and
   the median run (by elapsed) is shown; a peer still running after ``--cap`` seconds is
   stopped there and the row says so.
2. threads contended: 8 threads share 20,000 blocking acquires at 10,000/s, burst 10.
   Ideal elapsed ``(20,000 - 10) / 10,000 = 1.999 s``. Rows: ratequeue ``lim.acquire()``,
   throttled-py ``Throttled(timeout=...)``, pyrate-limiter v4 blocking ``try_acquire``
   (``buffer_ms`` 0 and its default 50); a row slower than ``--thread-cap`` is stopped.
   Beside ratequeue, in interleaved rounds, the floors of a timed wake (``_wake_floor.py``,
   no limiter): one thread sleeping to deadlines 100 µs apart, and 8 threads taking turns
   on that schedule; wake lateness (as in 3.) for every row, and the p99 target judged
   against the 8-thread floor of the same run.
3. ratequeue wake lateness: ``woke - permit.granted_at_ns`` on the limiter's clock
   (``rq.MonotonicClock``, the origin of grant times), ``woke`` read just after the
   acquire returns, ``granted_at_ns`` the grant's schedule time; queued grants only.
   Section 2 measures the same for its floor rows (threads sleeping to the same schedule
   with no limiter, ``_wake_floor.py``). Rows: the threads runs of 2; an instrumented
   re-run of the asyncio run of 1 (its loop is backlogged while the tasks start); steady
   asyncio runs (64 tasks looping, at 10,000/s and at 50,000/s).
4. uncontended: calls/s of ``await lim.acquire_async()`` and ``async with`` in a tight
   loop inside one coroutine, every call admitted, against aiolimiter (and, for context,
   the lock bucket and asyncio-throttle); interleaved rounds, best of ``--rounds``.

Peers that are not installed get a row saying so. Nothing else should run meanwhile:
the header records the load average at the start.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import datetime as dt
import gc
import importlib.metadata
import itertools
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _import_ratequeue() -> Any:
    """Import ratequeue, retrying while another engineer rebuilds the venv."""
    for attempt in range(6):
        try:
            import ratequeue

            return ratequeue
        except ImportError:
            if attempt == 5:
                raise
            time.sleep(30)
    raise AssertionError("unreachable")


rq = _import_ratequeue()
# The extension actually loaded (the venv may be rebuilt while this runs).
EXT_MTIME = Path(rq._ratequeue.__file__).stat().st_mtime

try:
    import aiolimiter
except ImportError:  # pragma: no cover - optional peer
    aiolimiter = None
try:
    import asyncio_throttle
except ImportError:  # pragma: no cover - optional peer
    asyncio_throttle = None
try:
    import throttled
except ImportError:  # pragma: no cover - optional peer
    throttled = None
try:
    import pyrate_limiter
except ImportError:  # pragma: no cover - optional peer
    pyrate_limiter = None

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "waiting.md"

ASYNC_RATE = 50_000
BURST = 10
THREAD_RATE = 10_000
THREADS = 8
THREAD_GRANTS = 20_000
# A row whose first run takes less than this is run --repeat times; the median is kept.
FAST_S = 5.0


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def pct(sorted_xs: list[float], q: float) -> float:
    """The q-quantile (0..1) of an already sorted list, nearest rank."""
    if not sorted_xs:
        return float("nan")
    i = min(len(sorted_xs) - 1, max(0, round(q * (len(sorted_xs) - 1))))
    return sorted_xs[i]


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}"


class OtherLoad:
    """Share of the machine's CPUs used by other processes while a section ran (Linux)."""

    def __init__(self) -> None:
        self.start = self._snap()

    @staticmethod
    def _snap() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
        busy = sum(fields[:8]) - fields[3] - fields[4]
        own = os.times()
        tick = os.sysconf("SC_CLK_TCK")
        return busy / tick, own.user + own.system, time.perf_counter()

    def note(self) -> str:
        end = self._snap()
        if self.start is None or end is None:
            return ""
        busy, own, wall = (e - s for e, s in zip(end, self.start, strict=True))
        other = max(0.0, busy - own) / (wall * (os.cpu_count() or 1))
        warn = " **(disturbed: not a clean measurement)**" if other > 0.10 else ""
        return f"Other processes used {other * 100:.0f} % of the CPUs during this section.{warn}"


# --------------------------------------------------------------------------- peers

GATHER_FLOOR_NOTHING = "nothing awaited (floor: tasks + gather)"
GATHER_FLOOR_WAKE = "a future resolved by loop.call_soon (floor of one wake)"


class LockTokenBucket:
    """The usual asyncio pattern: refill-then-sleep under an ``asyncio.Lock``."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.last = time.monotonic()
        self.lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self.lock:
            while True:
                now = time.monotonic()
                self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
                self.last = now
                if self.tokens >= 1:
                    self.tokens -= 1
                    return
                await asyncio.sleep((1 - self.tokens) / self.rate)

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        return None


# ------------------------------------------------------------ 0. gather at once


@dataclass
class GatherRow:
    name: str
    config: str
    n: int
    waits: bool = True
    elapsed: float = 0.0
    cpu: float = 0.0
    loop_cpu: float = 0.0
    capped: bool = False
    error: str = ""
    build: str = ""
    runs: list[float] = field(default_factory=list)
    setup: float = 0.0  # before gather -> the first task's acquire call
    span: float = 0.0  # the first acquire call -> the last task back from its acquire


async def _gather_once(
    make: Callable[[], Callable[[], Awaitable[Any]]], n: int, cap: float
) -> dict[str, Any]:
    """n tasks created at once through gather, each awaiting one acquire; also when the
    first task called acquire and when the last one came back from it."""
    acquire = make()
    perf = time.perf_counter
    first: list[float] = []
    last = [0.0]

    async def task() -> None:
        if not first:
            first.append(perf())
        await acquire()
        last[0] = perf()

    gc.collect()
    cpu0, loop0 = time.process_time(), time.thread_time()
    t0 = perf()
    everything = asyncio.gather(*(task() for _ in range(n)))
    done, _ = await asyncio.wait([everything], timeout=cap)
    elapsed = perf() - t0
    cpu, loop_cpu = time.process_time() - cpu0, time.thread_time() - loop0
    if not done:
        everything.cancel()
        await asyncio.gather(everything, return_exceptions=True)
    setup = first[0] - t0 if first else elapsed
    return {
        "elapsed": elapsed,
        "cpu": cpu,
        "loop_cpu": loop_cpu,
        "capped": not done,
        "setup": setup,
        "span": last[0] - t0 - setup if first else 0.0,
    }


def _gather_cases() -> list[tuple[str, str, bool, Callable[[], Callable[[], Awaitable[Any]]]]]:
    """(name, config, waits, make) per row; make() runs inside the loop."""

    async def nothing() -> None:
        return None

    def make_nothing() -> Callable[[], Awaitable[Any]]:
        return nothing

    def make_call_soon() -> Callable[[], Awaitable[Any]]:
        loop = asyncio.get_running_loop()

        def one() -> Awaitable[Any]:
            fut = loop.create_future()
            loop.call_soon(fut.set_result, None)
            return fut

        return one

    def make_rq() -> Callable[[], Awaitable[Any]]:
        return rq.Limiter(rq.Rate(ASYNC_RATE, per="second", burst=BURST)).acquire_async

    cases: list[tuple[str, str, bool, Callable[[], Callable[[], Awaitable[Any]]]]] = [
        (GATHER_FLOOR_NOTHING, "-", False, make_nothing),
        (GATHER_FLOOR_WAKE, "-", False, make_call_soon),
        ("ratequeue", "acquire_async(), Rate(50_000, per='second', burst=10)", True, make_rq),
    ]
    if aiolimiter is not None:
        cases.append(
            (
                "aiolimiter",
                "AsyncLimiter(10, 10/50_000).acquire()",
                True,
                lambda: aiolimiter.AsyncLimiter(BURST, BURST / ASYNC_RATE).acquire,
            )
        )
    cases.append(
        (
            "asyncio.Lock token bucket",
            "inline, rate 50_000, burst 10",
            True,
            lambda: LockTokenBucket(ASYNC_RATE, BURST).acquire,
        )
    )
    if asyncio_throttle is not None:
        cases.append(
            (
                "asyncio-throttle",
                "Throttler(10, 10/50_000).acquire()",
                True,
                lambda: asyncio_throttle.Throttler(BURST, BURST / ASYNC_RATE).acquire,
            )
        )
    return cases


OURS = (GATHER_FLOOR_NOTHING, GATHER_FLOOR_WAKE, "ratequeue")


def _gather_child(n: int, cap: float) -> None:
    """Child mode of --also: one run of the floor and ratequeue rows, as JSON lines."""
    import json

    for name, config, waits, make in _gather_cases():
        if name in OURS:
            r = asyncio.run(_gather_once(make, n, cap))
            print(json.dumps({"name": name, "config": config, "waits": waits, **r}), flush=True)


def _gather_other(python: str, n: int, cap: float) -> list[dict[str, Any]]:
    import json

    out = subprocess.run(
        [
            python,
            str(Path(__file__).resolve()),
            "--gather-child",
            "--tasks",
            str(n),
            "--cap",
            str(cap),
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _other_build(python: str) -> str:
    code = (
        "import ratequeue, pathlib; "
        "print(pathlib.Path(ratequeue._ratequeue.__file__).stat().st_mtime)"
    )
    try:
        out = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, check=True, cwd="/"
        )
        built = dt.datetime.fromtimestamp(float(out.stdout.strip()), dt.timezone.utc)
        return f"extension built {built:%Y-%m-%d %H:%M:%S} UTC"
    except (OSError, subprocess.CalledProcessError, ValueError):
        return "unknown build"


def gather_at_once(n: int, cap: float, repeat: int, also: list[tuple[str, str]]) -> list[GatherRow]:
    """Every row ``repeat`` times (interleaved rounds; another interpreter's rows run in
    the same rounds); the median run by elapsed is kept. A capped row runs once."""
    cases = _gather_cases()
    rows = {name: GatherRow(name, config, n, waits) for name, config, waits, _ in cases}
    others: dict[tuple[str, str], GatherRow] = {}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in rows}
    other_results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for k in range(repeat):
        for name, _, _, make in cases:
            row = rows[name]
            if row.error or (k and results[name] and results[name][0]["capped"]):
                continue
            try:
                results[name].append(asyncio.run(_gather_once(make, n, cap)))
            except Exception as e:  # a peer that breaks gets a row saying how
                row.error = f"{type(e).__name__}: {e}"
        for python, label in also:
            try:
                got = _gather_other(python, n, cap)
            except (OSError, subprocess.CalledProcessError) as e:
                got = []
                print(f"  {label}: {e}", flush=True)
            for r in got:
                key = (label, r["name"])
                if key not in others:
                    others[key] = GatherRow(r["name"], r["config"], n, r["waits"], build=label)
                other_results.setdefault(key, []).append(r)
        print(f"  gather round {k + 1}/{repeat} done", flush=True)

    def keep(row: GatherRow, runs: list[dict[str, Any]]) -> GatherRow:
        if not runs:
            return row
        runs = sorted(runs, key=lambda r: r["elapsed"])
        m = runs[len(runs) // 2]
        row.elapsed, row.cpu, row.loop_cpu, row.capped = (
            m["elapsed"],
            m["cpu"],
            m["loop_cpu"],
            m["capped"],
        )
        row.setup, row.span = m.get("setup", 0.0), m.get("span", 0.0)
        row.runs = [r["elapsed"] for r in runs]
        return row

    out = [keep(rows[name], results[name]) for name in rows]
    out += [keep(row, other_results[key]) for key, row in others.items()]
    for r in out:
        print(
            f"  {r.build or 'this build'} {r.name}: {r.elapsed:.2f} s "
            f"(creation {r.setup:.2f} s, first acquire to last grant {r.span:.2f} s), "
            f"{r.cpu / n * 1e6:.1f} µs CPU/grant",
            flush=True,
        )
    return out


def table_gather(rows: list[GatherRow], cap: float) -> list[str]:
    out = [
        "| build | what each task awaits | config | elapsed s | % of 50,000/s | CPU µs/grant "
        "| of which loop thread | above one wake (µs) | creation s | first acquire → last "
        "grant s | % of 50,000/s over that span | best elapsed s (creation floor + ideal) "
        "| % of best | note |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    by_build: dict[str, float] = {}
    for r in rows:
        if r.name == GATHER_FLOOR_WAKE and not r.error and r.n:
            by_build[r.build] = r.cpu / r.n
    ideal = max(0, rows[0].n - BURST) / ASYNC_RATE if rows else 0
    for r in rows:
        build = r.build or "this branch"
        if r.error:
            out.append(f"| {build} | {r.name} | `{r.config}` |" + " - |" * 10 + f" {r.error} |")
            continue
        per = r.cpu / r.n
        floor = by_build.get(r.build)
        above = fmt_us(per - floor) if r.waits and floor is not None else "-"
        share = f"{ideal / r.elapsed * 100:.1f}" if r.waits and r.elapsed > 0 else "-"
        span_share = f"{ideal / r.span * 100:.1f}" if r.waits and r.span > 0 else "-"
        best = gather_best(rows, r.build)
        best_s = f"{best:.3f}" if r.waits and best else "-"
        of_best = f"{best / r.elapsed * 100:.1f}" if r.waits and best and r.elapsed > 0 else "-"
        note = runs_note(r.runs)
        if r.capped:
            note = join_notes(note, f"**stopped at the {cap:.0f} s cap**")
        out.append(
            f"| {build} | {r.name} | `{r.config}` | {r.elapsed:.3f} | {share} | {fmt_us(per)} "
            f"| {fmt_us(r.loop_cpu / r.n)} | {above} | {r.setup:.3f} | {r.span:.3f} "
            f"| {span_share} | {best_s} | {of_best} | {note} |"
        )
    return out


def gather_best(rows: list[GatherRow], build: str) -> float:
    """The best elapsed any limiter could reach in this harness, in ``build``'s run: the
    creation floor (the nothing-awaited row's time from before gather to its first
    task's call: no task can acquire earlier) + the ideal (n - burst) / rate. 0: none."""
    for r in rows:
        if r.name == GATHER_FLOOR_NOTHING and r.build == build and not r.error and r.setup:
            return r.setup + max(0, r.n - BURST) / ASYNC_RATE
    return 0.0


# ------------------------------------------------------------ 1. asyncio contended


@dataclass
class AsyncRow:
    name: str
    config: str
    burst: int
    n: int
    grants: int = 0
    elapsed: float = 0.0
    cpu: float = 0.0
    loop_cpu: float = 0.0
    setup: float = 0.0
    out_of_order: float = 0.0
    displaced: float = 0.0
    capped: bool = False
    note: str = ""
    error: str = ""
    runs: list[float] = field(default_factory=list)

    @property
    def achieved(self) -> float:
        """Achieved rate beyond the burst, as a fraction of the configured rate."""
        if self.elapsed <= 0:
            return float("nan")
        return max(0, self.grants - self.burst) / self.elapsed / ASYNC_RATE


def lis_len(seq: list[int]) -> int:
    """Length of the longest increasing subsequence (patience sorting, O(n log n))."""
    tails: list[int] = []
    for x in seq:
        i = bisect.bisect_left(tails, x)
        if i == len(tails):
            tails.append(x)
        else:
            tails[i] = x
    return len(tails)


def order_metrics(order: list[int]) -> tuple[float, float]:
    """(out of order, displaced): fractions of grants.

    out of order = (n - longest in-order subsequence) / n: the fewest grants that must be
    taken out for the rest to be in arrival order (one task overtaking 50,000 counts 1).
    displaced = grants whose completion rank differs from their index (one early task
    shifts the rank of every task it overtook, so this one magnifies).
    """
    n = len(order)
    if not n:
        return 0.0, 0.0
    displaced = sum(1 for rank, i in enumerate(sorted(order)) if order[rank] != i)
    return (n - lis_len(order)) / n, displaced / n


async def _contended(acquire: Callable[[], Awaitable[Any]], n: int, cap: float) -> dict[str, Any]:
    """n tasks acquire once each, in index order; the figures of one run."""
    order: list[int] = []
    first = [0.0]
    last = [0.0]
    perf = time.perf_counter

    async def task(i: int) -> None:
        if not first[0]:
            first[0] = perf()
        await acquire()
        order.append(i)
        last[0] = perf()

    loop = asyncio.get_running_loop()
    gc.collect()
    cpu0, loop0 = time.process_time(), time.thread_time()
    t0 = perf()
    tasks = [loop.create_task(task(i)) for i in range(n)]
    _, pending = await asyncio.wait(tasks, timeout=cap)
    cpu, loop_cpu = time.process_time() - cpu0, time.thread_time() - loop0
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    ooo, displaced = order_metrics(order)
    return {
        "grants": len(order),
        "elapsed": last[0] - first[0],
        "setup": first[0] - t0,
        "cpu": cpu,
        "loop_cpu": loop_cpu,
        "out_of_order": ooo,
        "displaced": displaced,
        "capped": bool(pending),
    }


def run_contended(
    row: AsyncRow,
    make: Callable[[], Callable[[], Awaitable[Any]]],
    cap: float,
    repeat: int,
) -> AsyncRow:
    """Runs once; runs a fast row ``repeat`` times in all and keeps the median run."""
    runs: list[dict[str, Any]] = []

    async def main() -> None:
        acquire = make()  # built inside the loop: some peers bind to the running loop
        runs.append(await _contended(acquire, row.n, cap))

    try:
        asyncio.run(main())
        if runs[0]["elapsed"] < FAST_S and not runs[0]["capped"]:
            for _ in range(repeat - 1):
                asyncio.run(main())
    except Exception as e:  # a peer that breaks gets a row saying how
        row.error = f"{type(e).__name__}: {e}"
        print(f"  {row.name} [{row.config}]: {row.error}", flush=True)
        return row
    runs.sort(key=lambda r: r["elapsed"])
    for k, v in runs[len(runs) // 2].items():
        setattr(row, k, v)
    row.runs = [r["elapsed"] for r in runs]
    print(
        f"  {row.name} [{row.config}]: {row.grants:,} grants in {row.elapsed:.2f} s "
        f"(runs: {', '.join(f'{e:.2f}' for e in row.runs)})",
        flush=True,
    )
    return row


def asyncio_contended(n: int, cap: float, repeat: int) -> list[AsyncRow]:
    rows: list[AsyncRow] = []

    async def nothing() -> None:
        return None

    rows.append(
        run_contended(AsyncRow("no limiter (floor)", "-", 0, n), lambda: nothing, cap, repeat)
    )

    def make_rq() -> Callable[[], Awaitable[Any]]:
        lim = rq.Limiter(rq.Rate(ASYNC_RATE, per="second", burst=BURST))
        return lim.acquire_async

    rows.append(
        run_contended(
            AsyncRow("ratequeue", "Rate(50_000, per='second', burst=10)", BURST, n),
            make_rq,
            cap,
            repeat,
        )
    )

    if aiolimiter is None:
        rows.append(AsyncRow("aiolimiter", "-", 0, n, error="not installed"))
    else:

        def make_aio(rate: float, period: float) -> Callable[[], Callable[[], Awaitable[Any]]]:
            return lambda: aiolimiter.AsyncLimiter(rate, period).acquire

        rows.append(
            run_contended(
                AsyncRow(
                    "aiolimiter",
                    "AsyncLimiter(50_000, 1)",
                    ASYNC_RATE,
                    n,
                    note="burst = max_rate = 50,000",
                ),
                make_aio(ASYNC_RATE, 1),
                cap,
                repeat,
            )
        )
        rows.append(
            run_contended(
                AsyncRow("aiolimiter", "AsyncLimiter(10, 10/50_000)", BURST, n),
                make_aio(BURST, BURST / ASYNC_RATE),
                cap,
                repeat,
            )
        )

    rows.append(
        run_contended(
            AsyncRow("asyncio.Lock token bucket", "inline, rate 50_000, burst 10", BURST, n),
            lambda: LockTokenBucket(ASYNC_RATE, BURST).acquire,
            cap,
            repeat,
        )
    )

    if asyncio_throttle is None:
        rows.append(AsyncRow("asyncio-throttle", "-", 0, n, error="not installed"))
    else:

        def make_thr(limit: int, period: float) -> Callable[[], Callable[[], Awaitable[Any]]]:
            return lambda: asyncio_throttle.Throttler(limit, period).acquire

        rows.append(
            run_contended(
                AsyncRow(
                    "asyncio-throttle",
                    "Throttler(50_000, 1.0)",
                    ASYNC_RATE,
                    n,
                    note="sliding log: burst = 50,000; waiters poll every 10 ms",
                ),
                make_thr(ASYNC_RATE, 1.0),
                cap,
                repeat,
            )
        )
        rows.append(
            run_contended(
                AsyncRow(
                    "asyncio-throttle",
                    "Throttler(10, 10/50_000)",
                    BURST,
                    n,
                    note="waiters poll every 10 ms",
                ),
                make_thr(BURST, BURST / ASYNC_RATE),
                cap,
                repeat,
            )
        )
    return rows


def runs_note(runs: list[float]) -> str:
    if len(runs) < 2:
        return ""
    return f"median of {len(runs)} runs ({runs[0]:.2f}-{runs[-1]:.2f} s)"


def join_notes(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def table_async(rows: list[AsyncRow], floor_cpu_us: float, cap: float) -> list[str]:
    out = [
        "| limiter | config | grants | elapsed s | ideal s | achieved % of rate "
        "| CPU µs/grant | of which loop thread | above floor "
        "| out of order % | rank ≠ index % | note |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        if r.error:
            out.append(f"| {r.name} | {r.config} |" + " - |" * 9 + f" {r.error} |")
            continue
        note = join_notes(r.note, runs_note(r.runs))
        if r.capped:
            note = join_notes(
                note, f"**stopped at the {cap:.0f} s cap: {r.grants:,} of {r.n:,} granted**"
            )
        per = r.cpu / r.grants if r.grants else float("nan")
        loop_per = r.loop_cpu / r.grants if r.grants else float("nan")
        if r.burst == 0:
            ideal = achieved = above = "-"
            note = join_notes("create, run and gather the tasks: paid by every row", note)
        else:
            ideal = f"{max(0, r.n - r.burst) / ASYNC_RATE:.3f}"
            achieved = f"{r.achieved * 100:.1f}"
            above = fmt_us(per - floor_cpu_us * 1e-6)
        out.append(
            f"| {r.name} | `{r.config}` | {r.grants:,} | {r.elapsed:.3f} | {ideal} | {achieved} "
            f"| {fmt_us(per)} | {fmt_us(loop_per)} | {above} "
            f"| {r.out_of_order * 100:.2f} | {r.displaced * 100:.2f} | {note} |"
        )
    return out


# ------------------------------------------------------------ 2. threads contended


@dataclass
class ThreadRow:
    name: str
    config: str
    grants: int = 0
    failed: int = 0
    elapsed: float = 0.0
    cpu: float = 0.0
    capped: bool = False
    note: str = ""
    error: str = ""
    errors: dict[str, int] = field(default_factory=dict)
    lateness: list[float] = field(default_factory=list)
    runs: list[float] = field(default_factory=list)
    build: str = ""
    round_p99: list[float] = field(default_factory=list)
    missed: int = 0


# make() -> (acquire, after): acquire() blocks until granted (True) or refused (False);
# after(run) adds what the limiter knows to the run's figures (lateness, counters).
ThreadCase = Callable[[], tuple[Callable[[], bool], Callable[[dict[str, Any]], None]]]


def _threads_once(acquire: Callable[[], bool], cap: float, n: int) -> dict[str, Any]:
    """THREADS threads share n blocking acquires; stop taking tickets after cap s."""
    ticket = itertools.count()
    granted = itertools.count()
    failed = itertools.count()
    errors: dict[str, int] = {}
    start = threading.Barrier(THREADS + 1)
    last = [0.0] * THREADS
    deadline = [float("inf")]
    perf = time.perf_counter

    def worker(k: int) -> None:
        start.wait()
        while next(ticket) < n and perf() < deadline[0]:
            try:
                ok = acquire()
            except Exception as e:
                ok = False
                key = type(e).__name__
                errors[key] = errors.get(key, 0) + 1
            if ok:
                next(granted)
                last[k] = perf()
            else:
                next(failed)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(THREADS)]
    for t in threads:
        t.start()
    gc.collect()
    cpu0 = time.process_time()
    t0 = perf()
    deadline[0] = t0 + cap
    start.wait()
    for t in threads:
        t.join()
    cpu = time.process_time() - cpu0
    grants, fails = next(granted), next(failed)
    return {
        "cpu": cpu,
        "grants": grants,
        "failed": fails,
        "errors": errors,
        "elapsed": max(last) - t0,
        "capped": grants + fails < n,
    }


def run_threads(
    row: ThreadRow, make: ThreadCase, cap: float, repeat: int, n: int = THREAD_GRANTS
) -> ThreadRow:
    """Runs once; runs a fast row ``repeat`` times in all and keeps the median run."""
    runs: list[dict[str, Any]] = []
    while True:
        acquire, after = make()
        run = _threads_once(acquire, cap, n)
        after(run)
        runs.append(run)
        if len(runs) >= repeat or runs[0]["elapsed"] >= FAST_S or runs[0]["capped"]:
            break
    runs.sort(key=lambda r: r["elapsed"])
    for k, v in runs[len(runs) // 2].items():
        setattr(row, k, v)
    row.runs = [r["elapsed"] for r in runs]
    print(
        f"  {row.name} [{row.config}]: {row.grants:,} grants in {row.elapsed:.2f} s "
        f"(runs: {', '.join(f'{e:.2f}' for e in row.runs)})",
        flush=True,
    )
    return row


RQ_THREADS_CONFIG = "lim.acquire(), Rate(10_000, per='second', burst=10)"


def make_rq_threads() -> tuple[Callable[[], bool], Callable[[dict[str, Any]], None]]:
    """The ratequeue threads case: each grant's lateness recorded, per thread."""
    clock = rq.MonotonicClock()
    lim = rq.Limiter(rq.Rate(THREAD_RATE, per="second", burst=BURST))
    lateness: list[list[float]] = [[] for _ in range(THREADS)]
    local = threading.local()
    ids = itertools.count()

    now = clock.now_ns

    def acquire() -> bool:
        try:
            mine = local.mine
        except AttributeError:
            mine = local.mine = lateness[next(ids)]
        permit = lim.acquire()
        woke = now()
        if permit.waited > 0:
            mine.append(woke - permit.granted_at_ns)
        return True

    def after(run: dict[str, Any]) -> None:
        run["lateness"] = sorted(x / 1e9 for xs in lateness for x in xs)
        st = lim.stats()
        run["note"] = f"{st['immediate']:,} immediate, {st['queued_grants']:,} queued grants"

    return acquire, after


# The floors of the threads scenario (``_wake_floor``): the same 100 µs schedule slept
# to by threads with no limiter, lateness measured as ratequeue's.
FLOOR_ONE = "floor: one thread sleeping to deadlines 100 µs apart"
FLOOR_SCENARIO = "floor: 8 threads taking turns, each sleeping to its own 100 µs slot"
FLOORS = ((FLOOR_ONE, 1), (FLOOR_SCENARIO, THREADS))
FLOOR_CONFIG = "clock_nanosleep(TIMER_ABSTIME) through ctypes, timer slack 1 ns, no limiter"


def floor_once(threads: int) -> dict[str, Any]:
    """One run of a threads floor: THREAD_GRANTS slots 1/THREAD_RATE apart."""
    import _wake_floor

    return _wake_floor.run(
        rq.MonotonicClock(), threads, THREAD_GRANTS, 1_000_000_000 // THREAD_RATE
    )


def _threads_child(cap: float, floor: int) -> None:
    """Child mode for the threads section: one ratequeue run (or, with ``floor``, one
    run of the floor with that many threads), as a JSON line."""
    import json

    if floor:
        run = floor_once(floor)
    else:
        acquire, after = make_rq_threads()
        run = _threads_once(acquire, cap, THREAD_GRANTS)
        after(run)
    print(json.dumps(run), flush=True)


def _threads_other(python: str, cap: float, floor: int = 0) -> dict[str, Any]:
    import json

    out = subprocess.run(
        [
            python,
            str(Path(__file__).resolve()),
            "--threads-child",
            "--thread-cap",
            str(cap),
            "--floor-threads",
            str(floor),
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    ).stdout
    return next(json.loads(line) for line in out.splitlines() if line.startswith("{"))


def pooled(row: ThreadRow, runs: list[dict[str, Any]]) -> ThreadRow:
    """``row`` with the median run's figures (by elapsed) and the lateness of every run."""
    got = sorted(runs, key=lambda r: r["elapsed"])
    if not got:
        row.error = "no run completed"
        return row
    for key, v in got[len(got) // 2].items():
        if hasattr(row, key):
            setattr(row, key, v)
    row.runs = [r["elapsed"] for r in got]
    row.lateness = sorted(x for r in got for x in r["lateness"])
    row.round_p99 = sorted(pct(r["lateness"], 0.99) for r in got if r["lateness"])
    row.missed = sum(r.get("missed", 0) for r in got)
    return row


def floor_rows(runs: dict[str, list[dict[str, Any]]], build: str = "") -> list[ThreadRow]:
    return [pooled(ThreadRow(name, FLOOR_CONFIG, build=build), runs[name]) for name, _ in FLOORS]


def print_lateness(row: ThreadRow) -> None:
    print(
        f"  {row.build or 'this process'} {row.name}: lateness p50 "
        f"{fmt_us(pct(row.lateness, 0.5))} p99 {fmt_us(pct(row.lateness, 0.99))} µs "
        f"({len(row.lateness):,} wakes)",
        flush=True,
    )


def threads_builds(
    cap: float, rounds: int, also: list[tuple[str, str]]
) -> tuple[list[ThreadRow], list[ThreadRow]]:
    """The ratequeue threads row for this build and each ``--also`` build, and the two
    floors, each run in a fresh child process, interleaved round by round; lateness
    pooled over the rounds, elapsed and CPU from the median run. (floors, builds)"""
    builds = [(sys.executable, "this branch"), *also]
    runs: dict[str, list[dict[str, Any]]] = {label: [] for _, label in builds}
    fruns: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in FLOORS}
    for k in range(rounds):
        for name, threads in FLOORS:
            try:
                fruns[name].append(_threads_other(sys.executable, cap, threads))
            except (OSError, subprocess.CalledProcessError, StopIteration) as e:
                print(f"  {name}: {e}", flush=True)
        for python, label in builds:
            try:
                runs[label].append(_threads_other(python, cap))
            except (OSError, subprocess.CalledProcessError, StopIteration) as e:
                print(f"  {label}: {e}", flush=True)
        print(f"  threads round {k + 1}/{rounds} done", flush=True)
    floors = floor_rows(fruns, build="child processes")
    rows = [
        pooled(ThreadRow("ratequeue", RQ_THREADS_CONFIG, build=label), runs[label])
        for _, label in builds
    ]
    for row in floors + rows:
        print_lateness(row)
    return floors, rows


def threads_with_floors(cap: float, rounds: int) -> tuple[list[ThreadRow], ThreadRow]:
    """The two floors and ratequeue's threads row, in ``rounds`` interleaved rounds in
    this process (floor, floor, ratequeue); lateness pooled over the rounds, elapsed
    and CPU from the median run. (floors, ratequeue)"""
    fruns: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in FLOORS}
    rq_runs: list[dict[str, Any]] = []
    for _ in range(rounds):
        for name, threads in FLOORS:
            fruns[name].append(floor_once(threads))
        acquire, after = make_rq_threads()
        run = _threads_once(acquire, cap, THREAD_GRANTS)
        after(run)
        rq_runs.append(run)
    floors = floor_rows(fruns)
    row = pooled(ThreadRow("ratequeue", RQ_THREADS_CONFIG), rq_runs)
    for r in [*floors, row]:
        print_lateness(r)
    print(
        f"  {row.name} [{row.config}]: {row.grants:,} grants in {row.elapsed:.2f} s "
        f"(runs: {', '.join(f'{e:.2f}' for e in row.runs)})",
        flush=True,
    )
    return floors, row


def threads_contended(cap: float, repeat: int) -> tuple[list[ThreadRow], list[ThreadRow]]:
    """(floors, rows): ratequeue's row (first) and the peers' rows."""
    floors, ours = threads_with_floors(cap, repeat)
    rows: list[ThreadRow] = [ours]

    if throttled is None:
        rows.append(ThreadRow("throttled-py", "-", error="not installed"))
    else:

        def make_thr() -> tuple[Callable[[], bool], Callable[[dict[str, Any]], None]]:
            quota = throttled.rate_limiter.per_sec(THREAD_RATE, burst=BURST)
            thr = throttled.Throttled(
                key="bench", quota=quota, timeout=60, store=throttled.MemoryStore()
            )
            return (lambda: not thr.limit().limited), lambda run: None

        row = run_threads(
            ThreadRow(
                "throttled-py",
                "Throttled(quota=per_sec(10_000, burst=10), timeout=60), token_bucket",
            ),
            make_thr,
            cap,
            repeat,
        )
        row.note = (
            "between retries sleeps max(min(retry_after, 0.5), 0.2) s: at least 0.2 s "
            "(class constant `_WAIT_MIN_INTERVAL`, no parameter)"
        )
        rows.append(row)

    if pyrate_limiter is None:
        rows.append(ThreadRow("pyrate-limiter", "-", error="not installed"))
    else:
        for buffer_ms in (0, 50):

            def make_pl(
                buffer_ms: int = buffer_ms,
            ) -> tuple[Callable[[], bool], Callable[[dict[str, Any]], None]]:
                pl = pyrate_limiter.limiter_factory.create_token_bucket_limiter(
                    THREAD_RATE, pyrate_limiter.Duration.SECOND, burst=BURST, buffer_ms=buffer_ms
                )
                return (
                    lambda: bool(pl.try_acquire("bench", blocking=True, timeout=60)),
                    lambda run: None,
                )

            row = run_threads(
                ThreadRow(
                    "pyrate-limiter",
                    f"create_token_bucket_limiter(10_000, SECOND, burst=10, "
                    f"buffer_ms={buffer_ms}); try_acquire(blocking=True, timeout=60)",
                ),
                make_pl,
                cap,
                repeat,
            )
            row.note = "sleeps whole ms (`bucket.waiting()` is int ms) + buffer_ms" + (
                " (50 is the default)" if buffer_ms == 50 else ""
            )
            rows.append(row)
    return floors, rows


LATENESS_TEXT = (
    "Wake lateness, the same definition in every row: `clock.now_ns()` of "
    "`rq.MonotonicClock()` (the limiter's clock) read just after the blocking call returns, "
    "minus the time the wake was due: for ratequeue the grant's schedule time "
    "(`permit.granted_at_ns`; queued grants only), for a floor its deadline. Floors "
    "(`benches/_wake_floor.py`): threads sleep to absolute deadlines with libc "
    "`clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)` through ctypes (the GIL released "
    "around the call, as ratequeue's wait releases it) with the thread's timer slack at "
    "1 ns (`prctl(PR_SET_TIMERSLACK, 1)`, as ratequeue's self-timed waiters set it), no "
    "limiter: one thread on a 100 µs schedule (the cost of one timed wake), and 8 threads "
    "taking turns on it, slot i being thread i mod 8's (the floor of this scenario: the "
    "same threads, wakes and GIL hand-offs, nothing else). A slot already past when its "
    'thread comes to it is not slept for and not measured ("missed"), as a grant due '
    "before its waiter arrives is immediate. Pooled over the rounds."
)


def late_row(r: ThreadRow, rounds: int) -> LateRow:
    """A lateness-table row of a threads row (ratequeue or a floor), pooled over rounds."""
    name = f"{r.name} ({r.build})" if r.build else r.name
    note = f"p99 per round: {', '.join(fmt_us(x) for x in r.round_p99)}"
    if r.name in (FLOOR_ONE, FLOOR_SCENARIO):
        note += f"; {r.missed:,} slots missed; CPU {fmt_us(r.cpu / r.grants)} µs per slot"
    else:
        runs = ", ".join(f"{e:.3f}" for e in r.runs)
        note += f"; elapsed {runs} s; CPU {fmt_us(r.cpu / r.grants)} µs/grant"
    return LateRow(f"{name}: {rounds} rounds pooled", r.lateness, note)


def table_threads(rows: list[ThreadRow], cap: float) -> list[str]:
    ideal = (THREAD_GRANTS - BURST) / THREAD_RATE
    out = [
        "| limiter | config | grants | refused | elapsed s | vs ideal 1.999 s "
        "| achieved % of rate | CPU µs/grant | note |",
        "|---|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        name = f"{r.name} ({r.build})" if r.build else r.name
        if r.error:
            out.append(f"| {name} | {r.config} |" + " - |" * 6 + f" {r.error} |")
            continue
        note = join_notes(r.note, runs_note(r.runs))
        if r.errors:
            errs = ", ".join(f"{k} x{v}" for k, v in r.errors.items())
            note = join_notes(note, f"refusals raised: {errs}")
        if r.capped:
            note = join_notes(
                note,
                f"**stopped at the {cap:.0f} s cap: {r.grants:,} of {THREAD_GRANTS:,} granted**",
            )
            vs = "-"
        else:
            vs = f"{(r.elapsed / ideal - 1) * 100:+.2f} %"
        achieved = max(0, r.grants - BURST) / r.elapsed / THREAD_RATE * 100 if r.elapsed else 0
        per = r.cpu / r.grants if r.grants else float("nan")
        out.append(
            f"| {name} | `{r.config}` | {r.grants:,} | {r.failed:,} | {r.elapsed:.3f} | {vs} "
            f"| {achieved:.1f} | {fmt_us(per)} | {note} |"
        )
    return out


# ------------------------------------------------------------------ 3. lateness


@dataclass
class LateRow:
    name: str
    lateness: list[float]
    note: str = ""


def asyncio_lateness_contended(n: int) -> LateRow:
    """The n-task run of 1, instrumented: lateness; the order in which queued grants
    resumed (the channel delivers them in grant order); the rate of the grants themselves
    (schedule time, ``permit.granted_at_ns``) as opposed to the tasks' resumption."""
    clock = rq.MonotonicClock()
    late: list[float] = []
    done: list[tuple[int, bool]] = []  # (index, queued) in completion order
    last_sched = [0.0]
    t: dict[str, float] = {}

    async def main() -> None:
        lim = rq.Limiter(rq.Rate(ASYNC_RATE, per="second", burst=BURST))

        async def task(i: int) -> None:
            arrival = clock.now()
            t.setdefault("start", arrival)
            permit = await lim.acquire_async()
            woke = clock.now_ns()
            done.append((i, permit.waited > 0))
            due = permit.granted_at_ns
            last_sched[0] = max(last_sched[0], due / 1e9)
            if permit.waited > 0:
                late.append((woke - due) / 1e9)

        await asyncio.gather(*(task(i) for i in range(n)))
        t["end"] = clock.now()

    asyncio.run(main())
    late.sort()
    queued_ooo, _ = order_metrics([i for i, q in done if q])
    immediate = sum(1 for _, q in done if not q)
    overtaking = 0  # immediate grants that completed before an earlier arrival resumed
    lowest = 0  # the lowest index not yet completed
    completed = bytearray(n)
    for i, queued in done:
        if not queued and i > lowest:
            overtaking += 1
        completed[i] = 1
        while lowest < n and completed[lowest]:
            lowest += 1
    grant_rate = (n - BURST) / (last_sched[0] - t["start"]) / ASYNC_RATE
    done_rate = (n - BURST) / (t["end"] - t["start"]) / ASYNC_RATE
    note = (
        f"from the first acquire: grants (schedule time) at {grant_rate * 100:.1f} % of "
        f"the rate, tasks resumed at {done_rate * 100:.1f} % (last at "
        f"{t['end'] - t['start']:.2f} s); queued grants resumed "
        f"{queued_ooo * 100:.2f} % out of arrival order; {immediate:,} granted at once "
        f"(queue empty), {overtaking:,} of them before an earlier arrival had resumed"
    )
    return LateRow(f"asyncio: {n:,} tasks at once, 50,000/s (run of 1, instrumented)", late, note)


def asyncio_lateness_steady(tasks: int, rate: int, grants: int) -> LateRow:
    """`tasks` coroutines loop acquiring, `grants` in all at `rate`/s, burst 10."""
    clock = rq.MonotonicClock()
    late: list[float] = []
    t: dict[str, float] = {}

    async def main() -> None:
        lim = rq.Limiter(rq.Rate(rate, per="second", burst=BURST))
        ticket = itertools.count()

        async def worker() -> None:
            while next(ticket) < grants:
                permit = await lim.acquire_async()
                woke = clock.now_ns()
                if permit.waited > 0:
                    late.append((woke - permit.granted_at_ns) / 1e9)

        t["start"] = clock.now()
        await asyncio.gather(*(worker() for _ in range(tasks)))
        t["end"] = clock.now()

    asyncio.run(main())
    late.sort()
    el = t["end"] - t["start"]
    ideal = (grants - BURST) / rate
    return LateRow(
        f"asyncio: {tasks} tasks looping, {grants:,} at {rate:,}/s",
        late,
        f"elapsed {el:.3f} s vs ideal {ideal:.3f} s ({(el / ideal - 1) * 100:+.2f} %)",
    )


def table_lateness(rows: list[LateRow]) -> list[str]:
    out = [
        "| ratequeue waiter | queued grants measured | p50 µs | p90 µs | p99 µs | max µs | note |",
        "|---|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        xs = r.lateness
        out.append(
            f"| {r.name} | {len(xs):,} | {fmt_us(pct(xs, 0.5))} | {fmt_us(pct(xs, 0.9))} "
            f"| {fmt_us(pct(xs, 0.99))} | {fmt_us(xs[-1] if xs else float('nan'))} | {r.note} |"
        )
    return out


# --------------------------------------------------------------- 4. uncontended


async def _loop_await(acquire: Callable[[], Awaitable[Any]], n: int) -> float:
    perf = time.perf_counter
    t0 = perf()
    for _ in range(n):
        await acquire()
    return perf() - t0


async def _loop_async_with(cm: Callable[[], Any], n: int) -> float:
    perf = time.perf_counter
    t0 = perf()
    for _ in range(n):
        async with cm():
            pass
    return perf() - t0


async def _loop_async_with_obj(obj: Any, n: int) -> float:
    perf = time.perf_counter
    t0 = perf()
    for _ in range(n):
        async with obj:
            pass
    return perf() - t0


def uncontended(n: int, rounds: int) -> list[tuple[str, str, float]]:
    """(name, statement, best calls/s) per candidate; every call admitted.

    Rounds are interleaved (A B C ... A B C ...) so a slow drift of the machine hits every
    candidate alike; each timing runs in a fresh event loop with the cyclic GC off.
    """

    def rq_lim() -> Any:
        return rq.Limiter(rq.Rate(1e9, per="second", burst=10**9))

    async def rq_await() -> float:
        return await _loop_await(rq_lim().acquire_async, n)

    async def rq_with() -> float:
        return await _loop_async_with(rq_lim().acquire_async, n)

    cases: list[tuple[str, str, Callable[[], Awaitable[float]]]] = [
        ("ratequeue", "await lim.acquire_async()", rq_await),
        ("ratequeue", "async with lim.acquire_async():", rq_with),
    ]
    if aiolimiter is not None:

        async def aio_await() -> float:
            return await _loop_await(aiolimiter.AsyncLimiter(1e9, 1).acquire, n)

        async def aio_with() -> float:
            return await _loop_async_with_obj(aiolimiter.AsyncLimiter(1e9, 1), n)

        cases += [
            ("aiolimiter", "await limiter.acquire()", aio_await),
            ("aiolimiter", "async with limiter:", aio_with),
        ]

    async def lock_await() -> float:
        return await _loop_await(LockTokenBucket(1e9, 10**9).acquire, n)

    cases.append(("asyncio.Lock token bucket", "await bucket.acquire()", lock_await))
    if asyncio_throttle is not None:

        async def thr_await() -> float:
            return await _loop_await(asyncio_throttle.Throttler(10**9, 1.0).acquire, n)

        cases.append(("asyncio-throttle", "await throttler.acquire()", thr_await))

    best = [0.0] * len(cases)
    for _ in range(rounds):
        for k, (_, _, make) in enumerate(cases):
            gc.collect()
            gc.disable()
            try:
                el = asyncio.run(make())
            finally:
                gc.enable()
            best[k] = max(best[k], n / el)
    for (name, stmt, _), v in zip(cases, best, strict=True):
        print(f"  {name}: {stmt}: {v:,.0f} calls/s", flush=True)
    return [(name, stmt, v) for (name, stmt, _), v in zip(cases, best, strict=True)]


def table_uncontended(results: list[tuple[str, str, float]]) -> list[str]:
    def kind(stmt: str) -> str:
        return "with" if stmt.startswith("async with") else "await"

    ref = {kind(stmt): v for name, stmt, v in results if name == "aiolimiter"}
    out = [
        "| limiter | statement | calls/s (best of rounds) | ns/call | vs aiolimiter, same form |",
        "|---|---|--:|--:|--:|",
    ]
    for name, stmt, v in results:
        base = ref.get(kind(stmt))
        ratio = f"{v / base:.2f}x" if base else "-"
        out.append(f"| {name} | `{stmt}` | {v:,.0f} | {1e9 / v:,.0f} | {ratio} |")
    return out


# ------------------------------------------------------------------------ main


def build_info() -> str:
    """The commit of the working tree and the age of the installed extension."""
    try:
        head = subprocess.run(
            ["git", "-C", str(HERE.parent), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        head = "unknown"
    built = dt.datetime.fromtimestamp(EXT_MTIME, dt.timezone.utc)
    return f"tree {head}, loaded extension built {built:%Y-%m-%d %H:%M:%S} UTC"


def rebuilt_note() -> str:
    """A warning when the installed extension changed on disk while this ran."""
    if Path(rq._ratequeue.__file__).stat().st_mtime != EXT_MTIME:
        return (
            " **The installed extension was rebuilt while this ran (a build competed for "
            "the CPUs); the figures are from the one loaded at the start.**"
        )
    return ""


SECTIONS = ("gather", "contended", "threads", "lateness", "uncontended")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=100_000, help="asyncio tasks (0. and 1.)")
    ap.add_argument("--cap", type=float, default=60.0, help="asyncio per-peer cap, seconds")
    ap.add_argument("--thread-cap", type=float, default=10.0, help="threads per-peer cap, s")
    ap.add_argument("--repeat", type=int, default=3, help="runs of a fast contended row")
    ap.add_argument("--calls", type=int, default=200_000, help="uncontended calls per round")
    ap.add_argument("--rounds", type=int, default=7, help="uncontended rounds")
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help="comma-separated subset of " + ", ".join(SECTIONS),
    )
    ap.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="PYTHON=LABEL",
        help="gather and threads sections: the ratequeue rows (and the gather floors) under "
        "another interpreter too, in interleaved rounds",
    )
    ap.add_argument(
        "--quick", action="store_true", help="20,000 tasks, one run per row, short rounds"
    )
    ap.add_argument(
        "--thread-rounds",
        type=int,
        default=5,
        help="with --also: interleaved rounds of the ratequeue threads row per build",
    )
    ap.add_argument("--gather-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--floor-threads", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.gather_child:
        _gather_child(args.tasks, args.cap)
        return
    if args.threads_child:
        _threads_child(args.thread_cap, args.floor_threads)
        return
    if args.quick:
        args.tasks, args.repeat, args.calls, args.rounds = 20_000, 1, 50_000, 3
    out_path = args.out or (HERE / "results" / "waiting_quick.md" if args.quick else DEFAULT_OUT)
    sections = {x.strip() for x in args.sections.split(",") if x.strip()}
    unknown = sections - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}")
    also = [tuple(a.split("=", 1)) if "=" in a else (a, a) for a in args.also]

    load0 = os.getloadavg()[0]
    info = build_info()
    wall0 = time.perf_counter()
    body: list[str] = []
    targets = ["| target | measured | |", "|---|---|---|"]

    def ok(b: bool) -> str:
        return "pass" if b else "**FAIL**"

    if "gather" in sections:
        print("0. asyncio gather at once", flush=True)
        load = OtherLoad()
        grows = gather_at_once(args.tasks, args.cap, args.repeat, also)  # type: ignore[arg-type]
        note = load.note()
        mine = {r.name: r for r in grows if not r.build}
        wake, ours = mine.get(GATHER_FLOOR_WAKE), mine.get("ratequeue")
        if wake and ours and not ours.error:
            above = (ours.cpu - wake.cpu) / args.tasks * 1e6
            ideal = (args.tasks - BURST) / ASYNC_RATE
            targets.append(
                "| gather at once: ≤ 3 µs CPU per grant above the one-wake floor "
                f"| {above:.1f} µs | {ok(above <= 3)} |"
            )
            best = gather_best(grows, "")
            span_share = ideal / ours.span if ours.span > 0 else 0.0
            # No room when even the one-wake floor, with no limit on the rate, takes longer
            # than ideal / 0.95 from its first task to its last wake (a CPU-bound loop).
            room = wake.span < ideal / 0.95
            targets.append(
                "| gather at once: ≥ 95 % of 50,000/s where the floor leaves room: over the "
                "span from the first acquire to the last grant (before it, gather creates the "
                f"tasks: {mine[GATHER_FLOOR_NOTHING].setup:.2f} s in the nothing-awaited row; "
                f"the one-wake floor's own span, no rate limit: {wake.span:.2f} s) "
                f"| {span_share * 100:.1f} % ({ours.span:.2f} s for ideal {ideal:.2f} s) "
                f"| {ok(span_share >= 0.95) if room or span_share >= 0.95 else 'no room'} |"
            )
            if best:
                targets.append(
                    "| (same, whole elapsed against the best any limiter could reach here: "
                    f"creation floor + ideal = {best:.2f} s) | {best / ours.elapsed * 100:.1f} % "
                    f"({ours.elapsed:.2f} s; {ideal / ours.elapsed * 100:.1f} % of the bare "
                    f"ideal) | {ok(best / ours.elapsed >= 0.95)} |"
                )
        builds = "; ".join(f"{label}: `{py}` ({_other_build(py)})" for py, label in also)
        body += [
            f"## 0. asyncio gather at once: {args.tasks:,} tasks, one acquire each, "
            "50,000/s, burst 10",
            "",
            "The harness of issue 13: the tasks are created at once through `asyncio.gather`; "
            "elapsed from before `gather` to its end (task creation included, as in the floor "
            f"rows); ideal {(args.tasks - BURST) / ASYNC_RATE:.3f} s; % of the rate = ideal / "
            "elapsed. No task runs, so none acquires, before gather has created them all: "
            "creation = before `gather` to the first task's acquire call, and the rate the "
            "floor leaves room for is measured over the span from that call to the last task "
            "back from its acquire (% over that span = ideal / span); the best elapsed any "
            "limiter could reach here is the creation floor (the nothing-awaited row's "
            "creation, same build) + ideal, and % of best = best / elapsed. The target compares "
            "the rate over the span (the part a limiter governs) with 95 %; there is no room "
            "for it when the one-wake floor's own span (its tasks' first steps and wakes, no "
            "rate limit) is already longer than ideal / 0.95. CPU = "
            "`time.process_time()` (all threads, ratequeue's driver included) / tasks; the "
            "loop thread's part is `time.thread_time()`. Above one wake = CPU per "
            f"grant minus the call_soon row of the same build. Median of {args.repeat} "
            f"interleaved rounds. {note}" + (f" Other builds: {builds}." if builds else ""),
            "",
            *table_gather(grows, args.cap),
            "",
        ]
    if "contended" in sections:
        print("1. asyncio contended", flush=True)
        load = OtherLoad()
        arows = asyncio_contended(args.tasks, args.cap, args.repeat)
        note = load.note()
        floor = next(r for r in arows if r.burst == 0 and not r.error)
        floor_cpu_us = floor.cpu / floor.grants * 1e6
        rq_async = next(r for r in arows if r.name == "ratequeue")
        rq_cpu = rq_async.cpu / rq_async.grants if rq_async.grants else float("nan")
        targets.append(
            f"| asyncio contended achieved ≥ 99 % | {rq_async.achieved * 100:.1f} % "
            f"| {ok(rq_async.achieved >= 0.99)} |"
        )
        for r in (r for r in arows if r.name == "aiolimiter" and not r.error and r.grants):
            aio_cpu = r.cpu / r.grants
            targets.append(
                f"| asyncio contended CPU/grant ≤ 1/3 of aiolimiter `{r.config}` "
                f"| {rq_cpu * 1e6:.1f} µs vs {aio_cpu * 1e6:.1f} µs = {rq_cpu / aio_cpu:.2f}x "
                f"| {ok(rq_cpu <= aio_cpu / 3)} |"
            )
        body += [
            f"## 1. asyncio contended: {args.tasks:,} tasks, one acquire each, 50,000/s, burst 10",
            "",
            "Achieved = (grants - burst) / elapsed, elapsed from the first acquire call to the "
            "last grant (task resumed); creating the tasks beforehand is not in it. "
            "CPU = `time.process_time()` over the whole run (all threads, so ratequeue's "
            "driver thread counts) / grants; the loop-thread part is "
            "`time.thread_time()`; the floor row is the cost of the tasks themselves. "
            "Out of order = (grants - longest subsequence completed in arrival order) / "
            "grants; rank ≠ index = grants whose completion rank differs from their arrival "
            f"index (one early grant shifts every rank it overtakes). Rows under {FAST_S:.0f} s "
            f"are run {args.repeat} times and the median run (by elapsed) is shown. {note}",
            "",
            *table_async(arows, floor_cpu_us, args.cap),
            "",
        ]
    trows: list[ThreadRow] = []
    if "threads" in sections or "lateness" in sections:
        print("2. threads contended", flush=True)
        load = OtherLoad()
        floors, trows = threads_contended(args.thread_cap, args.repeat)
        fb, brows = (
            threads_builds(args.thread_cap, args.thread_rounds, also)  # type: ignore[arg-type]
            if also
            else ([], [])
        )
        note = load.note()
        rq_thr = trows[0]
        thr_dev = rq_thr.elapsed / 2.0 - 1
        targets.append(
            f"| threads elapsed within 1 % of 2.0 s | {rq_thr.elapsed:.3f} s "
            f"({thr_dev * 100:+.2f} %) "
            f"| {ok(abs(thr_dev) <= 0.01)} |"
        )
        one, scen = floors
        if rq_thr.lateness and scen.lateness and one.lateness:
            p50, p99 = pct(rq_thr.lateness, 0.5), pct(rq_thr.lateness, 0.99)
            f50, f99 = pct(scen.lateness, 0.5), pct(scen.lateness, 0.99)
            verdict = ok(p99 <= 50e-6) if f99 <= 50e-6 or p99 <= 50e-6 else "no room"
            targets.append(
                "| threads wake lateness p99 ≤ 50 µs (idle machine), where the floor leaves "
                f"room: the 8-thread floor's p99 {f99 * 1e6:.0f} µs, the one-thread floor's "
                f"{pct(one.lateness, 0.99) * 1e6:.0f} µs in the same run "
                f"| {p99 * 1e6:.0f} µs | {verdict} |"
            )
            targets.append(
                "| threads wake lateness above the 8-thread floor, same run (p50 / p99) "
                f"| {p50 * 1e6:.1f} vs {f50 * 1e6:.1f} µs ({(p50 - f50) * 1e6:+.1f}) / "
                f"{p99 * 1e6:.0f} vs {f99 * 1e6:.0f} µs ({(p99 - f99) * 1e6:+.0f}) | - |"
            )
        body += [
            "## 2. threads contended: 8 threads share 20,000 blocking acquires, 10,000/s, burst 10",
            "",
            "Ideal elapsed (20,000 - 10) / 10,000 = 1.999 s (the burst is free); elapsed is "
            "from the start barrier to the last grant. ratequeue's row and the two floors "
            f"run in {args.repeat} interleaved rounds in this process (floor, floor, "
            f"ratequeue); the median run is shown. {note}",
            "",
            *table_threads(trows, args.thread_cap),
            "",
            "### Wake lateness beside the floor, same run",
            "",
            LATENESS_TEXT,
            "",
            *table_lateness([late_row(r, args.repeat) for r in [*floors, rq_thr]]),
            "",
        ]
        if brows:
            builds = "; ".join(
                f"{label}: `{py}` ({_other_build(py)})"
                for py, label in [(sys.executable, "this branch"), *also]
            )
            body += [
                "### ratequeue, build beside build, with the floors",
                "",
                f"{args.thread_rounds} interleaved rounds (the two floors, then each build), "
                "each run in a fresh child process (this branch's too); elapsed and CPU from "
                "the median run, lateness pooled over the rounds (defined as above). "
                f"Builds: {builds}.",
                "",
                *table_threads(brows, args.thread_cap),
                "",
                *table_lateness([late_row(r, args.thread_rounds) for r in [*fb, *brows]]),
                "",
            ]
    if "lateness" in sections:
        print("3. wake lateness", flush=True)
        load = OtherLoad()
        late_rows = [
            LateRow(
                f"threads: 8 threads, 20,000 at 10,000/s ({args.repeat} runs of section 2 pooled)",
                trows[0].lateness,
                f"elapsed {trows[0].elapsed:.3f} s (median run)",
            ),
            asyncio_lateness_contended(args.tasks),
            asyncio_lateness_steady(64, THREAD_RATE, 20_000),
            asyncio_lateness_steady(64, ASYNC_RATE, 100_000),
        ]
        note = load.note()
        body += [
            "## 3. ratequeue wake lateness: woke - permit.granted_at_ns",
            "",
            "On `rq.MonotonicClock()` (the limiter's clock, origin of grant times): `now_ns()` "
            "read just after the acquire returns (the task resumed) minus the grant's "
            "schedule time, as in section 2's floor rows. "
            f"Queued grants only (waited > 0). {note}",
            "",
            *table_lateness(late_rows),
            "",
        ]
    if "uncontended" in sections:
        print("4. uncontended", flush=True)
        load = OtherLoad()
        urows = uncontended(args.calls, args.rounds)
        note = load.note()
        u = {(name, stmt): v for name, stmt, v in urows}
        speedup = u.get(("ratequeue", "await lim.acquire_async()"), 0) / u.get(
            ("aiolimiter", "await limiter.acquire()"), float("nan")
        )
        with_speedup = u.get(("ratequeue", "async with lim.acquire_async():"), 0) / u.get(
            ("aiolimiter", "async with limiter:"), float("nan")
        )
        targets.append(
            f"| uncontended `await acquire_async()` ≥ 3x aiolimiter's `await acquire()` calls/s "
            f"| {speedup:.2f}x | {ok(speedup >= 3)} |"
        )
        targets.append(f"| (same, `async with`) | {with_speedup:.2f}x | {ok(with_speedup >= 3)} |")
        body += [
            "## 4. uncontended: one coroutine, tight loop, every call admitted",
            "",
            f"{args.calls:,} calls per round, best of {args.rounds} interleaved rounds; "
            f"fresh event loop per timing; GC off while timing. {note}",
            "",
            *table_uncontended(urows),
            "",
        ]
    total = time.perf_counter() - wall0

    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    peers = ", ".join(
        f"{d} {version(d)}"
        for d in ("aiolimiter", "asyncio-throttle", "throttled-py", "pyrate-limiter")
    )
    lines = [
        "# ratequeue waiting benchmarks",
        "",
        f"Generated by `benches/bench_waiting.py` on {now}: Python {platform.python_version()} "
        f"({sys.implementation.name}), {platform.system()} {platform.release()} "
        f"{platform.machine()}, {os.cpu_count()} CPUs, load average {load0:.2f} at start; "
        f"ratequeue {rq.__version__} ({info}); {peers}. Default asyncio event "
        f"loop. Total runtime {total:.0f} s. Command: `{' '.join(sys.argv)}`.{rebuilt_note()}",
        "",
        "## Targets",
        "",
        *targets,
        "",
        *body,
    ]
    text = "\n".join(lines)
    print()
    print(text)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(text)


if __name__ == "__main__":
    main()
