"""Redis decisions: ratequeue.redis beside a bare INCRBY round trip and the Redis limiters
of limits and throttled-py, in one run.

The script starts its own redis-server (loopback, a free port, no persistence) and
stops it at the end. Every candidate is configured so that it admits every call, so the
table compares the price of a *decision*. One process, interleaved rounds
(A B C ... A B C ...): each round times one batch of every candidate, so the drifts of a
shared machine hit every candidate alike; we report the median over rounds of the time
per call, and its ratio to the INCRBY round trip on the *same* client connection
(``client.incrby(key, 1)``), which is the floor of any one-round-trip decision made
through redis-py.

Lease mode is timed apart: one process admitting from its lease (local Rust bucket)
as fast as it can; its figure is local decisions per second, round trips included.

Usage::

    .venv/bin/python benches/bench_redis.py [--rounds 15] [--batch 400] [--out PATH]

Targets (checked and printed): single-key decision <= 1.2 x INCRBY; a three-level policy
in one round trip <= 1.3 x INCRBY; lease mode >= 1,000,000 decisions/s.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib.metadata
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ratequeue as rq
import redis
from _pairs import redis_server
from ratequeue.redis import RedisKeyedLimiter, RedisLimiter, RedisPolicy, connect

RESULTS = Path(__file__).resolve().parent / "results" / "redis.md"
HUGE = 10**6  # per second: above what one client can reach, so every call is admitted


@dataclass
class Candidate:
    name: str
    call: Callable[[], object]
    config: str
    kind: str = "peer"  # "floor" | "ratequeue" | "peer"
    admitted: Callable[[object], bool] = bool
    samples: list[float] = field(default_factory=list)
    refused: int = 0

    def batch(self, n: int) -> float:
        call = self.call
        t0 = time.perf_counter_ns()
        for _ in range(n):
            call()
        dt_ns = time.perf_counter_ns() - t0
        if not self.admitted(call()):
            self.refused += 1
        return dt_ns / n / 1000  # us per call


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def candidates(url: str) -> tuple[list[Candidate], list[str]]:
    client = connect(url, timeout=5.0)
    client.flushdb()
    out: list[Candidate] = []
    missing: list[str] = []
    out.append(
        Candidate(
            "INCRBY round trip (floor)",
            lambda: client.incrby("bench:incr", 1),
            "`client.incrby(key, 1)` on the same client",
            kind="floor",
            admitted=lambda r: True,
        )
    )
    pool = client.connection_pool
    packed = [b"*3\r\n$6\r\nINCRBY\r\n$10\r\nbench:incr\r\n$1\r\n1\r\n"]

    def raw_incrby() -> object:
        conn = pool.get_connection()
        try:
            conn.send_packed_command(packed)
            return conn.read_response()
        finally:
            pool.release(conn)

    out.append(
        Candidate(
            "INCRBY packed once, on a pooled connection",
            raw_incrby,
            "the same round trip without redis-py's per-command work (how ratequeue sends)",
            kind="floor",
            admitted=lambda r: True,
        )
    )
    lim = RedisLimiter(client, rq.Rate(HUGE, per=1), name="bench")
    out.append(
        Candidate(
            "ratequeue RedisLimiter.try_acquire",
            lim.try_acquire,
            f"GCRA, 1 key, {HUGE}/s, EVALSHA on the same client",
            kind="ratequeue",
        )
    )
    users = RedisKeyedLimiter(client, rq.Rate(HUGE, per=1), name="users")
    out.append(
        Candidate(
            "ratequeue RedisKeyedLimiter.try_acquire",
            lambda: users.try_acquire("alice"),
            "GCRA per key (key-tagged), same client",
            kind="ratequeue",
        )
    )
    policy = RedisPolicy(
        client,
        {
            "user": rq.KeyedLimiter(rq.Rate(HUGE, per=1)),
            "tenant": rq.KeyedLimiter(rq.Rate(HUGE, per=1)),
            "cluster": rq.Limiter(rq.Rate(HUGE, per=1)),
        },
        name="api",
    )
    out.append(
        Candidate(
            "ratequeue RedisPolicy.try_acquire (3 levels)",
            lambda: policy.try_acquire(user="alice", tenant="acme"),
            "user -> tenant -> cluster, 3 keys, one round trip, all or nothing",
            kind="ratequeue",
            admitted=lambda r: r is not None,
        )
    )
    try:
        from limits import RateLimitItemPerSecond
        from limits.storage import RedisStorage
        from limits.strategies import FixedWindowRateLimiter, MovingWindowRateLimiter

        storage = RedisStorage(url)
        fixed = FixedWindowRateLimiter(storage)
        moving = MovingWindowRateLimiter(storage)
        item = RateLimitItemPerSecond(HUGE)
        out.append(
            Candidate(
                "limits RedisStorage fixed window .hit",
                lambda: fixed.hit(item, "fixed"),
                f"{HUGE}/s; limits' own connection",
            )
        )
        mitem = RateLimitItemPerSecond(100_000)
        out.append(
            Candidate(
                "limits RedisStorage moving window .hit",
                lambda: moving.hit(mitem, "moving"),
                "100000/s (a list of timestamps per key); limits' own connection",
            )
        )
    except ImportError as e:
        missing.append(f"limits[redis]: {e}")
    try:
        from throttled import RateLimiterType, RedisStore, Throttled, rate_limiter

        store = RedisStore(server=url)
        quota = rate_limiter.per_sec(HUGE, burst=HUGE)
        gcra = Throttled(key="t-gcra", using=RateLimiterType.GCRA.value, quota=quota, store=store)
        tb = Throttled(
            key="t-tb", using=RateLimiterType.TOKEN_BUCKET.value, quota=quota, store=store
        )
        out.append(
            Candidate(
                "throttled-py Redis GCRA .limit",
                gcra.limit,
                f"{HUGE}/s burst {HUGE}; throttled's own connection",
                admitted=lambda r: not r.limited,  # type: ignore[attr-defined]
            )
        )
        out.append(
            Candidate(
                "throttled-py Redis token bucket .limit",
                tb.limit,
                f"{HUGE}/s burst {HUGE}; throttled's own connection",
                admitted=lambda r: not r.limited,  # type: ignore[attr-defined]
            )
        )
    except ImportError as e:
        missing.append(f"throttled-py: {e}")
    return out, missing


def lease_rate(url: str, seconds: float) -> tuple[float, int, int]:
    """Local decisions per second in lease mode (round trips included)."""
    client = connect(url, timeout=5.0)
    lim = RedisLimiter(
        client, rq.Rate(10**8, per=1, burst=10**7), name="lease", lease=0.01, lease_ttl=1.0
    )
    try_acquire = lim.try_acquire
    for _ in range(1000):
        try_acquire()
    n = 0
    refused = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end:
        for _ in range(10_000):
            if not try_acquire():
                refused += 1
        n += 10_000
    elapsed = time.perf_counter() - t0
    calls = lim.stats()["redis_calls"]
    lim.close()
    client.close()
    return n / elapsed, calls, refused


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch", type=int, default=400)
    ap.add_argument("--lease-seconds", type=float, default=2.0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    with redis_server() as url:
        cands, missing = candidates(url)
        for c in cands:  # warm up: connections, script loads
            c.batch(50)
        gc.disable()
        try:
            for _ in range(args.rounds):
                for c in cands:
                    c.samples.append(c.batch(args.batch))
        finally:
            gc.enable()
        lease_per_s, lease_calls, _ = lease_rate(url, args.lease_seconds)
        server_version = redis.Redis.from_url(url).info("server")["redis_version"]

    floor = statistics.median(cands[0].samples)
    packed_floor = statistics.median(cands[1].samples)
    rows = [
        "| candidate | median us/decision | min | decisions/s | x INCRBY | x packed INCRBY "
        "| configuration |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    ratios: dict[str, float] = {}
    for c in cands:
        med = statistics.median(c.samples)
        ratios[c.name] = med / floor
        note = c.config + (f"; {c.refused} batches ended refused" if c.refused else "")
        rows.append(
            f"| {c.name} | {med:.1f} | {min(c.samples):.1f} | {1e6 / med:,.0f} | "
            f"{med / floor:.2f} | {med / packed_floor:.2f} | {note} |"
        )
    rows.append(
        f"| ratequeue RedisLimiter lease mode (local) | {1e6 / lease_per_s:.3f} | | "
        f"{lease_per_s:,.0f} | | | 1e8/s, burst 1e7, lease 1 % of the burst; "
        f"{lease_calls} round trips in {args.lease_seconds:g} s |"
    )
    single = ratios["ratequeue RedisLimiter.try_acquire"]
    three = ratios["ratequeue RedisPolicy.try_acquire (3 levels)"]
    checks = [
        f"- single-key decision: {single:.2f} x INCRBY (target <= 1.2): "
        + ("met" if single <= 1.2 else "NOT met"),
        f"- three-level policy, one round trip: {three:.2f} x INCRBY (target <= 1.3): "
        + ("met" if three <= 1.3 else "NOT met"),
        f"- lease mode: {lease_per_s:,.0f} decisions/s in one process (target >= 1,000,000): "
        + ("met" if lease_per_s >= 1e6 else "NOT met"),
    ]
    table = "\n".join(rows)
    print(table)
    print()
    print("\n".join(checks))
    for m in missing:
        print(f"(skipped: {m})")

    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = f"""# Redis decisions: ratequeue.redis vs INCRBY, limits and throttled-py

Measured by `benches/bench_redis.py` on {when}: {platform.python_implementation()}
{platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs (a shared machine:
read the ratios, not the absolute times), redis-server {server_version} on loopback (no
persistence), redis-py {version("redis")}, limits {version("limits")}, throttled-py
{version("throttled-py")}. {args.rounds} interleaved rounds of {args.batch} calls per
candidate; median and min over rounds of the time per call (the Python loop included).

{table}

{chr(10).join(checks)}

Notes: "x INCRBY" divides by the median of a bare `INCRBY` round trip through the same
redis-py client (`client.incrby`), the floor of any decision that takes one round trip
through redis-py's API. ratequeue sends its hot commands packed once, on a connection of
that client's pool (skipping redis-py's per-command packing and retry wrapper), so
"x packed INCRBY" also divides by an `INCRBY` sent the same way: that ratio is what the
script itself costs over the cheapest command (the Lua work, `TIME`, `GET`, `SET ... PX`
per key). limits and throttled-py use connections of their own (same server, same
loopback). Lease mode serves decisions from a local Rust bucket holding a slice of the
Redis bucket, with one round trip per slice; its figure counts every decision, the
round trips included. On a loaded machine every round trip grows alike, so the ratios
shrink; the quietest runs give the largest (most honest) ratios.
"""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
