"""Where the transport's instructions go: one call's steps, each counted apart.

Rows marked "reference" are the Python readers the native ones (``ratequeue_core::llm``)
replaced; the transport runs them only where a native reader defers.

Runs itself under ``valgrind --tool=callgrind`` (needs valgrind, its headers and a C
compiler: a 3-line helper is compiled into a temporary directory); each step runs
``--calls`` times between two callgrind client requests (zero, then dump), so start-up
and imports are not counted and the machine's load changes nothing. Printed: the
instructions per call of each step, minus the loop's own cost (the first row)::

    .venv/bin/python benches/profile_transport.py [--calls 1000] [--out FILE]

``--time``: CPU time instead (``time.thread_time``), in two tables. Steps: the rows
above, each in a tight loop (what a step costs when its code and data are hot). Stages:
whole calls through an ``httpx2.Client`` whose transport does a growing part of a call
(prepare; + acquire; + the grant's bookkeeping and settle; the whole call), interleaved
rounds, each minus the bare MockTransport: what the parts cost inside a real call, where
a step costs several times its tight-loop time (caches and branch history are cold).
For a sampled profile of the whole call, run ``py-spy record --native`` over
``bench_transport.py`` (Python 3.11 has no ``-X perf`` trampoline; 3.12 added it).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
HELPER = """#include <valgrind/callgrind.h>
void cg_zero(void){ CALLGRIND_ZERO_STATS; }
void cg_dump(const char* s){ CALLGRIND_DUMP_STATS_AT(s); }
"""


def steps() -> list[tuple[str, Callable[[], Any]]]:
    sys.path.insert(0, str(HERE))
    import bench_transport as bt
    import httpx2
    from ratequeue._ratequeue import _read_call_headers, _read_request, _read_response
    from ratequeue.httpx import RateLimitedTransport
    from ratequeue.httpx._record import json_object, json_usage, json_usage_py
    from ratequeue.httpx._wire import _KNOWN, header_list, new_id, scan_response

    inner = httpx2.MockTransport(bt.answer)
    t = RateLimitedTransport(inner, bt.roomy())
    t.estimator.load(60)  # type: ignore[attr-defined]
    data = json.dumps(bt.BODY).encode()
    client = httpx2.Client(transport=t)
    req = client.build_request(
        "POST",
        "http://x/v1/chat/completions",
        content=data,
        headers={"content-type": "application/json"},
    )
    resp = inner.handle_request(req)
    body = json_object(data)
    kw = t._prepare(req, False)._kw

    def through() -> None:
        call = t._prepare(req, False)
        call._permit = t.limit.acquire(**call._kw)
        t._received(call, resp, 0.0, False)

    def nothing() -> None:
        pass

    def before_received() -> None:
        call = t._prepare(req, False)
        call._permit = t.limit.acquire(**call._kw)

    settled = t._prepare(req, False)
    settled._permit = t.limit.acquire(**settled._kw)
    usage = json_usage(resp.content)

    def settle() -> None:
        settled._once = [None]
        t._settle(settled, usage, 200, reported=True)

    sdata = json.dumps({**bt.BODY, "stream": True}).encode()

    def sse_req() -> Any:
        return client.build_request(
            "POST",
            "http://x/v1/chat/completions",
            content=sdata,
            headers={"content-type": "application/json"},
        )

    sreq = sse_req()
    sresp = inner.handle_request(t._prepare(sse_req(), False)._request)

    def sse_before() -> None:
        call = t._prepare(sse_req(), False)
        call._permit = t.limit.acquire(**call._kw)

    def sse_through() -> None:
        call = t._prepare(sse_req(), False)
        call._permit = t.limit.acquire(**call._kw)
        t._received(call, sresp, 0.0, False)

    def floor() -> Any:
        return inner.handle_request(req)

    return [
        # Rows in parentheses are not printed: they take the one-time costs of the first
        # steps counted (the first dump, the allocator's first pools after the set-up),
        # which inflated the floor row by ~21k instructions before xport9.
        ("(the loop itself)", nothing),
        ("(the floor, once more)", floor),
        ("the loop itself", nothing),
        ("floor: MockTransport.handle_request", floor),
        ("RateLimitedTransport.handle_request", lambda: t.handle_request(req)),
        ("  prepare, acquire, received (no inner call)", through),
        ("  prepare, acquire (no received)", before_received),
        ("  _settle (a usage, the token units)", settle),
        ("SSE: build the stream request", sse_req),
        ("SSE: + prepare, acquire", sse_before),
        ("SSE: + received (20 events, consumed)", sse_through),
        ("SSE: _prepare of a stream request", lambda: t._prepare(sreq, False)),
        ("  _prepare", lambda: t._prepare(req, False)),
        (
            "    request body read (native: model, stream, chars/4)",
            lambda: t._read_body(data, "/v1/chat/completions"),
        ),
        ("      of which the native call", lambda: _read_request(data, 4, 1024)),
        ("    reference: request JSON parse (json_object)", lambda: json_object(data)),
        ("    reference: estimate (chars/4)", lambda: t.estimator(body, "/v1/chat/completions")),
        (
            "    request's own headers (native)",
            lambda: _read_call_headers(header_list(req.headers)),
        ),
        ("    request.url.path", lambda: req.url.path),
        ("    new_id", new_id),
        ("  Limiter.acquire", lambda: t.limit.acquire(**kw)),
        ("  Limiter.acquire + Permit.settle", lambda: t.limit.acquire(**kw).settle(tokens=100)),
        (
            "  response headers + usage (native, one call)",
            lambda: _read_response(header_list(resp.headers), resp.content),
        ),
        ("  response usage read (json_usage, native)", lambda: json_usage(resp.content)),
        ("  reference: response usage read (json_usage_py)", lambda: json_usage_py(resp.content)),
        ("  response header scan (native)", lambda: scan_response(header_list(resp.headers))),
        (
            "  reference: response header scan (Python)",
            lambda: scan_response(header_list(resp.headers), _KNOWN),
        ),
        ("  Histogram.record", lambda: t.wait_histogram.record(0.001)),
        ("  perf_counter", time.perf_counter),
    ]


def stages() -> dict[str, Callable[[], Any]]:
    """Transports that do a growing part of a call, each as one call through a client."""
    sys.path.insert(0, str(HERE))
    import bench_transport as bt
    import httpx2
    from ratequeue.httpx import RateLimitedTransport

    class Prepare(RateLimitedTransport):
        def handle_request(self, request: Any) -> Any:
            self._prepare(request, False)
            return self.inner.handle_request(request)

    class Acquire(RateLimitedTransport):
        def handle_request(self, request: Any) -> Any:
            call = self._prepare(request, False)
            call._permit = self.limit.acquire(**call._kw)
            return self.inner.handle_request(request)

    class Settle(RateLimitedTransport):  # the whole call but the response read
        def handle_request(self, request: Any) -> Any:
            call = self._prepare(request, False)
            t0 = time.perf_counter()
            call._permit = self.limit.acquire(**call._kw)
            call.waited = time.perf_counter() - t0
            self.wait_histogram.record(call.waited)
            response = self.inner.handle_request(request)
            self.http_histogram.record(time.perf_counter() - t0)
            self._settle(call, None, 200, reported=True)
            return response

    rows: dict[str, Callable[[], Any]] = {}
    for name, cls in (
        ("floor: MockTransport", None),
        ("_prepare (own headers, body read, estimate, costs, record)", Prepare),
        ("+ Limiter.acquire", Acquire),
        ("+ timings, histograms, settle without a usage", Settle),
        ("the whole call (+ response headers, usage, settle)", RateLimitedTransport),
    ):
        inner = httpx2.MockTransport(bt.answer)
        t = inner if cls is None else cls(inner, bt.roomy())
        client = httpx2.Client(transport=t)
        rows[name] = lambda c=client: bt.sync_row(c, "http://x/v1/chat/completions", bt.BODY, 300)
    return rows


def timed(n: int, rounds: int) -> list[str]:
    """The steps in tight loops, then the stages in interleaved rounds (CPU µs)."""
    import random
    import statistics

    st = steps()
    res: dict[str, list[float]] = {name: [] for name, _ in st}
    for _ in range(rounds):
        for name, f in st:
            for _ in range(100):
                f()
            gc.collect()
            c0 = time.thread_time()
            for _ in range(n):
                f()
            res[name].append((time.thread_time() - c0) / n * 1e6)
    loop = statistics.median(res["the loop itself"])
    lines = [
        f"`benches/profile_transport.py --time --calls {n}`, load {os.getloadavg()[0]:.2f}",
        "",
        "| step (one call, tight loop) | CPU µs |",
        "|---|---:|",
    ]
    lines += [
        f"| {name} | {statistics.median(res[name]) - loop:.2f} |"
        for name, _ in st
        if not name.startswith("(") and name != "the loop itself"
    ]
    rows = stages()
    for f in rows.values():
        f()
    samples: dict[str, list[float]] = {k: [] for k in rows}
    order = list(rows)
    for _ in range(rounds):
        random.shuffle(order)
        for k in order:
            samples[k].append(rows[k]()[1])
    floor = statistics.median(samples["floor: MockTransport"])
    lines += [
        "",
        "| stage (whole calls through httpx2.Client, interleaved) | CPU µs/call | added |",
        "|---|---:|---:|",
    ]
    for k in rows:
        v = statistics.median(samples[k])
        lines.append(f"| {k} | {v:.1f} | {v - floor:+.1f} |")
    return lines


def child(lib_path: str, n: int) -> None:
    lib = ctypes.CDLL(lib_path)
    for name, f in steps():
        for _ in range(100):
            f()
        gc.collect()
        lib.cg_zero()
        for _ in range(n):
            f()
        lib.cg_dump(name.encode())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--time", action="store_true", help="CPU time, not instructions")
    ap.add_argument("--rounds", type=int, default=9, help="with --time")
    args = ap.parse_args()
    if args.time:
        lines = timed(args.calls, args.rounds)
        print("\n".join(lines))
        if args.out:
            args.out.write_text("\n".join(lines) + "\n")
        return
    if args.child:
        child(args.child, args.calls)
        return
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "cg.c").write_text(HELPER)
        lib = str(Path(d) / "libcg.so")
        subprocess.run(
            ["cc", "-O1", "-shared", "-fPIC", "-o", lib, str(Path(d) / "cg.c")], check=True
        )
        out = str(Path(d) / "callgrind.out")
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                "--child",
                lib,
                "--calls",
                str(args.calls),
            ],
            env={**os.environ, "PYTHONHASHSEED": "0"},
            capture_output=True,
            check=True,
        )
        rows = []
        for f in sorted(Path(d).glob("callgrind.out.*"), key=lambda p: int(p.suffix[1:])):
            text = f.read_text(errors="replace")
            name = next(x for x in text.splitlines() if x.startswith("desc: Trigger"))
            total = next(x for x in text.splitlines() if x.startswith("totals:"))
            rows.append((name.split("Client Request: ", 1)[1], int(total.split()[1]) / args.calls))
    per = dict(rows)
    loop = per["the loop itself"]
    lines = [
        f"`benches/profile_transport.py --calls {args.calls}` (callgrind, PYTHONHASHSEED=0)",
        "",
        "| step (one call) | instructions |",
        "|---|---:|",
    ]
    lines += [
        f"| {name} | {v - loop:,.0f} |"
        for name, v in rows
        if name[0] != "(" and name != "the loop itself"
    ]
    added = per["RateLimitedTransport.handle_request"] - per["floor: MockTransport.handle_request"]
    lines.append(f"| handle_request - floor | {added:+,.0f} |")
    lines.append(f"| (the loop itself, subtracted) | {loop:,.0f} |")
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
