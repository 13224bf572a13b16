"""What an immediate grant costs: ``Limiter.acquire``, ``Permit.settle``, ``acquire_async``
and the Policy equivalents, as the LLM transport calls them, in instructions per call.

Each row runs ``--calls`` times in a tight loop between two callgrind client requests
(zero, then dump), so start-up and imports are not counted and the machine's load changes
nothing; the loop's own cost (a Python call of an empty function, or an empty ``for`` in
a coroutine for the ``await`` rows) is subtracted. Floor rows: ``lim.try_acquire()`` (the
fastest decision) and a no-op method of a native class. ``--build NAME=DIR`` (repeatable)
runs the rows once per build, DIR being a ``python/`` directory holding a ``ratequeue``
package with its native module (e.g. a checkout of main beside main's ``.so``)::

    .venv/bin/python benches/profile_acquire.py --build before=/tmp/main/python \\
        --build after=python [--calls 2000] [--out FILE] [--keep DIR]

``--keep DIR`` keeps the callgrind files (one per row and build: ``callgrind_annotate
--inclusive=yes DIR/NAME.out.N`` shows where a row's instructions go).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HELPER = """#include <valgrind/callgrind.h>
void cg_zero(void){ CALLGRIND_ZERO_STATS; }
void cg_dump(const char* s){ CALLGRIND_DUMP_STATS_AT(s); }
"""


def rows() -> list[tuple[str, Callable[[int], Any]]]:
    """(name, run n times) per row; names in parentheses are set-up rows, not printed."""
    import ratequeue as rq

    def roomy() -> Any:
        # bench_transport.roomy(): a limiter that never makes a call wait.
        return rq.Limiter(
            rq.Rate(10**9, per="minute", burst=10**6),
            rq.Rate(10**10, per="minute", burst=10**9, unit="tokens"),
        )

    lim = roomy()
    one = rq.Limiter(rq.Rate(10**9, per="minute", burst=10**6))
    pol = rq.Policy({"llm": roomy()})
    held = lim.acquire(requests=1, tokens=500)
    pheld = pol.acquire(requests=1, tokens=500)

    def loop(f: Callable[[], Any]) -> Callable[[int], Any]:
        def run(n: int) -> None:
            for _ in range(n):
                f()

        return run

    def nothing() -> None:
        pass

    def drive(coro: Any) -> Any:
        try:
            coro.send(None)
        except StopIteration as e:
            return e.value
        raise RuntimeError("an immediate grant suspended")

    async def async_floor(n: int) -> None:
        for _ in range(n):
            pass

    async def async_acquire(n: int) -> None:
        for _ in range(n):
            await lim.acquire_async(requests=1, tokens=500)

    async def async_acquire_settle(n: int) -> None:
        for _ in range(n):
            p = await lim.acquire_async(requests=1, tokens=500)
            p.settle(tokens=300)

    async def policy_async(n: int) -> None:
        for _ in range(n):
            await pol.acquire_async(requests=1, tokens=500)

    def settle_twice() -> None:
        held.settle(tokens=300)
        held.settle(tokens=500)

    def policy_settle_twice() -> None:
        pheld.settle(tokens=300)
        pheld.settle(tokens=500)

    return [
        ("(the loop itself)", loop(nothing)),
        ("the loop itself", loop(nothing)),
        ("floor: no-op method (Permit.__enter__)", loop(lambda: held.__enter__())),
        ("floor: one-unit lim.try_acquire()", loop(lambda: one.try_acquire())),
        (
            "lim.try_acquire(requests=1, tokens=500)",
            loop(lambda: lim.try_acquire(requests=1, tokens=500)),
        ),
        ("lim.acquire(requests=1, tokens=500)", loop(lambda: lim.acquire(requests=1, tokens=500))),
        ("one-unit lim.acquire(requests=1)", loop(lambda: one.acquire(requests=1))),
        ("one-unit lim.acquire()", loop(lambda: one.acquire())),
        (
            "lim.acquire(requests=1, tokens=500, timeout=30.0)",
            loop(lambda: lim.acquire(requests=1, tokens=500, timeout=30.0)),
        ),
        (
            "lim.acquire(...) + permit.settle(tokens=300)",
            loop(lambda: lim.acquire(requests=1, tokens=500).settle(tokens=300)),
        ),
        ("2 x permit.settle(tokens=...) (300, then 500)", loop(settle_twice)),
        ("pol.acquire(requests=1, tokens=500)", loop(lambda: pol.acquire(requests=1, tokens=500))),
        (
            "pol.acquire(...) + permit.settle(tokens=300)",
            loop(lambda: pol.acquire(requests=1, tokens=500).settle(tokens=300)),
        ),
        ("2 x policy permit.settle(tokens=...) (300, then 500)", loop(policy_settle_twice)),
        ("the await loop itself", lambda n: drive(async_floor(n))),
        ("await lim.acquire_async(requests=1, tokens=500)", lambda n: drive(async_acquire(n))),
        (
            "await lim.acquire_async(...) + settle(tokens=300)",
            lambda n: drive(async_acquire_settle(n)),
        ),
        ("await pol.acquire_async(requests=1, tokens=500)", lambda n: drive(policy_async(n))),
    ]


def child(lib_path: str, n: int) -> None:
    lib = ctypes.CDLL(lib_path)
    asyncio.get_event_loop_policy()  # imported before counting
    for name, run in rows():
        run(100)
        gc.collect()
        lib.cg_zero()
        run(n)
        lib.cg_dump(name.encode())


def measure(lib: str, pythonpath: str, calls: int, out: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": pythonpath}
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
            str(calls),
        ],
        env=env,
        capture_output=True,
        check=True,
    )
    per: dict[str, float] = {}
    for f in sorted(out.parent.glob(out.name + ".*"), key=lambda p: int(p.suffix[1:])):
        text = f.read_text(errors="replace")
        name = next(x for x in text.splitlines() if x.startswith("desc: Trigger"))
        total = next(x for x in text.splitlines() if x.startswith("totals:"))
        per[name.split("Client Request: ", 1)[1]] = int(total.split()[1]) / calls
    loop, aloop = per["the loop itself"], per["the await loop itself"]
    return {
        k: v - (aloop if k.startswith("await ") else loop)
        for k, v in per.items()
        if k[0] != "(" and "loop itself" not in k
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--build", action="append", default=[], help="NAME=DIR (python/ dir)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--keep", type=Path, help="keep the callgrind files here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.calls)
        return
    builds = [b.split("=", 1) for b in args.build] or [
        ["now", str(Path(__file__).parents[1] / "python")]
    ]
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "cg.c").write_text(HELPER)
        lib = str(Path(d) / "libcg.so")
        subprocess.run(
            ["cc", "-O1", "-shared", "-fPIC", "-o", lib, str(Path(d) / "cg.c")], check=True
        )
        res = {}
        for name, path in builds:
            out = Path(d) / f"{name}.out"
            res[name] = measure(lib, str(Path(path).resolve()), args.calls, out)
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                for f in Path(d).glob(f"{name}.out.*"):
                    shutil.copy(f, args.keep / f.name)
    names = [b[0] for b in builds]
    lines = [
        f"`benches/profile_acquire.py --calls {args.calls}` (callgrind, PYTHONHASHSEED=0; "
        f"instructions per call, the loop subtracted), load {os.getloadavg()[0]:.2f}",
        "",
        "| row | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for row in res[names[0]]:
        lines.append(
            f"| {row} | "
            + " | ".join(f"{res[n].get(row, float('nan')):,.0f}" for n in names)
            + " |"
        )
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
