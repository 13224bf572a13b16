"""Limiter.try_acquire() before/after the residue2 change (its take guarded by
WaitQueue::fast_take), in CPU time, builds alternating, with the floor in the same run.

    .venv/bin/python benches/bench_residue2.py --python main=/path/to/python [--rounds 6]

Each round runs one child per build; a child times N admitted ``try_acquire()`` calls and
N calls of a no-op bound builtin method (``(7).bit_length()``, the floor: what Python
itself costs per call) with ``time.process_time`` (a descheduled process accrues none).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

N = 2_000_000


def child() -> None:
    import ratequeue as rq

    lim = rq.Limiter(rq.Rate(10**9, per="second", burst=10**15), clock=rq.ManualClock())
    call = lim.try_acquire
    floor = (7).bit_length
    out = {}
    for name, f in (("floor", floor), ("try_acquire", call)):
        t0 = time.process_time()
        for _ in range(N):
            f()
        out[name] = (time.process_time() - t0) / N * 1e9
    assert call() is True
    print(json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", action="append", default=[], metavar="LABEL=PYTHON")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child()
        return
    builds = [("this build", sys.executable)] + [tuple(p.split("=", 1)) for p in a.python]
    got: dict[str, list[dict[str, float]]] = {label: [] for label, _ in builds}
    for r in range(a.rounds):
        order = builds if r % 2 == 0 else builds[::-1]
        for label, py in order:
            cmd = [py, __file__, "--child"]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            got[label].append(json.loads(res.stdout))
    print(f"{a.rounds} alternating rounds, {N:,} calls each; CPU ns per call (median)\n")
    print("| build | floor `(7).bit_length()` | `Limiter.try_acquire()` | above the floor |")
    print("|---|--:|--:|--:|")
    for label, _ in builds:
        fl = statistics.median(x["floor"] for x in got[label])
        ta = statistics.median(x["try_acquire"] for x in got[label])
        print(f"| {label} | {fl:.1f} | {ta:.1f} | {ta - fl:.1f} |")


if __name__ == "__main__":
    main()
