"""Added latency of ASGI rate limiting: ratequeue.asgi beside slowapi, fastapi-limiter and
asgi-ratelimit on the same trivial FastAPI app and the same load, in one run.

Every candidate wraps the same app (``GET /`` answering ``ok``) and is configured to admit
every request, keyed by client address, so the table compares the price of limiting, not
refusals. The floor is the bare app. Two measures, interleaved by rounds (A B C ... A B C
...) so a shared machine's drifts hit every candidate alike:

- **open loop**: requests arrive at a fixed rate (``--rate``/s, each started at its
  scheduled time whatever the answers; the driver yields to the loop until each arrival
  time rather than trusting a timer's millisecond), called in process through the ASGI interface (no
  network, so the limiter's cost is not hidden by the socket's); latency is scheduled
  arrival to the response's last byte, p50 and p99 over every round, and the added
  latency is the difference to the bare app's;
- **CPU**: sequential requests timed by the thread's CPU clock (other processes on a
  shared machine delay them but do not inflate that), the median over rounds, and the
  median over rounds of the difference to the bare app.

fastapi-limiter 0.2 decides through pyrate-limiter: timed with its Redis bucket (a
redis-server started here on loopback, as its documentation deploys it) and with its
in-memory bucket.

Usage::

    .venv/bin/python benches/bench_asgi.py [--rounds 6] [--per-round 400] [--rate 400]
        [--out benches/results/asgi.md]  (the default)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import importlib.metadata
import os
import platform
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import ratequeue as rq
from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse
from ratequeue.asgi import RateLimitMiddleware, client_ip, header

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
BIG = 10**6  # per second: every request is admitted


def fastapi_app(dependencies: list[Any] | None = None) -> FastAPI:
    app = FastAPI()

    @app.get("/", response_class=PlainTextResponse, dependencies=dependencies or [])
    async def root() -> str:
        return "ok"

    return app


def bare() -> App:
    return fastapi_app()


def ratequeue_one() -> App:
    users = rq.KeyedLimiter(rq.Rate(BIG, per="second"))
    return RateLimitMiddleware(fastapi_app(), levels={"ip": users}, keys={"ip": client_ip()})


def ratequeue_three() -> App:
    return RateLimitMiddleware(
        fastapi_app(),
        levels={
            "user": rq.KeyedLimiter(rq.Rate(BIG, per="second")),
            "tenant": rq.KeyedConcurrency(BIG),
            "cluster": rq.Limiter(rq.Rate(BIG, per="second")),
        },
        keys={"user": client_ip(), "tenant": header("x-tenant")},
        partition_keys=True,
    )


def slowapi_app() -> App:
    from slowapi import Limiter, _rate_limit_exceeded_handler
    from slowapi.errors import RateLimitExceeded
    from slowapi.util import get_remote_address

    limiter = Limiter(key_func=get_remote_address)
    app = FastAPI()
    app.state.limiter = limiter
    app.add_exception_handler(RateLimitExceeded, _rate_limit_exceeded_handler)  # type: ignore[arg-type]

    @app.get("/", response_class=PlainTextResponse)
    @limiter.limit(f"{BIG}/second")
    async def root(request: Request) -> str:
        return "ok"

    return app


def fastapi_limiter_app(redis_url: str | None) -> App:
    from fastapi_limiter.depends import RateLimiter
    from pyrate_limiter import Duration, Limiter, Rate, RedisBucket

    rates = [Rate(BIG, Duration.SECOND)]
    if redis_url is None:
        limiter = Limiter(rates)
    else:
        from redis.asyncio import Redis

        async def make() -> Any:
            bucket = await RedisBucket.init(rates, Redis.from_url(redis_url), "bench-asgi")
            return Limiter(bucket)  # its leak task needs the running loop

        limiter = asyncio.get_event_loop().run_until_complete(make())
    return fastapi_app([Depends(RateLimiter(limiter=limiter))])


def asgi_ratelimit_app() -> App:
    from ratelimit import RateLimitMiddleware as ARL
    from ratelimit import Rule
    from ratelimit.backends.simple import MemoryBackend

    async def by_ip(scope: Any) -> tuple[str, str]:
        return scope["client"][0], "default"

    return ARL(  # type: ignore[no-any-return]
        fastapi_app(),
        authenticate=by_ip,
        backend=MemoryBackend(),
        config={r"^/": [Rule(second=BIG)]},
    )


SCOPE: dict[str, Any] = {
    "type": "http",
    "asgi": {"version": "3.0"},
    "http_version": "1.1",
    "method": "GET",
    "scheme": "http",
    "path": "/",
    "raw_path": b"/",
    "root_path": "",
    "query_string": b"",
    "headers": [(b"host", b"bench"), (b"x-tenant", b"acme")],
    "client": ("203.0.113.7", 50000),
    "server": ("bench", 80),
}


async def request(app: App) -> None:
    got = False

    async def receive() -> dict[str, Any]:
        nonlocal got
        if not got:
            got = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    status = 0

    async def send(m: dict[str, Any]) -> None:
        nonlocal status
        if m["type"] == "http.response.start":
            status = m["status"]

    await app(dict(SCOPE), receive, send)
    if status != 200:
        raise RuntimeError(f"status {status}: a candidate refused")


async def open_loop(app: App, rate: float, n: int, out: list[float]) -> None:
    loop = asyncio.get_running_loop()
    tasks = []

    async def one(at: float) -> None:
        await request(app)
        out.append(loop.time() - at)

    t0 = loop.time() + 0.005
    for i in range(n):
        at = t0 + i / rate
        while (delay := at - loop.time()) > 0:
            # A timer wakes up to a millisecond late: sleep most of the way, then yield
            # (letting requests in flight run) until the arrival time, to a few µs.
            await asyncio.sleep(delay - 0.0015 if delay > 0.002 else 0)
        tasks.append(asyncio.ensure_future(one(at)))
    await asyncio.gather(*tasks)


async def closed_loop(app: App, n: int) -> float:
    """CPU seconds per request of ``n`` sequential requests (this thread's CPU time:
    other processes on a shared machine delay it, but do not inflate it)."""
    t = time.thread_time()
    for _ in range(n):
        await request(app)
    return (time.thread_time() - t) / n


def start_redis() -> tuple[subprocess.Popen[bytes], str, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is needed for fastapi-limiter's Redis bucket")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.mkdtemp()
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
            tmp,
        ],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0", tmp


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s)) - 1))]


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--per-round", type=int, default=400)
    ap.add_argument("--rate", type=float, default=400.0)
    ap.add_argument("--closed", type=int, default=400)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "asgi.md"))
    args = ap.parse_args()
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    redis_proc, redis_url, tmp = start_redis()
    try:
        candidates: list[tuple[str, App]] = [
            ("floor: bare FastAPI app", bare()),
            ("ratequeue.asgi, 1 keyed level", ratequeue_one()),
            ("ratequeue.asgi, 3 levels + pk", ratequeue_three()),
            ("slowapi (limits, memory)", slowapi_app()),
            ("fastapi-limiter (pyrate, Redis)", fastapi_limiter_app(redis_url)),
            ("fastapi-limiter (pyrate, memory)", fastapi_limiter_app(None)),
            ("asgi-ratelimit (memory)", asgi_ratelimit_app()),
        ]
        # Per round and candidate: the open-loop latencies, and the closed-loop time.
        lat: dict[str, list[list[float]]] = {name: [] for name, _ in candidates}
        per_req: dict[str, list[float]] = {name: [] for name, _ in candidates}
        for _, app in candidates:  # warm-up
            loop.run_until_complete(closed_loop(app, 50))
        cpu0 = time.process_time()
        wall0 = time.perf_counter()
        for _ in range(args.rounds):
            for name, app in candidates:
                gc.collect()
                lat[name].append([])
                loop.run_until_complete(open_loop(app, args.rate, args.per_round, lat[name][-1]))
                per_req[name].append(loop.run_until_complete(closed_loop(app, args.closed)))
        wall = time.perf_counter() - wall0
        cpu = time.process_time() - cpu0
    finally:
        redis_proc.terminate()
        redis_proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    floor = candidates[0][0]

    def added(name: str, stat: Callable[[list[float]], float]) -> float:
        """The median over rounds of the difference to the floor in the same round."""
        return statistics.median(
            stat(a) - stat(b) for a, b in zip(lat[name], lat[floor], strict=True)
        )

    rows = []
    for name, _ in candidates:
        pooled = [x for r in lat[name] for x in r]
        p50, p99 = pct(pooled, 50), pct(pooled, 99)
        a50 = added(name, lambda xs: pct(xs, 50))
        a99 = added(name, lambda xs: pct(xs, 99))
        cl = statistics.median(per_req[name])
        cl_add = statistics.median(
            a - b for a, b in zip(per_req[name], per_req[floor], strict=True)
        )
        rows.append(
            f"| {name} | {p50 * 1e6:,.0f} | {p99 * 1e6:,.0f} | {a50 * 1e6:+,.0f} | "
            f"{a99 * 1e6:+,.0f} | {cl * 1e6:,.1f} | {cl_add * 1e6:+,.1f} | "
            f"{cl / statistics.median(per_req[floor]):.2f} |"
        )
    load = os.getloadavg()
    text = "\n".join(
        [
            "# ASGI rate limiting: added latency (`benches/bench_asgi.py`)",
            "",
            f"Run {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.machine()}, "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}, load average "
            f"{load[0]:.2f} at the end; {args.rounds} interleaved rounds of {args.per_round} "
            f"open-loop requests at {args.rate:g}/s and {args.closed} sequential requests per "
            f"candidate ({args.rounds * args.per_round} open-loop requests each; this process used "
            f"{cpu / wall:.0%} of one core).",
            "",
            f"Versions: ratequeue {version('ratequeue')}, fastapi {version('fastapi')}, "
            f"starlette {version('starlette')}, slowapi {version('slowapi')}, limits "
            f"{version('limits')}, fastapi-limiter {version('fastapi-limiter')}, pyrate-limiter "
            f"{version('pyrate-limiter')}, asgi-ratelimit {version('asgi-ratelimit')}, redis-py "
            f"{version('redis')}.",
            "",
            "| candidate | open-loop p50 µs | p99 µs | added p50 µs | added p99 µs | "
            "CPU µs/request | added CPU µs/request | CPU vs floor |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "Every candidate admits every request (limits of 10^6/s) keyed by client address; "
            "ratequeue's rows also build the RateLimit-Policy and RateLimit fields and the "
            "Server-Timing header on every response (its 3-level row: a keyed bucket, a keyed "
            "concurrency limit and a cluster bucket as one Policy, with partition keys). "
            "Requests are called in process through ASGI (no socket), so the rows differ only "
            "by the limiting layer. Open-loop p50/p99 are over every request of a candidate; "
            "the added columns are the median over rounds of the difference to the bare app "
            "measured in the same round (p99 over 400 requests is mostly the machine's noise "
            "on a shared 2-core VM). CPU: sequential requests timed by this thread's CPU "
            "clock (what the limiting layer costs the server, whatever else runs), the "
            "median over rounds, and the median of the per-round differences.",
        ]
    )
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
