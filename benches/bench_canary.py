"""What rq.Canary adds to a call: routed, shadowed, asyncio, through httpx; and a gate check.

Measured in ONE process in interleaved rounds (A B C ... A B C ...), so drifts of the
machine (a shared 2-core VM) hit every candidate alike. Each pair has its floor, the
same work without the canary:

* ``arm(request)`` called directly (a function returning a ``Reply``) against
  ``canary.call(key, request)``: hash the user key, route, time the call, book it in the
  arm's histograms and counters (the gates are checked once a second, amortised);
* the same in shadow mode: the caller also hands a copy to the shadow threads (the
  copies' own work runs off the caller's path and is drained between batches);
* ``await arm(request)`` against ``await canary.call_async(key, request)``;
* ``client.post`` through ``httpx.MockTransport`` against the same through
  ``CanaryTransport`` (routing by the ``x-user-id`` header, usage read from the JSON);
* ``canary.bucket(key)`` alone, and ``canary.check()`` (every default gate, with
  thousands of samples per arm: the work of one periodic check, off the request path).

No peer library is named for this part: the floors are what Python, asyncio and httpx
cost for the same call.

Usage::

    .venv/bin/python benches/bench_canary.py [--rounds 15] [--no-write] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from ratequeue.canary import Canary, Reply
from ratequeue.canary.transport import CanaryTransport

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benches" / "results" / "canary.md"


@dataclass
class Row:
    name: str
    timed: str
    body: Callable[[int], object]  # runs `number` calls itself
    number: int = 20_000
    floor: str | None = None
    after: Callable[[], object] | None = None
    samples: list[float] = field(default_factory=list)

    def batch(self) -> None:
        gc.disable()
        try:
            t0 = time.perf_counter_ns()
            self.body(self.number)
            ns = time.perf_counter_ns() - t0
        finally:
            gc.enable()
        self.samples.append(ns / self.number)
        if self.after is not None:
            self.after()


def arm(request: Any) -> Reply:
    return Reply(request, tokens=100)


async def aarm(request: Any) -> Reply:
    return Reply(request, tokens=100)


def _rows() -> list[Row]:
    keys = [f"user-{i}" for i in range(1024)]
    routed = Canary(arm, arm, stages=(0.2,))
    shadow = Canary(arm, arm, stages=(0.2,), shadow=True, max_shadow=10**6)
    aio = Canary(aarm, aarm, stages=(0.2,))

    def direct(n: int) -> None:
        for i in range(n):
            arm(i)

    def via(c: Canary) -> Callable[[int], None]:
        def run(n: int) -> None:
            call = c.call
            for i in range(n):
                call(keys[i & 1023], i)

        return run

    def drain() -> None:
        while shadow._runner.pending:
            time.sleep(0.001)

    loop = asyncio.new_event_loop()

    def adirect(n: int) -> None:
        async def go() -> None:
            for i in range(n):
                await aarm(i)

        loop.run_until_complete(go())

    def acanary(n: int) -> None:
        async def go() -> None:
            call = aio.call_async
            for i in range(n):
                await call(keys[i & 1023], i)

        loop.run_until_complete(go())

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"usage": {"total_tokens": 10}})

    plain = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://llm")
    routed_tp = Canary(arm, arm, stages=(0.2,))
    wrapped = httpx.Client(
        transport=CanaryTransport(
            routed_tp, httpx.MockTransport(handler), httpx.MockTransport(handler)
        ),
        base_url="http://llm",
    )

    def post(client: httpx.Client) -> Callable[[int], None]:
        def run(n: int) -> None:
            for i in range(n):
                client.post("/v1/chat", content=b"{}", headers={"x-user-id": keys[i & 1023]})

        return run

    full = Canary(arm, arm, stages=(0.5,))
    for i in range(20_000):
        full.call(keys[i & 1023], i)

    def bucket(n: int) -> None:
        b = routed.bucket
        for i in range(n):
            b(keys[i & 1023])

    def check(n: int) -> None:
        for _ in range(n):
            full.check()

    return [
        Row("floor: arm", "`arm(request)` directly", direct),
        Row("routed", "`canary.call(key, request)`", via(routed), floor="floor: arm"),
        Row(
            "shadowed",
            "`canary.call(key, request)`, shadow=True, every user copied",
            via(shadow),
            floor="floor: arm",
            after=drain,
        ),
        Row("floor: await arm", "`await arm(request)`", adirect),
        Row(
            "routed async",
            "`await canary.call_async(key, request)`",
            acanary,
            floor="floor: await arm",
        ),
        Row("floor: httpx", "`client.post` over `httpx.MockTransport`", post(plain), 2_000),
        Row(
            "httpx routed",
            "`client.post` over `CanaryTransport` (two MockTransports)",
            post(wrapped),
            2_000,
            floor="floor: httpx",
        ),
        Row("hash", "`canary.bucket(key)`", bucket),
        Row("gate check", "`canary.check()` (7 default gates, 20,000 samples)", check, 200),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    load = os.getloadavg()
    rows = _rows()
    for r in rows:
        r.batch()  # warm-up
        r.samples.clear()
    for _ in range(args.rounds):
        for r in rows:
            r.batch()
    by_name = {r.name: statistics.median(r.samples) for r in rows}
    lines = [
        "# Canary: cost per routed and shadowed call",
        "",
        f"Generated by `benches/bench_canary.py` on {dt.date.today().isoformat()}.",
        "",
        f"- machine: {platform.processor() or platform.machine()}, Linux {platform.release()}"
        f" (shared 2-core VM); python: CPython {platform.python_version()}",
        f"- load average before the run: {load[0]:.1f} (other sessions on the same 2 cores:"
        " absolute figures are noisy, differences and ratios less so)",
        f"- rounds: {args.rounds} interleaved; min and median ns per call over rounds;"
        " added = median minus its floor's median",
        "- no peer library is named for this part; each floor is the same call without the"
        " canary (Python, asyncio, httpx themselves)",
        "",
        "| row | timed | min ns/call | median ns/call | added ns/call | ratio to floor |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        med = by_name[r.name]
        if r.floor is not None:
            f = by_name[r.floor]
            added, ratio = f"{med - f:.0f}", f"{med / f:.2f}"
        else:
            added = ratio = ""
        lines.append(
            f"| {r.name} | {r.timed} | {min(r.samples):.0f} | {med:.0f} | {added} | {ratio} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
