"""Four processes (spawn) share one Redis limit for a while: together they admit at
most burst + rate * elapsed (plus N * L with leases), and they all make progress (how
close they come to the rate is speed: benches/bench_redis.py measures it)."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest
from redis_server import RedisServer

PROCS = 4
RATE, BURST, DURATION = 2000, 200, 1.5


def worker(url: str, name: str, lease: float | None, barrier: Any, out: Any) -> None:
    import ratequeue as rq
    from ratequeue.redis import GCRA_LUA, RedisLimiter, connect

    client = connect(url, timeout=1.0)
    client.script_load(GCRA_LUA)
    lim = RedisLimiter(client, rq.Rate(RATE, per=1, burst=BURST), name=name, lease=lease)
    barrier.wait(30)
    start = time.time()
    end = start + DURATION
    admitted = 0
    calls = 0
    while time.time() < end:
        calls += 1
        if lim.try_acquire():
            admitted += 1
        else:
            time.sleep(0.0005)
    lim.close()
    out.put((admitted, start, time.time(), lim.stats()["redis_calls"], calls))


def run(url: str, name: str, lease: float | None) -> tuple[int, float, list[Any]]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(PROCS)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(url, name, lease, barrier, out)) for _ in range(PROCS)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(10)
        if p.is_alive():  # pragma: no cover - bounded, never expected
            p.terminate()
    total = sum(r[0] for r in results)
    span = max(r[2] for r in results) - min(r[1] for r in results)
    return total, span, results


@pytest.mark.parametrize("lease", [None, 0.1], ids=["direct", "lease"])
def test_processes_share_one_limit(redis_server: RedisServer, lease: float | None) -> None:
    name = f"procs-{'lease' if lease else 'direct'}-{time.monotonic_ns()}"
    total, span, results = run(redis_server.url, name, lease)
    lease_bound = PROCS * max(1, int(BURST * lease)) if lease else 0
    bound = BURST + RATE * span + lease_bound
    assert total <= bound, (total, bound, results)
    assert total >= BURST and all(r[0] > 0 for r in results), (total, results)
    if lease:
        # Most decisions are local: far fewer round trips than decisions.
        round_trips = sum(r[3] for r in results)
        decisions = sum(r[4] for r in results)
        assert round_trips < decisions / 4, results
