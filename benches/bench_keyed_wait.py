"""Keyed waiting: the per-key acquire paths of two builds of ratequeue, side by side.

Issue 12 moved the per-key queue map out of the bindings into the core; this measures
that it costs nothing. Each row runs in a fresh subprocess, once against the build under
test and once against a baseline copy of the package (``--before DIR``, a directory
holding a built ``ratequeue``); rounds interleave the two and the table shows the median
over rounds. Rows (µs per operation, lower is better):

- floor: ``asyncio.Semaphore(1)`` handed between 100 tasks, ``threading.Semaphore(1)``
  handed between two threads, and a no-op method of the extension: what Python,
  asyncio and a call into the extension cost for the same work;
- ``KeyedLimiter.acquire(key)`` and ``await acquire_async(key)``, admitted at once (the
  fast path, no queue made);
- ``KeyedConcurrency(1)``: two threads taking turns on one key (every grant queued: the
  key's queue made, waited in, dropped) and 100 tasks sharing one key
  (``async with acquire_async(key)``); the peer row is the same with the asyncio or
  threading semaphore.

Usage::

    .venv/bin/python benches/bench_keyed_wait.py --before /path/with/old/ratequeue \
        [--rounds 5] [--out benches/results/keyed_wait.md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "keyed_wait.md"
N_FAST = 200_000
N_TURNS = 20_000
N_TASKS = 100
N_ASYNC = 20_000


def _floor_call() -> Callable[[], object]:
    import ratequeue._ratequeue as native

    floor = getattr(native, "_Floor", None)
    if floor is not None:
        return floor().noop  # type: ignore[no-any-return]
    import ratequeue as rq

    return rq.Limiter(rq.Rate(1, per="second"))._noop  # type: ignore[attr-defined,no-any-return]


def _per_call(n: int, f: Callable[[], object]) -> float:
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6


def row_noop() -> float:
    return _per_call(N_FAST, _floor_call())


def row_acquire_fast() -> float:
    import ratequeue as rq

    kl = rq.KeyedLimiter(rq.Rate(1e9, per="second", burst=10**9))
    return _per_call(N_FAST, lambda: kl.acquire("user:1"))


def row_acquire_async_fast() -> float:
    import ratequeue as rq

    kl = rq.KeyedLimiter(rq.Rate(1e9, per="second", burst=10**9))

    async def main() -> float:
        t = time.perf_counter()
        for _ in range(N_FAST):
            await kl.acquire_async("user:1")
        return (time.perf_counter() - t) / N_FAST * 1e6

    return asyncio.run(main())


def _turns(acquire: Callable[[], object], release: Callable[[object], None]) -> float:
    def run() -> None:
        for _ in range(N_TURNS):
            p = acquire()
            release(p)

    threads = [threading.Thread(target=run) for _ in range(2)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return (time.perf_counter() - t) / (2 * N_TURNS) * 1e6


def row_threads_keyed() -> float:
    import ratequeue as rq

    kc = rq.KeyedConcurrency(1)
    return _turns(lambda: kc.acquire("k"), lambda p: p.__exit__(None, None, None))  # type: ignore[attr-defined]


def row_threads_floor() -> float:
    s = threading.Semaphore(1)
    return _turns(s.acquire, lambda _: s.release())


def _tasks(make: Callable[[], Callable[[], object]]) -> float:
    async def main() -> float:
        cm = make()

        async def worker() -> None:
            for _ in range(N_ASYNC // N_TASKS):
                async with cm():  # type: ignore[attr-defined]
                    await asyncio.sleep(0)

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(N_TASKS)))
        return (time.perf_counter() - t) / N_ASYNC * 1e6

    return asyncio.run(main())


def row_tasks_keyed() -> float:
    import ratequeue as rq

    def make() -> Callable[[], object]:
        kc = rq.KeyedConcurrency(1)
        return lambda: kc.acquire_async("k")

    return _tasks(make)


def row_tasks_floor() -> float:
    def make() -> Callable[[], object]:
        s = asyncio.Semaphore(1)
        return lambda: s

    return _tasks(make)


ROWS: dict[str, tuple[str, Callable[[], float], bool]] = {
    "noop": ("floor: a no-op method of the extension", row_noop, True),
    "acquire": ("KeyedLimiter.acquire(key), admitted at once", row_acquire_fast, True),
    "acquire_async": (
        "await KeyedLimiter.acquire_async(key), admitted at once",
        row_acquire_async_fast,
        True,
    ),
    "threads_floor": (
        "floor/peer: threading.Semaphore(1), 2 threads taking turns",
        row_threads_floor,
        False,
    ),
    "threads": (
        "KeyedConcurrency(1).acquire(key), 2 threads taking turns",
        row_threads_keyed,
        True,
    ),
    "tasks_floor": ("floor/peer: asyncio.Semaphore(1), 100 tasks", row_tasks_floor, False),
    "tasks": ("KeyedConcurrency(1).acquire_async(key), 100 tasks", row_tasks_keyed, True),
}


def _run(row: str, path: str | None) -> float:
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, __file__, "--worker", row],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1])["us"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", help="directory holding the baseline ratequeue package")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps({"us": ROWS[a.worker][1]()}))
        return 0
    here = str(Path(__file__).resolve().parent.parent / "python")
    builds = {"after": here} | ({"before": a.before} if a.before else {})
    got: dict[tuple[str, str], list[float]] = {}
    t0 = time.monotonic()
    load = os.getloadavg()[0]
    for r in range(a.rounds):
        order = list(builds.items()) if r % 2 == 0 else list(reversed(builds.items()))
        for row, (_, _, both) in ROWS.items():
            for name, path in order if both else order[:1]:
                key = (row, name if both else "-")
                got.setdefault(key, []).append(_run(row, path))
    lines = [
        "# Keyed waiting: before/after the per-key queue map moved into the core",
        "",
        f"Generated by `benches/bench_keyed_wait.py` on {dt.date.today()} ({a.rounds} rounds,"
        f" median; {time.monotonic() - t0:.0f} s in all; load average {load:.2f} at the start).",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs;"
        f" Python {platform.python_version()}.",
        "",
        "| operation | before µs | after µs | after / before |",
        "| --- | ---: | ---: | ---: |",
    ]
    for row, (label, _, both) in ROWS.items():
        if both:
            after = statistics.median(got[(row, "after")])
            before = statistics.median(got[(row, "before")]) if a.before else float("nan")
            lines.append(f"| {label} | {before:.3f} | {after:.3f} | {after / before:.2f} |")
        else:
            v = statistics.median(got[(row, "-")])
            lines.append(f"| {label} | {v:.3f} | {v:.3f} | (same run) |")
    text = "\n".join(lines) + "\n"
    print(text)
    a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
