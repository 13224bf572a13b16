"""ratequeue.redis before and after it became a package, side by side in one run.

"Before" is the single module ``python/ratequeue/redis.py`` of a git revision (default:
the last one that has it), loaded from git into this process beside the installed
package ("after"); both talk to one redis-server that the script starts (loopback, a
free port, no persistence). Interleaved rounds (A B C ... A B C ...): each round times
one batch of every candidate, so a shared machine's drifts hit both alike; the table
gives the median time per call over rounds and the after/before ratio, beside the floor
(a bare ``INCRBY`` round trip on the same client).

Also timed: loading the script after ``SCRIPT FLUSH`` (the NOSCRIPT path: one failed
EVALSHA, SCRIPT LOAD, the call again) and importing the module in a fresh interpreter.

Usage::

    .venv/bin/python benches/bench_redis_pkg.py [--rev REV] [--rounds 15] [--batch 300]
    # benches/bench_redis.py with the module of REV as ratequeue.redis (its arguments after --):
    .venv/bin/python benches/bench_redis_pkg.py --bench-redis-before [--rev REV] -- --rounds 21
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import ratequeue as rq
import ratequeue.redis as after
import redis
from _pairs import redis_server

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results" / "redis_pkg.md"
HUGE = 10**6


def load_before(rev: str) -> types.ModuleType:
    """The single-module ratequeue.redis of ``rev``, as ``ratequeue._redis_before``."""
    src = subprocess.run(
        ["git", "show", f"{rev}:python/ratequeue/redis.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    name = "ratequeue._redis_before"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "ratequeue"
    sys.modules[name] = mod
    exec(compile(src, f"{rev}:python/ratequeue/redis.py", "exec"), mod.__dict__)
    return mod


def calls(mod: types.ModuleType, client: redis.Redis, tag: str) -> dict[str, Callable[[], object]]:
    """The operations timed, built on one version of the module."""
    rate = rq.Rate(HUGE, per=1)
    lim = mod.RedisLimiter(client, rate, rq.Rate(HUGE, per=1, unit="tokens"), name=f"l{tag}")
    one = mod.RedisLimiter(client, rate, name=f"one{tag}")
    keyed = mod.RedisKeyedLimiter(client, rate, name=f"k{tag}")
    levels = {
        "user": rq.KeyedLimiter(rate),
        "tenant": rq.KeyedLimiter(rate),
        "cluster": rq.Limiter(rate, rq.Rate(HUGE, per=1, unit="tokens")),
    }
    policy = mod.RedisPolicy(client, levels, name=f"p{tag}")
    plain = mod.RedisPolicy(
        client, {k: v for k, v in levels.items() if k != "cluster"}, name=f"q{tag}"
    )

    # An empty bucket on a clock that never moves: every reservation is ahead of now.
    ahead = mod.RedisLimiter(
        client, rq.Rate(1, per=1, burst=1), name=f"ahead{tag}", clock=rq.ManualClock()
    )
    ahead.try_acquire()

    def reserve_cancel() -> object:
        return one.reserve().cancel()

    def reserve_ahead_cancel() -> object:
        return ahead.reserve().cancel()

    def acquire_settle() -> object:
        p = lim.acquire(tokens=10)
        p.settle(tokens=5)
        return p

    def load() -> object:
        client.script_flush()
        return one.try_acquire()

    return {
        "RedisLimiter.try_acquire()": one.try_acquire,
        "RedisLimiter.try_acquire(tokens=5)": lambda: lim.try_acquire(tokens=5),
        "RedisKeyedLimiter.try_acquire(key)": lambda: keyed.try_acquire("alice"),
        "RedisPolicy.try_acquire (2 keyed levels, packed path)": lambda: plain.try_acquire(
            user="alice", tenant="acme"
        ),
        "RedisPolicy.try_acquire (3 levels, tokens=5: keyword parsing)": lambda: policy.try_acquire(
            user="alice", tenant="acme", tokens=5
        ),
        "RedisLimiter.reserve() + cancel(), granted at once (before: no 2nd trip)": (
            reserve_cancel
        ),
        "RedisLimiter.reserve() + cancel() of a reservation ahead (2 round trips)": (
            reserve_ahead_cancel
        ),
        "RedisLimiter.acquire(tokens=10) + settle(tokens=5) (2 round trips)": acquire_settle,
        "script load after SCRIPT FLUSH (NOSCRIPT, SCRIPT LOAD, again)": load,
    }


def import_seconds(code: str, runs: int) -> float:
    """Median wall time of a fresh interpreter running ``code`` (import included)."""
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def bench_redis_before(rev: str, args: list[str]) -> int:
    """Runs benches/bench_redis.py with the module of ``rev`` as ``ratequeue.redis``."""
    import runpy

    mod = load_before(rev)
    sys.modules["ratequeue.redis"] = mod
    rq.redis = mod  # type: ignore[attr-defined]
    sys.argv = ["bench_redis.py", *args]
    runpy.run_path(str(ROOT / "benches" / "bench_redis.py"), run_name="__main__")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="524cb3a")
    ap.add_argument("--bench-redis-before", action="store_true")
    ap.add_argument("rest", nargs="*", help="arguments of bench_redis.py (after --)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch", type=int, default=300)
    ap.add_argument("--imports", type=int, default=9)
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    if a.bench_redis_before:
        return bench_redis_before(a.rev, a.rest)
    before = load_before(a.rev)
    with redis_server() as url:
        client = after.connect(url, timeout=5.0)
        client.flushdb()
        old, new = calls(before, client, "b"), calls(after, client, "a")
        floor: dict[str, Callable[[], object]] = {
            "INCRBY round trip (floor)": lambda: client.incrby("bench:incr", 1)
        }
        rows: dict[tuple[str, str], list[float]] = {}
        plan = [("floor", n, f) for n, f in floor.items()]
        for n in old:
            plan += [("before", n, old[n]), ("after", n, new[n])]
        for _, _, f in plan:  # warm up: scripts loaded, connections open
            for _ in range(20):
                f()
        for _ in range(a.rounds):
            for side, n, f in plan:
                batch = a.batch if not n.startswith("script load") else max(10, a.batch // 10)
                t0 = time.perf_counter_ns()
                for _ in range(batch):
                    f()
                rows.setdefault((side, n), []).append((time.perf_counter_ns() - t0) / batch / 1e3)
        server = client.info("server")["redis_version"]
        client.close()
    imp_old = import_seconds(
        "import importlib.util, subprocess, sys;"
        f"src = subprocess.run(['git', 'show', '{a.rev}:python/ratequeue/redis.py'],"
        " capture_output=True, text=True).stdout;"
        "import ratequeue, types; m = types.ModuleType('ratequeue._redis_before');"
        "m.__package__ = 'ratequeue'; sys.modules[m.__name__] = m;"
        "exec(compile(src, 'r', 'exec'), m.__dict__)",
        a.imports,
    )
    imp_git = import_seconds(
        f"import subprocess; subprocess.run(['git', 'show', '{a.rev}:python/ratequeue/redis.py'],"
        " capture_output=True); import ratequeue",
        a.imports,
    )
    imp_new = import_seconds("import ratequeue.redis", a.imports)
    imp_base = import_seconds("import ratequeue", a.imports)
    med = {k: statistics.median(v) for k, v in rows.items()}
    fl = med[("floor", "INCRBY round trip (floor)")]
    lines = [
        "| operation | before (module) us | after (package) us | after / before | after / INCRBY |",
        "|---|---:|---:|---:|---:|",
        f"| INCRBY round trip (floor) | {fl:.1f} | {fl:.1f} | 1.00 | 1.00 |",
    ]
    for n in old:
        b, x = med[("before", n)], med[("after", n)]
        lines.append(f"| {n} | {b:.1f} | {x:.1f} | {x / b:.2f} | {x / fl:.2f} |")
    lines.append(
        f"| import (fresh interpreter, less `import ratequeue` = {imp_base * 1e3:.0f} ms) "
        f"| {(imp_old - imp_git) * 1e3:.1f} ms | {(imp_new - imp_base) * 1e3:.1f} ms | | |"
    )
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = f"""# ratequeue.redis: one module (before) vs the package (after)

Measured by `benches/bench_redis_pkg.py` on {when}: {platform.python_implementation()}
{platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs (a shared machine:
read the ratios), redis-server {server} on loopback, redis-py {redis.__version__}.
"Before" is `python/ratequeue/redis.py` at `{a.rev}` loaded into the same process as the
installed package ("after"); {a.rounds} interleaved rounds of {a.batch} calls per
candidate (script loads: {max(10, a.batch // 10)}), median time per call (the Python loop
included). Every limiter admits every call (rates of {HUGE}/s).

{chr(10).join(lines)}

Notes: the package loads its Lua from `gcra.lua` once at import (importlib.resources);
the hot paths send the same packed `EVALSHA` as before. The policy's keyword parsing
now runs in the bindings (`_PolicyKeywords`) instead of Python. Reservations and
permits now carry each bucket's generation key (one more key and `GET` per bucket in
the script) so that cancel and settle follow the one undo rule; a reservation granted at
once is now given back by `cancel` (before, the client refused without asking Redis:
one round trip instead of two). On a plain sync client every command, not only the hot
ones, is now sent packed by ratequeue on a pooled connection. The import row is the
wall time of a fresh interpreter less that of `import ratequeue` (before: less the
`git show` that fetches the old source too).
"""
    a.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
