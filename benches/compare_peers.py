"""Cost of one admitted rate-limit decision: ratequeue against the peers users pick today.

Every candidate is configured so that it admits every call (limits far above what one
Python thread can reach), so the table compares the price of a *decision*, not of a
refusal or a wait. Everything runs in ONE process, in interleaved rounds
(A B C ... A B C ...): each round times one batch of every candidate, so slow drifts of
the machine (a shared 2-core VM) hit every candidate alike. Per candidate we report the
min and the median over rounds of ns/call, calls/s at the median, and the ratio of its
median to ratequeue's.

Each timed batch is a plain ``for`` loop over the statement shown in the table (the
objects it names are locals of the timing function, as with ``timeit``), with the cyclic
GC off during the batch. The loop's own cost is in every figure; the "empty loop" row
measures it so that it can be subtracted by hand.

Usage::

    .venv/bin/python benches/compare_peers.py [--rounds 31] [--target-ms 20] [--out PATH]

Peers are optional: a peer that is not importable gets a row saying so. Install them
with ``.venv/bin/pip install "ratequeue[bench]"`` (or the names listed there).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib.metadata
import inspect
import os
import platform
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "compare_peers.md"

# Comfortably above anything one thread can do in a second, so every call is admitted.
HUGE = 10**9
KEY = "bench"


@dataclass
class Candidate:
    """One timed statement and what it needs."""

    name: str
    stmt: str
    env: dict[str, Any]
    config: str
    # One extra call, outside the timing, that must say "admitted".
    check: Callable[[], bool] | None = None
    # Run after each batch, outside the timing (e.g. wait for a peer's timer thread).
    settle: Callable[[], None] | None = None
    kind: str = "peer"  # "ratequeue" | "floor" | "peer"
    # Said after the run, in the configuration notes (e.g. a state size reached).
    after: Callable[[], str] | None = None
    timer: timeit.Timer = field(init=False, repr=False)
    number: int = 0
    samples: list[float] = field(default_factory=list)
    refused: int = 0

    def __post_init__(self) -> None:
        setup = "\n".join(f"{k} = __env[{k!r}]" for k in self.env) or "pass"
        self.timer = timeit.Timer(
            self.stmt, setup=setup, timer=time.perf_counter_ns, globals={"__env": self.env}
        )

    def batch(self, number: int) -> float:
        """ns per call over one batch of ``number`` calls."""
        ns = self.timer.timeit(number) / number
        if self.settle is not None:
            self.settle()
        if self.check is not None and not self.check():
            self.refused += 1
        return ns


@dataclass
class Skipped:
    name: str
    reason: str


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


# --------------------------------------------------------------------------- candidates


def ratequeue_candidates() -> list[Candidate]:
    import ratequeue as rq

    # 1e9 per second (one unit per ns, the fastest rate ratequeue supports) with a burst
    # of 1e9: a call costs 1 ns of capacity and takes far longer than 1 ns, so the bucket
    # never empties.
    lim = rq.Limiter(rq.Rate(1e9, per="second", burst=HUGE))
    v = version("ratequeue")
    return [
        Candidate(
            f"ratequeue {v} try_acquire",
            "lim.try_acquire()",
            {"lim": lim},
            "Rate(1e9, per='second', burst=1e9), monotonic clock",
            check=lim.try_acquire,
            kind="ratequeue",
        ),
        Candidate(
            "floor: ratequeue _noop",
            "floor.noop()",
            {"floor": rq._ratequeue._Floor()},
            "no-op method of the same extension object: the floor of a method call",
            kind="floor",
        ),
        Candidate(
            "reference: dict.get",
            "d.get(k)",
            {"d": {KEY: 1}, "k": KEY},
            "a C-level method call that does a little work",
            kind="floor",
        ),
        Candidate(
            "reference: empty loop",
            "pass",
            {},
            "the timing loop alone (included in every row)",
            kind="floor",
        ),
    ]


def token_bucket_candidates() -> list[Candidate]:
    import token_bucket

    # rate 1e9 tokens/s, capacity 1e9 tokens, in-process MemoryStorage, one key.
    tb = token_bucket.Limiter(1e9, HUGE, token_bucket.MemoryStorage())
    return [
        Candidate(
            f"token-bucket {version('token-bucket')} consume",
            "tb.consume(key)",
            {"tb": tb, "key": KEY},
            "Limiter(rate=1e9, capacity=1e9, MemoryStorage()), one key",
            check=lambda: tb.consume(KEY),
        )
    ]


def limits_candidates() -> list[Candidate]:
    from limits import RateLimitItemPerSecond
    from limits.storage import MemoryStorage
    from limits.strategies import FixedWindowRateLimiter, MovingWindowRateLimiter

    # 1e9 hits per 1-second window; each strategy gets its own MemoryStorage. While hits
    # arrive, the storage starts a threading.Timer (a new thread) every 10 ms to expire
    # old entries: that thread start and its GIL hand-offs are part of what a hit costs
    # (and make it sensitive to load on the other core). The timer is joined after each
    # batch so it never runs inside another candidate's batch.
    item = RateLimitItemPerSecond(HUGE)
    v = version("limits")
    timer_note = "; MemoryStorage starts a Timer thread every 10 ms while hits arrive"
    out = []
    for label, cls, note in (
        ("FixedWindow", FixedWindowRateLimiter, timer_note),
        (
            "MovingWindow",
            MovingWindowRateLimiter,
            timer_note + "; keeps one entry per hit of the last second and prepends each"
            " new one to a list, so a hit costs more the more hits the window holds",
        ),
    ):
        storage = MemoryStorage()
        strategy = cls(storage)
        peak = [0]

        def settle(storage: Any = storage, peak: list[int] = peak) -> None:
            held = max((len(e) for e in storage.events.values()), default=0)
            peak[0] = max(peak[0], held)
            storage.timer.join()

        def after(peak: list[int] = peak) -> str:
            return f"entries held in the window after a batch: up to {peak[0]:,}"

        out.append(
            Candidate(
                f"limits {v} {label} hit",
                "lim.hit(item, key)",
                {"lim": strategy, "item": item, "key": KEY},
                f"{cls.__name__}(MemoryStorage()), RateLimitItemPerSecond(1e9){note}",
                check=lambda strategy=strategy: strategy.hit(item, KEY),
                settle=settle,
                after=after if cls is MovingWindowRateLimiter else None,
            )
        )
    return out


def pyrate_candidates() -> list[Candidate]:
    import pyrate_limiter as pl

    v = version("pyrate-limiter")
    # v4 blocks by default when full; blocking=False keeps "never waits" (as ratequeue's
    # try_acquire). v3 has no such argument (and never waits unless max_delay is set).
    nonblocking = "blocking" in inspect.signature(pl.Limiter.try_acquire).parameters
    call = "lim.try_acquire(key, blocking=False)" if nonblocking else "lim.try_acquire(key)"
    kw = {"blocking": False} if nonblocking else {}

    # The default Limiter(Rate): an InMemoryBucket (sliding-window log, one item per
    # admitted call, trimmed by a background leaker thread every 10 s).
    default = pl.Limiter(pl.Rate(HUGE, pl.Duration.SECOND))
    out = [
        Candidate(
            f"pyrate-limiter {v} try_acquire",
            call,
            {"lim": default, "key": KEY},
            "Limiter(Rate(1e9, Duration.SECOND)): default InMemoryBucket (sliding-window log)",
            check=lambda: default.try_acquire(KEY, **kw) is True,
        )
    ]
    # v4 also has constant-state buckets; GCRA is ratequeue's algorithm.
    if hasattr(pl, "StateBucket") and hasattr(pl, "GCRA"):
        gcra = pl.Limiter(pl.StateBucket([pl.Rate(HUGE, pl.Duration.SECOND)], algorithm=pl.GCRA()))
        out.append(
            Candidate(
                f"pyrate-limiter {v} try_acquire (GCRA)",
                call,
                {"lim": gcra, "key": KEY},
                "Limiter(StateBucket([Rate(1e9, Duration.SECOND)], algorithm=GCRA()))",
                check=lambda: gcra.try_acquire(KEY, **kw) is True,
            )
        )
    return out


def throttled_candidates() -> list[Candidate]:
    import throttled

    v = version("throttled-py")
    out = []
    for algo in ("gcra", "token_bucket"):
        # quota 1e9/s with burst 1e9, a private MemoryStore, timeout None (non-blocking).
        th = throttled.Throttled(
            key=KEY,
            using=algo,
            quota=throttled.per_sec(HUGE, burst=HUGE),
            store=throttled.MemoryStore(),
        )
        out.append(
            Candidate(
                f"throttled-py {v} limit ({algo})",
                "th.limit()",
                {"th": th},
                f"Throttled(key, using={algo!r}, quota=per_sec(1e9, burst=1e9),"
                " store=MemoryStore())",
                check=lambda th=th: not th.limit().limited,
            )
        )
    return out


PEERS: list[tuple[str, Callable[[], list[Candidate]]]] = [
    ("token-bucket", token_bucket_candidates),
    ("limits", limits_candidates),
    ("pyrate-limiter", pyrate_candidates),
    ("throttled-py", throttled_candidates),
]


# --------------------------------------------------------------------------- running


def calibrate(c: Candidate, target_ns: float) -> None:
    """Pick the batch size that takes about ``target_ns``; also warms the candidate up."""
    # A first call may pay one-off costs (ratequeue's first clock read calibrates the
    # TSC, about 0.6 ms): keep it out of the estimate.
    c.timer.timeit(1)
    if c.settle is not None:
        c.settle()
    n = 1
    while True:
        took = c.timer.timeit(n)
        if c.settle is not None:
            c.settle()
        if took >= target_ns / 10 or n >= 10**8:
            break
        n *= 4
    c.number = max(10, int(n * target_ns / max(took, 1)))
    c.batch(c.number)  # one full warm-up batch, discarded


def run(cands: list[Candidate], rounds: int, target_ms: float) -> None:
    for c in cands:
        calibrate(c, target_ms * 1e6)
    for _ in range(rounds):
        for c in cands:  # A B C ... in the same order every round
            c.samples.append(c.batch(c.number))
        gc.collect()  # between rounds, never inside a batch


def fmt_ns(ns: float) -> str:
    return f"{ns:,.1f}" if ns < 1000 else f"{ns:,.0f}"


def fmt_rate(per_s: float) -> str:
    if per_s >= 1e6:
        return f"{per_s / 1e6:.2f} M"
    return f"{per_s / 1e3:.0f} k"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}"


def cpu_ticks() -> tuple[float, float] | None:
    """(busy seconds of all CPUs from /proc/stat, this process's CPU seconds), or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    hz = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / hz, time.process_time()


def other_load(before: tuple[float, float] | None, wall_s: float) -> str:
    """How busy other processes kept the machine while we ran (shared machines)."""
    after = cpu_ticks()
    if before is None or after is None or wall_s <= 0:
        return "unknown"
    others = max(0.0, (after[0] - before[0]) - (after[1] - before[1]))
    return f"{100 * others / wall_s:.0f}% of one core on average"


def build_info() -> str:
    """The ratequeue build measured: its extension file's time and the repo's HEAD."""
    import subprocess

    import ratequeue

    parts = [f"ratequeue {version('ratequeue')}"]
    ext = getattr(getattr(ratequeue, "_ratequeue", None), "__file__", None)
    if ext:
        built = dt.datetime.fromtimestamp(Path(ext).stat().st_mtime).astimezone()
        parts.append(f"extension built {built.isoformat(timespec='seconds')}")
    try:
        repo = Path(__file__).resolve().parent.parent
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        parts.append(f"repo HEAD {head}")
    except (OSError, subprocess.SubprocessError):
        pass
    return ", ".join(parts)


def report(
    cands: list[Candidate],
    skipped: list[Skipped],
    rounds: int,
    target_ms: float,
    load: str = "unknown",
) -> str:
    rq = next(c for c in cands if c.kind == "ratequeue")
    rq_med = statistics.median(rq.samples)
    rq_min = min(rq.samples)
    lines = [
        "# ratequeue vs peers: cost of one admitted decision",
        "",
        f"- date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- machine: {machine()}",
        f"- python: {platform.python_implementation()} {platform.python_version()}",
        f"- build: {build_info()}",
        f"- CPU used by other processes during the run: {load}",
        f"- method: one process, {rounds} interleaved rounds (A B C ... A B C ...), one batch"
        f" of ~{target_ms:g} ms per candidate per round, GC off inside a batch;"
        " ns/call includes the timing loop (see the empty-loop row)",
        "- ratio = candidate's median ns/call / ratequeue try_acquire's median"
        " (> 1: slower than ratequeue)",
        "",
        "| candidate | call timed | min ns/call | median ns/call | calls/s (median)"
        " | ratio vs ratequeue (median) | ratio (min) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for c in cands:
        med, lo = statistics.median(c.samples), min(c.samples)
        name = c.name + (f" **(refused {c.refused}x!)**" if c.refused else "")
        lines.append(
            f"| {name} | `{c.stmt}` | {fmt_ns(lo)} | {fmt_ns(med)} | {fmt_rate(1e9 / med)}"
            f" | {med / rq_med:.2f} | {lo / rq_min:.2f} |"
        )
    for s in skipped:
        lines.append(f"| {s.name} | skipped: {s.reason} | | | | | |")

    lines += ["", "## Targets", ""]
    noop = next((c for c in cands if c.name.startswith("floor: ratequeue _noop")), None)
    loop = next((c for c in cands if c.stmt == "pass"), None)
    tb = next((c for c in cands if c.name.startswith("token-bucket")), None)
    if tb is not None:
        x = statistics.median(tb.samples) / rq_med
        verdict = "met" if x >= 8 else "NOT met"
        lines.append(
            f"- try_acquire calls/s ≥ 8x token-bucket consume: {x:.2f}x (median) → {verdict}"
        )
    else:
        lines.append("- try_acquire calls/s ≥ 8x token-bucket consume: token-bucket not run")
    if noop is not None:
        noop_med = statistics.median(noop.samples)
        x = rq_med / noop_med
        verdict = "met" if x <= 2 else "NOT met"
        extra = ""
        if loop is not None:
            loop_med = statistics.median(loop.samples)
            net = (rq_med - loop_med) / max(noop_med - loop_med, 1e-9)
            extra = f"; without the loop's {loop_med:.1f} ns: {net:.2f}x"
        lines.append(f"- try_acquire within 2x of _noop: {x:.2f}x (median){extra} → {verdict}")

    lines += ["", "## What each candidate was configured with", ""]
    for c in cands:
        after = f" ({c.after()})" if c.after is not None else ""
        lines.append(f"- **{c.name}**: {c.config}{after}")
    for s in skipped:
        lines.append(f"- **{s.name}**: skipped ({s.reason})")
    lines += [
        "",
        "Not in the table: aiolimiter and asyncio-throttle (also in the `bench` extra) are"
        " asyncio-only (`async with`) and have no synchronous admit-or-refuse call to compare.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--target-ms", type=float, default=20.0, help="length of one batch")
    ap.add_argument("--out", type=Path, default=RESULTS, help="markdown file to write")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)

    try:
        cands = ratequeue_candidates()
    except ImportError as e:
        print(f"ratequeue is not importable ({e}); build it first (make build)", file=sys.stderr)
        return 2
    skipped: list[Skipped] = []
    for name, make in PEERS:
        try:
            cands += make()
        except ImportError as e:
            skipped.append(Skipped(name, f"not importable ({e})"))

    before, t0 = cpu_ticks(), time.perf_counter()
    run(cands, args.rounds, args.target_ms)
    load = other_load(before, time.perf_counter() - t0)
    text = report(cands, skipped, args.rounds, args.target_ms, load)
    print(text)
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"(written to {args.out})", file=sys.stderr)
    return 1 if any(c.refused for c in cands) else 0


if __name__ == "__main__":
    sys.exit(main())
