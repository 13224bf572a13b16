"""The blocking acquire lifecycle, before/after in one run: each build's interpreter
(``--build LABEL=PYTHON``, e.g. a venv holding main's wheel) measures the same rows in a
subprocess, the builds interleaved round by round; each row shows its best round.

    .venv/bin/python benches/bench_lifecycle.py --build before=/tmp/base/bin/python \
        --build after=.venv/bin/python [--rounds 5] [--out benches/results/lifecycle.md]

Rows: the floor of one extension method call (``_ratequeue._Floor().noop()``); blocking
``lim.acquire()`` admitted at once (and as ``with``); ``Permit.settle(tokens=...)`` on
an idle limiter (alternating refund and charge), alone and while another Python thread
runs (a call that releases the GIL then waits to get it back); 8 threads sharing 20,000 blocking
acquires at 10,000/s, burst 10 (rate-bound: elapsed, and CPU per grant); 8 threads
sharing 20,000 ``Concurrency(2)`` acquire/release pairs (CPU-bound), beside
``threading.Semaphore(2)`` doing the same (the floor of what Python itself costs).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from _pairs import Machine, best, builds_from, per_call_us, run_rounds, threads

THREADS = 8
THREAD_GRANTS = 20_000


def _threads(work: Callable[[int], None]) -> tuple[float, float]:
    """Elapsed seconds and CPU µs per grant for THREAD_GRANTS grants over THREADS threads."""
    return threads(work, THREADS, THREAD_GRANTS)


def worker() -> dict[str, float]:
    """One round of every row in this interpreter."""
    import ratequeue as rq
    from ratequeue import _ratequeue

    out: dict[str, float] = {}
    floor = _ratequeue._Floor()
    out["floor"] = per_call_us(floor.noop)

    big = 1_000_000_000
    lim = rq.Limiter(rq.Rate(big, per="second", burst=big))
    out["acquire"] = per_call_us(lim.acquire)

    def with_acquire() -> None:
        with lim.acquire():
            pass

    out["with_acquire"] = per_call_us(with_acquire)

    tok = rq.Limiter(rq.Rate(big, per="second", burst=big, unit="tokens"))
    permit = tok.acquire(tokens=1_000)
    flip = [500, 1_000]
    i = [0]

    def settle() -> None:
        i[0] ^= 1
        permit.settle(tokens=flip[i[0]])

    out["settle"] = per_call_us(settle)

    # The same while another Python thread runs: a call that releases the GIL hands it
    # to that thread and waits to get it back.
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        out["settle_busy"] = per_call_us(settle, 50_000)
        out["floor_busy"] = per_call_us(floor.noop, 50_000)
    finally:
        stop.set()
        spinner.join()

    rated = rq.Limiter(rq.Rate(10_000, per="second", burst=10))

    def rated_work(n: int) -> None:
        for _ in range(n):
            rated.acquire()

    out["rate_threads_s"], out["rate_threads_cpu"] = _threads(rated_work)

    conc = rq.Concurrency(2)

    def conc_work(n: int) -> None:
        for _ in range(n):
            with conc.acquire():
                pass

    elapsed, cpu = _threads(conc_work)
    out["conc_threads_us"], out["conc_threads_cpu"] = elapsed / THREAD_GRANTS * 1e6, cpu

    sem = threading.Semaphore(2)

    def sem_work(n: int) -> None:
        for _ in range(n):
            with sem:
                pass

    elapsed, cpu = _threads(sem_work)
    out["sem_threads_us"], out["sem_threads_cpu"] = elapsed / THREAD_GRANTS * 1e6, cpu
    return out


ROWS = [
    ("floor", "`_Floor().noop()` (floor: one extension method call)", "µs/call"),
    ("acquire", "`lim.acquire()`, admitted at once", "µs/call"),
    ("with_acquire", "`with lim.acquire(): pass`, admitted at once", "µs/call"),
    ("settle", "`permit.settle(tokens=...)`, idle limiter (refund, then charge)", "µs/call"),
    ("floor_busy", "`_Floor().noop()`, another Python thread running (floor)", "µs/call"),
    ("settle_busy", "`permit.settle(tokens=...)`, another Python thread running", "µs/call"),
    ("rate_threads_s", "8 threads, 20,000 `acquire()`, 10,000/s burst 10: elapsed (ideal 2)", "s"),
    ("rate_threads_cpu", "(same) CPU per grant", "µs"),
    ("conc_threads_us", "8 threads, 20,000 `with Concurrency(2).acquire()`: wall/grant", "µs"),
    ("conc_threads_cpu", "(same) CPU per grant", "µs"),
    ("sem_threads_us", "8 threads, 20,000 `with threading.Semaphore(2)` (floor): wall/grant", "µs"),
    ("sem_threads_cpu", "(same) CPU per grant", "µs"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--build", action="append", default=[], help="LABEL=PYTHON (repeatable)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker()))
        return
    builds = builds_from(a.build, this=None) or [("this build", sys.executable)]
    machine = Machine()
    t0 = time.perf_counter()
    runs = run_rounds(__file__, builds, a.rounds, {"": ["--worker"]})[""]
    best_of = {label: best(r) for label, r in runs.items()}
    labels = [label for label, _ in builds]
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Blocking acquire lifecycle: before/after",
        "",
        f"Generated by `benches/bench_lifecycle.py` on {when}: {machine.summary()}; "
        f"{a.rounds} interleaved rounds, best round per row; total "
        f"{time.perf_counter() - t0:.0f} s. "
        f"Builds: {', '.join(f'{label} = `{p}`' for label, p in builds)}.",
        "",
        "| row | unit | " + " | ".join(labels) + (" | ratio |" if len(labels) == 2 else ""),
        "|---|---|" + "--:|" * len(labels) + ("--:|" if len(labels) == 2 else ""),
    ]
    for key, what, unit in ROWS:
        vals = [best_of[label][key] for label in labels]
        cells = " | ".join(f"{v:.3f}" for v in vals)
        ratio = f" | {vals[1] / vals[0]:.2f}x |" if len(vals) == 2 else ""
        lines.append(f"| {what} | {unit} | {cells}{ratio}")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
