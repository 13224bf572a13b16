"""Issue 12's Python tidy-up, before and after, side by side in one run.

1. ``Pool.acquire_async`` before and after it returned a ``PoolAcquiring``. "Before" is
``python/ratequeue/pool.py`` of a git revision (default: 8b1efa6, where
``acquire_async`` was an ``async def``), loaded from git into this process as a module of
the installed package; "after" is the installed ``ratequeue.pool``. Both route over the
same kind of pool (two providers, rates far above the load: every call is granted at
once). Floors in the same run: an empty coroutine awaited (what asyncio itself costs) and
``await limiter.acquire_async()`` on one provider's limiter (what the pool wraps).
Interleaved rounds (A B C ... A B C ...); the table gives the median µs per call.

2. A Redis limiter's reading of a call's costs (``tokens=5``): the Python
``_parse_costs`` of ``python/ratequeue/redis/_args.py`` at REV against the bindings'
parser it now uses (``_LimiterKeywords.parse``), with building the list by hand as the
floor. No Redis is involved: this is the client-side part of every call.

Usage::

    .venv/bin/python benches/bench_tidy.py [--rev REV] [--rounds 31] [--batch 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.util
import platform
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Awaitable, Callable
from pathlib import Path

import ratequeue as rq
from ratequeue import pool as after

ROOT = Path(__file__).resolve().parent.parent


def load_before(rev: str, path: str = "pool.py", package: str = "ratequeue") -> types.ModuleType:
    """``python/<package>/<path>`` of ``rev`` as a module of the installed ``package``
    (its relative imports resolve against it)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:python/{package.replace('.', '/')}/{path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    name = f"{package}._before_{path.removesuffix('.py')}"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__package__ = package
    sys.modules[name] = module
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
    return module


def pool_from(module: types.ModuleType) -> rq.Pool:
    providers = [
        module.Provider(n, rpm=6e9, burst=10**9, tpm=6e10, token_burst=10**10) for n in "ab"
    ]
    return module.Pool(providers, max_wait=5.0)  # type: ignore[no-any-return]


async def _noop() -> None:
    return None


async def timed(call: Callable[[], Awaitable[object]], batch: int) -> float:
    t0 = time.perf_counter()
    for _ in range(batch):
        await call()
    return (time.perf_counter() - t0) / batch * 1e6


async def timed_with(pool: rq.Pool, batch: int) -> float:
    t0 = time.perf_counter()
    for _ in range(batch):
        async with pool.acquire_async(tokens=100):
            pass
    return (time.perf_counter() - t0) / batch * 1e6


async def run(rev: str, rounds: int, batch: int) -> list[tuple[str, float]]:
    before = load_before(rev)
    old, new = pool_from(before), pool_from(after)
    lim = new["a"].limiter
    cases: dict[str, Callable[[], Awaitable[float]]] = {
        "empty coroutine awaited (asyncio floor)": lambda: timed(_noop, batch),
        "`await limiter.acquire_async(tokens=100)` (floor)": lambda: timed(
            lambda: lim.acquire_async(tokens=100), batch
        ),
        f"`await pool.acquire_async(tokens=100)`, before ({rev})": lambda: timed(
            lambda: old.acquire_async(tokens=100), batch
        ),
        "`await pool.acquire_async(tokens=100)`, after": lambda: timed(
            lambda: new.acquire_async(tokens=100), batch
        ),
        "`async with pool.acquire_async(tokens=100)`, after": lambda: timed_with(new, batch),
    }
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for case in cases.values():  # warm-up
        await case()
    for _ in range(rounds):
        for k, case in cases.items():
            samples[k].append(await case())
    return [(k, statistics.median(v)) for k, v in samples.items()]


def costs_rows(rev: str, rounds: int, batch: int) -> list[tuple[str, float]]:
    from ratequeue._ratequeue import _LimiterKeywords

    before = load_before(rev, "_args.py", "ratequeue.redis")
    units, kw = ["requests", "tokens"], {"tokens": 5}
    parser = _LimiterKeywords(units)
    cases: dict[str, Callable[[], object]] = {
        "`[1, kw['tokens']]` by hand (floor)": lambda: [1, kw["tokens"]],
        f"Python `_parse_costs` (before, {rev})": lambda: before._parse_costs(units, None, kw),
        "bindings `_LimiterKeywords.parse` (after)": lambda: parser.parse(None, kw),
    }
    assert len({repr(case()) for case in cases.values()}) == 1
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for k, case in cases.items():
            t0 = time.perf_counter()
            for _ in range(batch):
                case()
            samples[k].append((time.perf_counter() - t0) / batch * 1e6)
    return [(k, statistics.median(v)) for k, v in samples.items()]


def table(rows: list[tuple[str, float]], base_key: str) -> None:
    base = dict(rows)[base_key]
    print("| case | µs/call | ratio |")
    print("|---|---:|---:|")
    for k, us in rows:
        print(f"| {k} | {us:.3f} | {us / base:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="8b1efa6")
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--batch", type=int, default=2000)
    args = ap.parse_args()
    rows = asyncio.run(run(args.rev, args.rounds, args.batch))
    print(f"# Issue 12's Python tidy-up: before ({args.rev}) and after\n")
    print(
        f"{dt.date.today()}, Python {platform.python_version()}, {platform.machine()}; "
        f"{args.rounds} interleaved rounds of {args.batch} calls; median µs per call; "
        "ratio to before. `.venv/bin/python benches/bench_tidy.py`\n"
    )
    print("## `Pool.acquire_async` returns a `PoolAcquiring`\n")
    table(rows, f"`await pool.acquire_async(tokens=100)`, before ({args.rev})")
    print("\n## A Redis limiter's costs read by the bindings\n")
    costs = costs_rows(args.rev, args.rounds, args.batch * 10)
    table(costs, f"Python `_parse_costs` (before, {args.rev})")


if __name__ == "__main__":
    main()
