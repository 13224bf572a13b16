"""Runs the history checker (tests/history.py) over many seeds, in both modes.

``python stress_history.py --ops 1000000`` (``make stress``) runs seeds one after the
other, alternating the single-threaded mode and the threaded one, until at least
``--ops`` operations were issued; it prints each failing run's report and, at the end,
the totals ("1,000,000 operations, 0 violations") and exits 1 on any violation. A run
that hangs dumps every thread's stack and exits (faulthandler), never waits forever.
``--seeds 1 2 3 --mode single`` replays given seeds (reproduction).
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import history


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=1_000_000, help="total operations, at least")
    ap.add_argument("--per-run", type=int, default=20_000, help="operations per seed")
    ap.add_argument("--seeds", type=int, nargs="*", help="replay these seeds only")
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--mode", choices=["single", "threads", "both"], default="both")
    ap.add_argument("--hang-after", type=float, default=120.0, help="seconds per run")
    ap.add_argument("--quiet", action="store_true", help="no line per run")
    ap.add_argument("--only", nargs="*", help="draw only these operation kinds (narrow a repro)")
    ap.add_argument(
        "--shrink",
        action="store_true",
        help="single mode: for each failing seed, find the shortest failing prefix of its"
        " operations and print it whole (a minimal repro)",
    )
    ap.add_argument("--kind", help="with --shrink: look for a violation of this kind only")
    ap.add_argument(
        "--dump",
        metavar="DIR",
        help="write each failing run's report and whole operation log (threads annotated"
        " with the library's grant times) to DIR/seed-MODE.log",
    )
    a = ap.parse_args(argv)
    if a.shrink:
        only = set(a.only) if a.only else None
        return shrink(a.seeds or [a.first_seed], a.per_run, only, a.kind)

    modes = ["single", "threads"] if a.mode == "both" else [a.mode]
    plan = [(s, m) for s in a.seeds for m in modes] if a.seeds else None
    total_ops = 0
    total_violations = 0
    runs = 0
    failed: list[tuple[int, str]] = []
    counts: dict[str, int] = {}
    start = time.monotonic()
    seed = a.first_seed
    i = 0
    while True:
        if plan is not None:
            if i >= len(plan):
                break
            s, mode = plan[i]
        else:
            if total_ops >= a.ops:
                break
            s, mode = seed, modes[i % len(modes)]
            if i % len(modes) == len(modes) - 1:
                seed += 1
        i += 1
        # A hang (a deadlock, a spin holding the GIL) dumps every stack and exits.
        faulthandler.dump_traceback_later(a.hang_after * 1.5 + 5, exit=True)
        t0 = time.monotonic()
        only = set(a.only) if a.only else None
        res = history.run(s, a.per_run, mode, hang_after=a.hang_after, only=only)
        faulthandler.cancel_dump_traceback_later()
        runs += 1
        total_ops += res.ops
        for k, v in res.counts.items():
            counts[k] = counts.get(k, 0) + v
        nv = res.counts.get("violations", 0)
        total_violations += nv
        if nv:
            failed.append((s, mode))
            print(res.report(), flush=True)
            if a.dump:
                path = Path(a.dump) / f"{s}-{mode}.log"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(res.report(limit=50) + "\n" + "\n".join(res.oplog) + "\n")
                print(f"operation log: {path}", flush=True)
        elif not a.quiet:
            dt = time.monotonic() - t0
            print(f"seed={s} mode={mode}: {res.ops:,} operations, 0 violations ({dt:.1f} s)")
    elapsed = time.monotonic() - start
    checked = {k: counts.get(k, 0) for k in ("rate_grants_checked", "order_pairs_checked")}
    kinds = ", ".join(f"{k}={v:,}" for k, v in sorted(counts.items()) if k != "violations")
    print(f"outcomes: {kinds}")
    print(
        f"{total_ops:,} operations in {runs} runs, {total_violations} violations"
        f" ({total_ops / max(elapsed, 1e-9):,.0f} ops/s, {elapsed:.0f} s;"
        f" {checked['rate_grants_checked']:,} rate grants and"
        f" {checked['order_pairs_checked']:,} ordered grants checked)"
    )
    if failed:
        print(f"failing seeds: {failed}")
    return 1 if total_violations else 0


def shrink(seeds: list[int], ops: int, only: set[str] | None, kind: str | None = None) -> int:
    """The shortest failing run of each seed: a single-thread run repeats its first n
    operations exactly for any n, so a bisection on n finds the first one that breaks."""

    def fails(s: int, n: int) -> bool:
        vs = history.run(s, n, "single", only=only).violations
        return any(kind is None or v.kind == kind for v in vs)

    failed = 0
    for s in seeds:
        if not fails(s, ops):
            print(f"seed={s}: no violation in {ops} operations")
            continue
        failed += 1
        lo, hi = 0, ops  # run(lo) passes, run(hi) fails
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fails(s, mid):
                hi = mid
            else:
                lo = mid
        h = history.Single(s, only)
        history.asyncio.run(h.main(hi))
        h.check()
        print(f"seed={s}: the first {hi} operations break a promise; setup: {h.setup}")
        shown = [v for v in h.violations if kind is None or v.kind == kind]
        print("\n".join(v.format(s, "single") for v in shown[:3]))
        print("whole log:")
        print("\n".join(h.oplog))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
