"""Where the transport's added time goes, phase by phase, on loopback and in memory.

    .venv/bin/python benches/phases_transport.py [--calls 3000] [--out FILE]

The same chat-completion POST as ``bench_transport.py``, through a bare transport (the
floor) and through ``RateLimitedTransport`` over it, alternating call by call (caller on
core 0, the mock provider on core 1 when there are two cores). Both inner transports are
wrapped in the same timing layer, and the transport's ``_prepare`` and ``_received`` are
timed (CPU of the calling thread, ``thread_time_ns``; medians, µs per call):

- ``client.post``: the whole call as its caller sees it (httpx builds the request,
  the transports, httpx reads the body);
- the inner transport's ``handle_request`` (the HTTP exchange up to the headers);
- the transport's ``handle_request``: its own work before and after the inner call
  (``_prepare`` the request side, then the acquire, ``_received`` the headers and the
  settle or the stream's reader);
- the rest (``post`` minus the transport): httpx's client and the body read, where the
  native reader settles a streamed body.

The timing wrappers add their own cost to both sides alike; the differences are what
count.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
from ratequeue.httpx import RateLimitedTransport
from ratequeue.httpx import _transport as transport_module
from ratequeue.httpx._estimate import default_estimator
from ratequeue.httpx._prepare import _Requests

sys.path.insert(0, str(Path(__file__).parent))
from bench_transport import BODY, answer, provider_process, roomy

_now = time.thread_time_ns
_phases: dict[str, list[int]] = {"prepare": [], "received": []}


class Timed(httpx2.BaseTransport):
    """Times its inner transport's ``handle_request``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.log: list[int] = []

    def handle_request(self, request: Any) -> Any:
        c0 = _now()
        r = self.inner.handle_request(request)
        self.log.append(_now() - c0)
        return r


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any) -> Any:
        c0 = _now()
        r = fn(*args)
        _phases[name].append(_now() - c0)
        return r

    return wrapper


def run(make: Callable[[], Any], url: str, n: int) -> dict[str, tuple[float, float]]:
    """Median µs per call of each phase: (floor, transport)."""
    inner_f, inner_t = Timed(make()), Timed(make())
    outer_f, outer_t = Timed(inner_f), Timed(RateLimitedTransport(inner_t, roomy()))
    clients = httpx2.Client(transport=outer_f), httpx2.Client(transport=outer_t)
    data = json.dumps(BODY).encode()
    headers = {"content-type": "application/json"}
    target = url + "/v1/chat/completions"
    posts: tuple[list[int], list[int]] = ([], [])

    def one(k: int) -> None:
        c0 = _now()
        clients[k].post(target, content=data, headers=headers).read()
        posts[k].append(_now() - c0)

    for _ in range(300):
        one(0), one(1)
    for log in (*posts, inner_f.log, inner_t.log, outer_f.log, outer_t.log, *_phases.values()):
        log.clear()
    for i in range(n):
        for k in (0, 1) if i % 2 == 0 else (1, 0):
            one(k)
    for c in clients:
        c.close()

    def med(xs: list[int]) -> float:
        return statistics.median(xs) / 1e3

    post = med(posts[0]), med(posts[1])
    inner = med(inner_f.log), med(inner_t.log)
    outer = med(outer_f.log), med(outer_t.log)
    return {
        "`client.post` (the whole call)": post,
        "inner `handle_request` (the HTTP exchange)": inner,
        "the transport around it": (outer[0] - inner[0], outer[1] - inner[1]),
        "... of which `_prepare` (request side)": (0.0, med(_phases["prepare"])),
        "... of which `_received` (headers, settle or reader)": (0.0, med(_phases["received"])),
        "httpx outside the transport, the body read": (post[0] - outer[0], post[1] - outer[1]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    pin = hasattr(os, "sched_getaffinity") and {0, 1} <= os.sched_getaffinity(0)
    default_estimator().load(60)  # type: ignore[attr-defined]
    if pin:
        os.sched_setaffinity(0, {0})
    _Requests._prepare = _timed("prepare", _Requests._prepare)  # type: ignore[method-assign]
    received = transport_module.RateLimitedTransport._received
    transport_module.RateLimitedTransport._received = _timed("received", received)  # type: ignore[method-assign]
    lines = [
        "# The transport's added time, phase by phase",
        "",
        f"`benches/phases_transport.py --calls {args.calls}`, "
        f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.2f}; Python {platform.python_version()}; "
        + ("caller on core 0, mock provider on core 1" if pin else "not pinned")
        + ". CPU µs per call (medians), floor and transport alternating call by call.",
        "",
    ]
    with provider_process(1 if pin else None) as url:
        for label, make in (
            ("loopback (`HTTPTransport` to the mock provider)", httpx2.HTTPTransport),
            ("in memory (`MockTransport`)", lambda: httpx2.MockTransport(answer)),
        ):
            lines += [
                f"## {label}",
                "",
                "| phase | floor | transport | added |",
                "|---|---:|---:|---:|",
            ]
            for phase, (f, t) in run(make, url, args.calls).items():
                lines.append(f"| {phase} | {f:.1f} | {t:.1f} | {t - f:+.1f} |")
            lines.append("")
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
