"""The LLM transport: its added cost per call, and the queue against the SDK's retry loop.

Everything runs in ONE process, one table after the other; the tables are printed and
written to ``benches/results/transport.md``::

    .venv/bin/python benches/bench_transport.py [--calls 300] [--rounds 7] [--burst 40]

1. Added cost per call. Each row sends the same chat-completion POST (a 300-character
   prompt, ``max_tokens``) through an ``httpx2.Client`` and reads the JSON body; rows are
   run in interleaved rounds of ``--calls`` calls and the median round is shown (µs per
   call). The floor is the bare transport; "added" is a row minus its floor. Floors: an
   in-memory ``MockTransport`` (the answer is built in-process: the floor is httpx2
   itself) and ``HTTPTransport`` to the loopback mock provider (a real HTTP round trip,
   keep-alive); each round runs the rows in a new random order. CPU is
   ``time.thread_time()`` of the calling thread (what the call
   costs, robust on a loaded machine); wall is ``time.perf_counter()`` (the loopback
   rows include the mock server's threads and the scheduler). ``RateLimitedTransport``
   rows wrap the same transport over a Limiter of requests and tokens that never makes
   anyone wait: the cost is the estimate (chars/4), the acquire, the header scan, the
   usage read and the settle. Also: with output
   caps and a CallBudget; asyncio; an SSE stream of 20 events.
2. The queue against the SDK's retry loop. ``--burst`` concurrent ``openai`` calls (one
   thread each, ``max_retries=50``) against the mock provider limited to 600 requests per
   minute with a burst of 1 (it answers 429 with ``retry-after-ms`` and ``Retry-After``).
   Rows: the SDK alone (its own retry loop, bare transport); through
   ``RateLimitedTransport`` over a Limiter set a little under the provider (570/min,
   burst 1); through it with a Limiter far too generous (60,000/min, burst 50) and
   ``calibrate=True`` (it learns the limit from the headers and pauses on 429).
   Shown: calls the provider saw per success, 429s, and the p50 / p99 / max latency of a
   call as its caller sees it (queue wait + HTTP + the SDK's sleeps).
1b. ``--paired N``: the same call through each row's floor and through the transport,
   alternating call by call, N of each, CPU and wall of every call kept (medians, the
   mean of the fastest 90 %, p10); caller and mock provider pinned to cores 0 and 1. Rows:
   loopback (sync and asyncio), in memory, and in memory with the caches made cold between
   calls (a 4 MiB buffer written) or after an idle; a pass-through wrapper as a control.
   Rounds of hundreds of calls cannot read a loopback row of ~0.5 ms to a
   few µs; call-by-call pairs can. ``benches/phases_transport.py`` splits the added time
   by phase.
3. ``--instructions`` (needs valgrind): machine instructions per call, which a loaded
   machine does not change. Each row runs in its own process under ``valgrind
   --tool=cachegrind --cache-sim=no`` twice (50 warm-up calls, then 100 or 600 calls):
   instructions per call = the difference / 500, so start-up and imports cancel out.
   Rows: the sync and async floors, the transport over a Limiter of requests and tokens,
   of requests only, with caps + a CallBudget, async; an SSE stream of 20 events (the
   body asking for its usage itself, and without ``stream_options``: the transport asks),
   each over the bare transport with the same body; with ``--baseline`` each also as it
   was at that ref.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import ratequeue as rq
from ratequeue.httpx import CallBudget, Cap, RateLimitedTransport
from ratequeue.httpx._estimate import default_estimator
from ratequeue.testing import MockProvider

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "transport.md"
BODY = {
    "model": "gpt-bench",
    "messages": [{"role": "user", "content": "x" * 300}],
    "max_tokens": 200,
}
ANSWER = {
    "id": "c1",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 80, "completion_tokens": 20, "total_tokens": 100},
}
HEADERS = {
    "x-ratelimit-limit-requests": "10000",
    "x-ratelimit-remaining-requests": "9999",
    "x-ratelimit-reset-requests": "6ms",
    "x-ratelimit-limit-tokens": "2000000",
    "x-ratelimit-remaining-tokens": "1999900",
    "x-ratelimit-reset-tokens": "3ms",
}
SSE = (
    b"".join(b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n' for _ in range(19))
    + b'data: {"choices":[],"usage":{"prompt_tokens":80,"completion_tokens":19}}\n\n'
    + b"data: [DONE]\n\n"
)


def baseline_transport(ref: str) -> Any:
    """``RateLimitedTransport`` as it is at git ``ref`` (loaded beside this one as
    ``ratequeue._httpx_baseline``: before/after in one run, on the same native build)."""
    root = HERE.parent
    where = "python/ratequeue/httpx/"
    names = subprocess.run(
        ["git", "-C", str(root), "ls-tree", "--name-only", ref, where],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    d = Path(tempfile.mkdtemp(prefix="rq-baseline-"))
    for name in names:
        blob = subprocess.run(
            ["git", "-C", str(root), "show", f"{ref}:{name}"], capture_output=True, check=True
        ).stdout
        (d / Path(name).name).write_bytes(blob)
    spec = importlib.util.spec_from_file_location(
        "ratequeue._httpx_baseline", d / "__init__.py", submodule_search_locations=[str(d)]
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.RateLimitedTransport


def roomy() -> rq.Limiter:
    """A limiter that never makes a benchmark call wait."""
    return rq.Limiter(
        rq.Rate(10**9, per="minute", burst=10**6),
        rq.Rate(10**10, per="minute", burst=10**9, unit="tokens"),
    )


def answer(request: httpx2.Request) -> httpx2.Response:
    # json.dumps writes '"stream": true' (until xport6 only the compact form was
    # recognised: the SSE rows were answered with JSON).
    content = request.content
    if b'"stream":true' in content or b'"stream": true' in content:
        return httpx2.Response(
            200, headers={"content-type": "text/event-stream", **HEADERS}, content=SSE
        )
    return httpx2.Response(200, headers=HEADERS, json=ANSWER)


# -- 1. added cost per call -------------------------------------------------------------------


Sample = tuple[float, float]  # (wall, CPU of the calling thread), µs per call


def sync_row(client: httpx2.Client, url: str, body: dict[str, Any], n: int) -> Sample:
    data = json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        r = client.post(url, content=data, headers=headers)
        r.read()
    return (time.perf_counter() - t0) / n * 1e6, (time.thread_time() - c0) / n * 1e6


def budget_row(
    client: httpx2.Client, url: str, body: dict[str, Any], n: int, budget: Any = CallBudget
) -> Sample:
    """``sync_row`` inside a CallBudget (``budget``: the class of the transport's own module,
    which a baseline transport loaded beside this one has apart)."""
    with budget(calls=n + 1, tokens=10**9):
        return sync_row(client, url, body, n)


def async_row(make: Callable[[], httpx2.AsyncClient], url: str, n: int) -> Sample:
    data = json.dumps(BODY).encode()
    headers = {"content-type": "application/json"}

    async def main() -> Sample:
        async with make() as client:
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(n):
                r = await client.post(url, content=data, headers=headers)
                await r.aread()
            return (
                (time.perf_counter() - t0) / n * 1e6,
                (time.thread_time() - c0) / n * 1e6,
            )

    return asyncio.run(main())


@contextlib.contextmanager
def provider_process(cpu: int | None = None) -> Iterator[str]:
    """The loopback mock in a process of its own (``python -m ratequeue mock-provider``): its
    server threads share no GIL, caches or CPU time with the calling thread (``cpu``: the
    one core it runs on). Yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "ratequeue", "mock-provider", "--rpm", "1e7", "--burst"]
    cmd += ["1000000", "--gen-time", "0", "--port", str(port), "--duration", "3600"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if cpu is not None:
        os.sched_setaffinity(proc.pid, {cpu})  # its threads, made later, inherit it
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the mock provider process did not start") from None
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def overhead(
    calls: int, rounds: int, baseline: str | None
) -> list[tuple[str, str, Sample, str | None]]:
    stream_body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    caps = [Cap(100, route="/chat/completions"), Cap(50, model="gpt-bench", task="x")]
    # The shared estimator's tiktoken loader thread done before any row (as --instructions):
    # until then calls take the Python reader beside a thread contending for the GIL.
    default_estimator().load(60)  # type: ignore[attr-defined]
    with provider_process() as url:
        mem = httpx2.Client(transport=httpx2.MockTransport(answer))
        mem_t = httpx2.Client(transport=RateLimitedTransport(httpx2.MockTransport(answer), roomy()))
        mem_caps = httpx2.Client(
            transport=RateLimitedTransport(httpx2.MockTransport(answer), roomy(), caps=caps)
        )
        net = httpx2.Client(transport=httpx2.HTTPTransport())
        net_t = httpx2.Client(transport=RateLimitedTransport(httpx2.HTTPTransport(), roomy()))
        req_only = rq.Limiter(rq.Rate(10**9, per="minute", burst=10**6))
        mem_r = httpx2.Client(
            transport=RateLimitedTransport(httpx2.MockTransport(answer), req_only)
        )
        rows: dict[str, tuple[str, Callable[[], Sample], str | None]] = {
            "floor: MockTransport (in memory)": (
                "memory",
                lambda: sync_row(mem, url, BODY, calls),
                None,
            ),
            "RateLimitedTransport(MockTransport)": (
                "memory",
                lambda: sync_row(mem_t, url, BODY, calls),
                "floor: MockTransport (in memory)",
            ),
            "... a Limiter of requests only (no estimate needed)": (
                "memory",
                lambda: sync_row(mem_r, url, BODY, calls),
                "floor: MockTransport (in memory)",
            ),
            "... + output caps + CallBudget": (
                "memory",
                lambda: budget_row(mem_caps, url, BODY, calls),
                "floor: MockTransport (in memory)",
            ),
            "floor: MockTransport, SSE of 20 events": (
                "memory",
                lambda: sync_row(mem, url, stream_body, calls),
                None,
            ),
            "RateLimitedTransport, SSE of 20 events": (
                "memory",
                lambda: sync_row(mem_t, url, stream_body, calls),
                "floor: MockTransport, SSE of 20 events",
            ),
            "floor: async MockTransport": (
                "memory",
                lambda: async_row(
                    lambda: httpx2.AsyncClient(transport=httpx2.MockTransport(answer)), url, calls
                ),
                None,
            ),
            "async RateLimitedTransport(MockTransport)": (
                "memory",
                lambda: async_row(
                    lambda: httpx2.AsyncClient(
                        transport=RateLimitedTransport(httpx2.MockTransport(answer), roomy())
                    ),
                    url,
                    calls,
                ),
                "floor: async MockTransport",
            ),
            "floor: HTTPTransport to the loopback mock": (
                "loopback",
                lambda: sync_row(net, url, BODY, calls),
                None,
            ),
            "RateLimitedTransport(HTTPTransport), loopback": (
                "loopback",
                lambda: sync_row(net_t, url, BODY, calls),
                "floor: HTTPTransport to the loopback mock",
            ),
        }
        extra = [mem_r]
        if baseline is not None:
            old = baseline_transport(baseline)
            old_mod = sys.modules["ratequeue._httpx_baseline"]
            old_budget = old_mod.CallBudget
            old_caps = [old_mod.Cap(c.max_tokens, c.route, c.model, c.task) for c in caps]
            mem_b = httpx2.Client(transport=old(httpx2.MockTransport(answer), roomy()))
            net_b = httpx2.Client(transport=old(httpx2.HTTPTransport(), roomy()))
            mem_rb = httpx2.Client(transport=old(httpx2.MockTransport(answer), req_only))
            mem_cb = httpx2.Client(
                transport=old(httpx2.MockTransport(answer), roomy(), caps=old_caps)
            )
            extra += [mem_b, net_b, mem_rb, mem_cb]
            rows[f"before ({baseline}): RateLimitedTransport(MockTransport)"] = (
                "memory",
                lambda: sync_row(mem_b, url, BODY, calls),
                "floor: MockTransport (in memory)",
            )
            rows[f"before ({baseline}): a Limiter of requests only"] = (
                "memory",
                lambda: sync_row(mem_rb, url, BODY, calls),
                "floor: MockTransport (in memory)",
            )
            rows[f"before ({baseline}): ... + output caps + CallBudget"] = (
                "memory",
                lambda: budget_row(mem_cb, url, BODY, calls, old_budget),
                "floor: MockTransport (in memory)",
            )
            rows[f"before ({baseline}): RateLimitedTransport, SSE of 20 events"] = (
                "memory",
                lambda: sync_row(mem_b, url, stream_body, calls),
                "floor: MockTransport, SSE of 20 events",
            )
            rows[f"before ({baseline}): async RateLimitedTransport(MockTransport)"] = (
                "memory",
                lambda: async_row(
                    lambda: httpx2.AsyncClient(
                        transport=old(httpx2.MockTransport(answer), roomy())
                    ),
                    url,
                    calls,
                ),
                "floor: async MockTransport",
            )
            rows[f"before ({baseline}): RateLimitedTransport(HTTPTransport), loopback"] = (
                "loopback",
                lambda: sync_row(net_b, url, BODY, calls),
                "floor: HTTPTransport to the loopback mock",
            )
        for _, fn, _ in rows.values():  # warm up: connections, imports, caches
            fn()
        samples: dict[str, list[Sample]] = {k: [] for k in rows}
        order = list(rows)
        shuffle = random.Random(15).shuffle
        for _ in range(rounds):
            shuffle(order)  # no row always runs after the same one (caches, frequency)
            for name in order:
                samples[name].append(rows[name][1]())
        for c in (mem, mem_t, mem_caps, net, net_t, *extra):
            c.close()
    return [
        (
            name,
            kind,
            (
                statistics.median(w for w, _ in samples[name]),
                statistics.median(c for _, c in samples[name]),
            ),
            floor,
        )
        for name, (kind, _, floor) in rows.items()
    ]


def table_overhead(rows: list[tuple[str, str, Sample, str | None]]) -> list[str]:
    by = {name: v for name, _, v, _ in rows}
    out = [
        "| transport | where | CPU µs/call | added CPU vs its floor | wall µs/call | added wall |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, kind, (wall, cpu), floor in rows:
        if floor is None:
            added_cpu = added_wall = "—"
        else:
            added_cpu = f"{cpu - by[floor][1]:+.1f} µs"
            added_wall = f"{wall - by[floor][0]:+.1f} µs"
        out.append(f"| {name} | {kind} | {cpu:.1f} | {added_cpu} | {wall:.1f} | {added_wall} |")
    return out


# -- 1b. the added cost call by call --------------------------------------------------------


class Passing(httpx2.BaseTransport):
    """The control of ``paired``: a transport that only passes the call on."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def paired(n: int) -> list[str]:
    """Each row's floor and transport called one after the other (ABBA), ``n`` times each,
    the CPU (``thread_time_ns``) and wall time of every call kept; "added" is a statistic of
    the transport's calls minus the same of the floor's (not of per-pair differences). A
    drift of the machine (frequency, a neighbour) reaches both alike, which rounds of
    hundreds of calls do not cancel on a loopback call of ~0.5 ms. With two cores or more
    the calling thread runs on core 0 and the mock provider on core 1. The second row is
    the first over httpx2's ``AsyncClient``, each call run to its end on one event loop.
    The fourth row writes a 4 MiB buffer between calls (outside the timing): what a real
    network call does to the caches (the kernel's network stack, httpcore, h11). The
    fifth sleeps 300 µs between calls (outside the timing), as a loopback call waits for
    its answer: the core idles, and the caches and branch predictors the call finds are
    what the idle left of them. That row, not the fourth, gives the loopback row's added
    cost back: the transport's code and data are cold on every call. The last row is a
    control: a Python transport that only passes the call on, to show what any wrapper
    costs here."""
    pin = hasattr(os, "sched_getaffinity") and {0, 1} <= os.sched_getaffinity(0)
    before = os.sched_getaffinity(0) if pin else None
    default_estimator().load(60)  # type: ignore[attr-defined]
    if pin:
        os.sched_setaffinity(0, {0})
    data = json.dumps(BODY).encode()
    headers = {"content-type": "application/json"}
    trash = bytearray(4 << 20)
    ones = b"\x01" * (len(trash) // 64)
    out = [
        f"{n:,} calls of each, alternating call by call"
        + (" (caller on core 0, mock provider on core 1)" if pin else "")
        + "; µs per call.",
        "",
        "| row | floor CPU (median) | added CPU: median | fastest 90 %: mean | p10 "
        "| floor wall (median) | added wall: median |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    try:
        with provider_process(1 if pin else None) as url:
            target = url + "/v1/chat/completions"
            memory = lambda: httpx2.MockTransport(answer)  # noqa: E731
            limit = lambda inner: RateLimitedTransport(inner, roomy())  # noqa: E731
            rows: list[tuple[str, Callable[[], Any], Callable[[Any], Any], str]] = [
                ("loopback (the issue's row)", httpx2.HTTPTransport, limit, ""),
                ("loopback, asyncio", httpx2.AsyncHTTPTransport, limit, "async"),
                ("in memory", memory, limit, ""),
                ("in memory, caches cold", memory, limit, "trash"),
                ("in memory, after a 300 µs idle", memory, limit, "idle"),
                ("control: a pass-through wrapper, loopback", httpx2.HTTPTransport, Passing, ""),
            ]
            loop = asyncio.new_event_loop()

            async def apost(c: httpx2.AsyncClient) -> None:
                r = await c.post(target, content=data, headers=headers)
                await r.aread()

            for label, make, wrap, cold in rows:
                client = httpx2.AsyncClient if cold == "async" else httpx2.Client
                floor = client(transport=make())
                limited = client(transport=wrap(make()))

                def one(c: Any, cold: str = cold) -> tuple[int, int]:
                    if cold == "trash":
                        trash[::64] = ones
                    elif cold == "idle":
                        time.sleep(300e-6)
                    c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
                    if cold == "async":
                        loop.run_until_complete(apost(c))
                    else:
                        c.post(target, content=data, headers=headers).read()
                    return time.thread_time_ns() - c0, time.perf_counter_ns() - w0

                for _ in range(300):  # warm up: connections, caches
                    one(floor), one(limited)
                fs: list[tuple[int, int]] = []
                ts: list[tuple[int, int]] = []
                for i in range(n):
                    pair = (
                        ((floor, fs), (limited, ts)) if i % 2 == 0 else ((limited, ts), (floor, fs))
                    )
                    for c, into in pair:
                        into.append(one(c))
                for c in (floor, limited):
                    if cold == "async":
                        loop.run_until_complete(c.aclose())
                    else:
                        c.close()

                def at(xs: list[tuple[int, int]], k: int) -> tuple[float, float, float]:
                    v = sorted(x[k] / 1e3 for x in xs)
                    return (
                        statistics.median(v),
                        statistics.fmean(v[: len(v) * 9 // 10]),
                        v[len(v) // 10],
                    )

                (fc, fm, fp), (tc, tm, tp) = at(fs, 0), at(ts, 0)
                fw, tw = at(fs, 1)[0], at(ts, 1)[0]
                out.append(
                    f"| {label} | {fc:.1f} | **{tc - fc:+.1f}** | {tm - fm:+.1f} | {tp - fp:+.1f} "
                    f"| {fw:.1f} | {tw - fw:+.1f} |"
                )
            loop.close()
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)
    return out


# -- 2. the queue against the SDK's retry loop -----------------------------------------------


def burst(transport: Any, n: int) -> dict[str, float]:
    with MockProvider(600, burst=1, gen_time=0.0) as mock:
        client = openai.OpenAI(
            api_key="k",
            base_url=mock.base_url + "/v1",
            max_retries=50,
            http_client=httpx2.Client(transport=transport() if callable(transport) else transport),
        )
        lat: list[float] = []
        lock = threading.Lock()
        errors = 0

        def call() -> None:
            nonlocal errors
            t0 = time.monotonic()
            try:
                client.chat.completions.create(model="gpt", messages=BODY["messages"])
            except Exception:
                with lock:
                    errors += 1
                return
            with lock:
                lat.append(time.monotonic() - t0)

        threads = [threading.Thread(target=call) for _ in range(n)]
        t0 = time.monotonic()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        elapsed = time.monotonic() - t0
        s = mock.stats()
    lat.sort()
    pick = lambda q: lat[min(len(lat) - 1, max(0, int(q * len(lat) + 0.999) - 1))]  # noqa: E731
    return {
        "sent": s["requests"],
        "ok": s["ok"],
        "r429": s["rate_limited"],
        "errors": errors,
        "p50": pick(0.5),
        "p99": pick(0.99),
        "max": lat[-1],
        "elapsed": elapsed,
    }


def retries(n: int) -> list[tuple[str, dict[str, float]]]:
    return [
        ("SDK alone: openai retry loop (max_retries=50)", burst(httpx2.HTTPTransport, n)),
        (
            "RateLimitedTransport, Limiter 570/min burst 1",
            burst(
                lambda: RateLimitedTransport(
                    httpx2.HTTPTransport(), rq.Limiter(rq.Rate(570, per="minute", burst=1))
                ),
                n,
            ),
        ),
        (
            "RateLimitedTransport, Limiter 60,000/min burst 50, calibrate=True",
            burst(
                lambda: RateLimitedTransport(
                    httpx2.HTTPTransport(),
                    rq.Limiter(rq.Rate(60_000, per="minute", burst=50)),
                    calibrate=True,
                ),
                n,
            ),
        ),
    ]


def table_retries(rows: list[tuple[str, dict[str, float]]], n: int) -> list[str]:
    ideal = (n - 1) / 10.0
    out = [
        f"{n} concurrent calls, provider 600/min burst 1 (ideal: the last one done after "
        f"{ideal:.1f} s)",
        "",
        "| client | calls sent per success | 429s | failed | p50 latency | p99 latency | max "
        "| all done |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows:
        out.append(
            f"| {name} | {r['sent'] / max(1, r['ok']):.2f} | {r['r429']:.0f} | {r['errors']:.0f} "
            f"| {r['p50']:.2f} s | {r['p99']:.2f} s | {r['max']:.2f} s | {r['elapsed']:.2f} s |"
        )
    return out


# -- 3. instructions per call -----------------------------------------------------------------

IR_ROWS = {
    "floor": "floor: MockTransport (in memory)",
    "tokens": "RateLimitedTransport(MockTransport)",
    "requests": "... a Limiter of requests only (no estimate needed)",
    "caps": "... + output caps + CallBudget",
    "afloor": "floor: async MockTransport",
    "async": "async RateLimitedTransport(MockTransport)",
    "sfloor": "floor: MockTransport, SSE of 20 events",
    "sse": "RateLimitedTransport, SSE of 20 events",
    "askfloor": "floor: MockTransport, SSE, the body without stream_options",
    "ask": "RateLimitedTransport, SSE, the transport asks for the usage",
}
IR_FLOOR = {
    "tokens": "floor",
    "requests": "floor",
    "caps": "floor",
    "async": "afloor",
    "sse": "sfloor",
    "ask": "askfloor",
}
# The body each row sends (the chat body unless named here).
IR_BODY = {
    "sfloor": {**BODY, "stream": True, "stream_options": {"include_usage": True}},
    "sse": {**BODY, "stream": True, "stream_options": {"include_usage": True}},
    "askfloor": {**BODY, "stream": True},
    "ask": {**BODY, "stream": True},
}


def _floors(rows: list[str]) -> set[str]:
    return {IR_FLOOR[r] for r in rows if r in IR_FLOOR}


def ir_child(which: str, row: str, n: int) -> None:
    """One row's calls (run under valgrind by ``instructions``)."""
    cls = RateLimitedTransport if which == "now" else baseline_transport(which)
    mod = sys.modules[cls.__module__.rsplit(".", 1)[0]]  # its own Cap and CallBudget
    inner = httpx2.MockTransport(answer)
    if row in ("floor", "afloor", "sfloor", "askfloor"):
        t: Any = inner
    elif row == "requests":
        t = cls(inner, rq.Limiter(rq.Rate(10**9, per="minute", burst=10**6)))
    elif row == "caps":
        caps = [mod.Cap(100, route="/chat/completions"), mod.Cap(50, model="gpt-bench", task="x")]
        t = cls(inner, roomy(), caps=caps)
    else:
        t = cls(inner, roomy())
    if hasattr(getattr(t, "estimator", None), "load"):
        t.estimator.load(60)  # the tiktoken loader thread is done before counting
    if row in ("afloor", "async"):
        async_row(lambda: httpx2.AsyncClient(transport=t), "http://x/v1/chat/completions", 50)
        gc.collect()
        gc.freeze()
        async_row(lambda: httpx2.AsyncClient(transport=t), "http://x/v1/chat/completions", n)
        return
    client = httpx2.Client(transport=t)
    body = IR_BODY.get(row, BODY)
    sync_row(client, "http://x/v1/chat/completions", body, 50)
    gc.collect()
    gc.freeze()  # the warm-up's objects are not traced again by the counted calls
    if row == "caps":
        budget_row(client, "http://x/v1/chat/completions", body, n, mod.CallBudget)
    else:
        sync_row(client, "http://x/v1/chat/completions", body, n)


def _ir(which: str, row: str, n: int) -> int:
    out = subprocess.run(
        [
            "valgrind",
            "--tool=cachegrind",
            "--cache-sim=no",
            "--cachegrind-out-file=/dev/null",
            sys.executable,
            __file__,
            "--ir-child",
            which,
            row,
            str(n),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
        check=True,
    ).stderr
    line = next(x for x in out.splitlines() if "I   refs:" in x or "I refs:" in x)
    return int(line.rsplit(":", 1)[1].strip().replace(",", ""))


def instructions(baseline: str | None, jobs: int, rows: list[str] | None = None) -> list[str]:
    """The instruction table: per row, instructions per call and added over its floor."""
    from concurrent.futures import ThreadPoolExecutor

    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind")
    names = {r: n for r, n in IR_ROWS.items() if rows is None or r in rows or r in _floors(rows)}
    runs = [("now", r) for r in names]
    if baseline is not None:
        runs += [(baseline, r) for r in names if r in IR_FLOOR]
    with ThreadPoolExecutor(jobs) as ex:
        counts = {
            (w, r, n): f
            for w, r in runs
            for n, f in ((n, ex.submit(_ir, w, r, n)) for n in (100, 600))
        }
        per = {
            (w, r): (counts[w, r, 600].result() - counts[w, r, 100].result()) / 500 for w, r in runs
        }
    out = [
        "| transport | instructions/call | added vs its floor |"
        + (f" added before ({baseline}) |" if baseline else ""),
        "|---|---:|---:|" + ("---:|" if baseline else ""),
    ]
    for r, name in names.items():
        v = per["now", r]
        if r not in IR_FLOOR:
            out.append(f"| {name} | {v:,.0f} | — |" + (" — |" if baseline else ""))
            continue
        f = per["now", IR_FLOOR[r]]
        line = f"| {name} | {v:,.0f} | {v - f:+,.0f} ({(v - f) / f:+.1%}) |"
        if baseline:
            b = per[baseline, r]
            line += f" {b - f:+,.0f} ({(b - f) / f:+.1%}) |"
        out.append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--burst", type=int, default=40)
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"the markdown written (default: {DEFAULT_OUT} for the full run; a partial run "
        "(--paired, --instructions, --skip-retries) writes only where this names)",
    )
    ap.add_argument(
        "--baseline",
        metavar="GIT_REF",
        help="also run the transport as it is at this git ref (e.g. main), in the same rounds",
    )
    ap.add_argument("--skip-retries", action="store_true", help="only the added-cost table")
    ap.add_argument(
        "--instructions",
        action="store_true",
        help="only the table of instructions per call (valgrind), rows in parallel",
    )
    ap.add_argument("--jobs", type=int, default=4, help="valgrind processes at once")
    ap.add_argument(
        "--paired",
        type=int,
        metavar="N",
        help="only the added cost call by call (N calls of each row's floor and transport)",
    )
    ap.add_argument(
        "--ir-rows",
        help=f"with --instructions: only these rows (comma-separated of {', '.join(IR_ROWS)})",
    )
    ap.add_argument("--ir-child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ir_child:
        ir_child(args.ir_child[0], args.ir_child[1], int(args.ir_child[2]))
        return
    versions = ", ".join(
        f"{p} {importlib.metadata.version(p)}" for p in ("httpx2", "openai", "ratequeue")
    )
    base_arg = f" --baseline {args.baseline}" if args.baseline else ""
    if args.instructions:
        base_arg = f" --instructions{base_arg}"
        if args.ir_rows:
            base_arg += f" --ir-rows {args.ir_rows}"
    command = f"--calls {args.calls} --rounds {args.rounds} --burst {args.burst}{base_arg}"
    if args.paired:
        command = f"--paired {args.paired}"
    head = [
        "# The LLM transport: added cost per call, and the queue against the SDK's retry loop",
        "",
        f"`benches/bench_transport.py {command}`, "
        f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.2f}; Python {platform.python_version()}, {versions}.",
        "",
    ]
    if args.instructions:
        rows = args.ir_rows.split(",") if args.ir_rows else None
        t3 = instructions(args.baseline, args.jobs, rows)
        lines = [*head, "## 3. Instructions per call (valgrind; load-independent)", "", *t3]
        print("\n".join(lines))
        _write(args.out, lines)
        return
    if args.paired:
        lines = [*head, "## 1b. Added cost per call, call by call", "", *paired(args.paired)]
        print("\n".join(lines))
        _write(args.out, lines)
        return
    head += ["## 1. Added cost per call (median of interleaved rounds)", ""]
    t1 = table_overhead(overhead(args.calls, args.rounds, args.baseline))
    print("\n".join(head + t1), flush=True)
    if args.skip_retries:
        _write(args.out, head + t1)
        return
    t2 = table_retries(retries(args.burst), args.burst)
    lines = head + t1 + ["", "## 2. The queue against the SDK's retry loop", ""] + t2
    print("\n".join(lines[len(head) + len(t1) :]))
    _write(args.out or DEFAULT_OUT, lines)


def _write(out: Path | None, lines: list[str]) -> None:
    """The run's markdown in ``out`` (None: printed only; a partial run never replaces
    the full run's file unless asked to)."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
