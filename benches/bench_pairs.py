"""Before/after pairs on a loaded machine, in CPU time (issue 13).

Two harnesses, each run by one interpreter per build (``--python`` for the other build,
e.g. a wrapper that puts a copy of main's package first on ``PYTHONPATH``); the builds
alternate, and every figure is CPU time of the measuring process, which a descheduled
process does not accrue::

    .venv/bin/python benches/bench_pairs.py --python before=/path/to/python [--pairs 4]

- gather: 100,000 tasks created at once by ``asyncio.gather``, one acquire each at
  50,000/s, burst 10 (the harness of ``bench_waiting.py`` section 0), as a pair in one
  process: the one-wake floor (a future resolved by ``loop.call_soon``) then ratequeue;
  "above" = ratequeue's CPU per grant minus the floor's of the same pair.
- keyed: first-time uint64 keys, ``KeyedLimiter.try_acquire_many`` over 1,000,000 keys
  in batches of 65,536 (``time.process_time``, OpenBLAS held to one thread).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
from pathlib import Path

from _pairs import Machine, builds_from, run_rounds

N_TASKS = 100_000
N_KEYS = 1_000_000
GOLDEN = 0x9E3779B97F4A7C15


async def _gather(which: str) -> float:
    import ratequeue as rq

    loop = asyncio.get_running_loop()
    if which == "rq":
        acq = rq.Limiter(rq.Rate(50_000, per="second", burst=10)).acquire_async
    else:

        def acq() -> asyncio.Future[None]:
            f = loop.create_future()
            loop.call_soon(f.set_result, None)
            return f

    async def task() -> None:
        await acq()

    gc.collect()
    c0 = time.process_time()
    await asyncio.gather(*(task() for _ in range(N_TASKS)))
    return (time.process_time() - c0) / N_TASKS * 1e6


def _keyed() -> float:
    import numpy as np
    import ratequeue as rq

    g = np.uint64(GOLDEN)
    kl = rq.KeyedLimiter(rq.Rate(10**9, per="second", burst=10**9))
    kl.try_acquire_many(np.arange(10**7, 10**7 + 1000, dtype=np.uint64) * g)
    keys = np.arange(N_KEYS, dtype=np.uint64) * g
    c0 = time.process_time()
    for i in range(0, N_KEYS, 65_536):
        kl.try_acquire_many(keys[i : i + 65_536])
    return N_KEYS / (time.process_time() - c0) / 1e6


def child(what: str) -> None:
    if what == "gather":
        floor = asyncio.run(_gather("floor"))
        ours = asyncio.run(_gather("rq"))
        print(json.dumps({"floor": floor, "rq": ours}), flush=True)
    else:
        print(json.dumps({"keyed": _keyed()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", action="append", default=[], metavar="LABEL=PYTHON")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--child", choices=["gather", "keyed"], help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    builds = builds_from(args.python)
    machine = Machine()
    got = run_rounds(
        __file__,
        builds,
        args.pairs,
        {what: ["--child", what] for what in ("gather", "keyed")},
        env={"OPENBLAS_NUM_THREADS": "1"},
        cwd="/",
    )
    lines = [
        "# Before/after pairs in CPU time (`benches/bench_pairs.py`)",
        "",
        f"{args.pairs} alternating runs per build; {machine.summary()}. Builds: "
        + "; ".join(f"{label}: `{python}`" for label, python in builds)
        + ".",
        "",
        "| build | gather: one-wake floor µs/grant | ratequeue µs/grant | above the floor µs"
        " (each pair) | median above | keyed first-time uint64 keys M/s (each run) |",
        "|---|--:|--:|---|--:|---|",
    ]
    for label, _ in builds:
        g = got["gather"][label]
        above = [r["rq"] - r["floor"] for r in g]
        keyed = [r["keyed"] for r in got["keyed"][label]]
        lines.append(
            f"| {label} | {statistics.median(r['floor'] for r in g):.1f} "
            f"| {statistics.median(r['rq'] for r in g):.1f} "
            f"| {', '.join(f'{a:.1f}' for a in above)} | {statistics.median(above):.1f} "
            f"| {', '.join(f'{x:.1f}' for x in keyed)} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
