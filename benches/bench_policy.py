"""Policy calls: what joining the levels' queues costs (issue 10), beside the floor.

One process, interleaved rounds (A B C ... A B C ...) of fixed batches; each row shows the
median and the best round in ns per call. Every level is on a ``ManualClock`` with rates
high enough that every call is admitted, so no row sleeps::

    .venv/bin/python benches/bench_policy.py [--rounds 21] [--batch 20000] [--out PATH]

Rows:

* floor: a Python function called with the same keywords (what any call costs);
* ``Limiter.try_acquire()``: one level alone, for scale;
* ``Policy.try_acquire(**kw)``: a keyed rate level and a two-rate limiter, then release;
* ``Policy.acquire(**kw)``: the same levels, idle (the core lifecycle, nothing queued);
* ``Policy.acquire()`` behind a waiter: the limiter level has one request queued, so the
  policy's share joins its queue (then ``cancel()`` takes it out again);
* ``await Policy.acquire_async(**kw)`` idle, against the floor of awaiting a coroutine
  that returns at once (both inside one running coroutine).

Run it with another build's interpreter (``--label``) to compare builds side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ratequeue as rq
from ratequeue._ratequeue import Channel

HERE = Path(__file__).resolve().parent


def _noop(**kw: Any) -> None:
    return None


def _setup() -> dict[str, Any]:
    clock = rq.ManualClock()
    user = rq.KeyedLimiter(rq.Rate(10**9, burst=10**9), clock=clock)
    cluster = rq.Limiter(
        rq.Rate(10**9, burst=10**9),
        rq.Rate(10**9, burst=10**9, unit="tokens"),
        clock=clock,
    )
    policy = rq.Policy({"user": user, "cluster": cluster})
    alone = rq.Limiter(rq.Rate(10**9, burst=10**9), clock=clock)
    # A level with one request always queued: a policy acquire joins its queue.
    slow = rq.Limiter(rq.Rate(1, burst=1), clock=clock)
    assert slow.try_acquire()
    ch = Channel()
    assert isinstance(slow.submit(ch), int)
    behind = rq.Policy({"slow": slow})
    return {"policy": policy, "alone": alone, "behind": behind}


def _sync_rows(s: dict[str, Any]) -> dict[str, Callable[[int], None]]:
    policy, alone, behind = s["policy"], s["alone"], s["behind"]
    kw = {"user": "alice", "tokens": 100}

    def floor(n: int) -> None:
        for _ in range(n):
            _noop(**kw)

    def lim_try(n: int) -> None:
        for _ in range(n):
            alone.try_acquire()

    def pol_try(n: int) -> None:
        for _ in range(n):
            policy.try_acquire(**kw).release()

    def pol_acquire(n: int) -> None:
        for _ in range(n):
            policy.acquire(**kw).release()

    def pol_behind(n: int) -> None:
        for _ in range(n):
            behind.acquire().cancel()

    return {
        "floor: f(**kw), a Python function": floor,
        "Limiter.try_acquire()": lim_try,
        "Policy.try_acquire(**kw).release()": pol_try,
        "Policy.acquire(**kw).release(), idle": pol_acquire,
        "Policy.acquire().cancel() behind a waiter": pol_behind,
    }


def _async_rows(s: dict[str, Any]) -> dict[str, Callable[[int], None]]:
    policy = s["policy"]
    kw = {"user": "alice", "tokens": 100}

    async def done() -> None:
        return None

    async def floor(n: int) -> None:
        for _ in range(n):
            await done()

    async def pol(n: int) -> None:
        for _ in range(n):
            (await policy.acquire_async(**kw)).release()

    def runner(coro: Callable[[int], Any]) -> Callable[[int], None]:
        return lambda n: asyncio.run(coro(n))

    return {
        "floor: await a coroutine that returns": runner(floor),
        "await Policy.acquire_async(**kw), idle": runner(pol),
    }


def _measure(
    rows: dict[str, Callable[[int], None]], rounds: int, batch: int
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in rows}
    for f in rows.values():
        f(batch // 10)  # warm up
    for _ in range(rounds):
        for name, f in rows.items():
            t0 = time.perf_counter_ns()
            f(batch)
            out[name].append((time.perf_counter_ns() - t0) / batch)
    return out


def _table(res: dict[str, list[float]], floor: str) -> list[str]:
    base = statistics.median(res[floor])
    lines = [
        "| call | median ns/call | best ns/call | median / floor |",
        "|---|---:|---:|---:|",
    ]
    for name, xs in res.items():
        med = statistics.median(xs)
        lines.append(f"| {name} | {med:,.0f} | {min(xs):,.0f} | {med / base:.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--batch", type=int, default=20_000)
    ap.add_argument("--label", default="this build")
    ap.add_argument("--out", type=Path, help="also write the tables (markdown) here")
    a = ap.parse_args(argv)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    s = _setup()
    sync = _measure(_sync_rows(s), a.rounds, a.batch)
    asy = _measure(_async_rows(s), max(5, a.rounds // 2), a.batch // 4)
    head = [
        f"## Policy calls: {a.label}",
        "",
        f"{platform.python_implementation()} {platform.python_version()},"
        f" {platform.machine()}, {os.cpu_count()} CPUs, load average {load:.2f} at the start;"
        f" {a.rounds} interleaved rounds of {a.batch:,} calls (async: of {a.batch // 4:,}).",
        "",
    ]
    text = "\n".join(
        [
            *head,
            *_table(sync, "floor: f(**kw), a Python function"),
            "",
            *_table(asy, "floor: await a coroutine that returns"),
            "",
        ]
    )
    print(text)
    if a.out:
        with a.out.open("a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
