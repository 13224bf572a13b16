"""Cost of reading a Histogram: count, sum, min/max, one percentile, several percentiles,
cumulative ``le`` counts and a full copy, for ratequeue against hdrhistogram and a plain
Python ``bisect`` over a sorted list, all holding the same 10^6 values, measured in ONE
process in interleaved rounds (A B C ... A B C ...).

The floor row is a call of a no-op Python method returning an attribute (what any read
through a Python call costs at least). Per row: min and median over rounds of ns per read.

Usage::

    .venv/bin/python benches/bench_histogram_reads.py --label after [--rounds 9]

The table goes into ``benches/results/histogram_reads.md`` under ``## <label>``, keeping
sections of other labels (so a before/after pair is two runs of this script).
"""

from __future__ import annotations

import argparse
import bisect
import datetime as dt
import gc
import importlib.metadata
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benches" / "results" / "histogram_reads.md"
QS = [50.0, 90.0, 99.0, 99.9]


@dataclass
class Row:
    """One timed read: ``fn()`` called ``number`` times per batch."""

    read: str
    name: str
    timed: str
    fn: Callable[[], object]
    number: int = 0
    samples: list[float] = field(default_factory=list)

    def batch(self) -> None:
        f = self.fn
        rng = range(self.number)
        gc.disable()
        try:
            t0 = time.perf_counter_ns()
            for _ in rng:
                f()
            ns = time.perf_counter_ns() - t0
        finally:
            gc.enable()
        self.samples.append(ns / self.number)


class _Floor:
    def __init__(self) -> None:
        self.n = 1

    def count(self) -> int:
        return self.n


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def build_rows(n: int) -> list[Row]:
    import numpy as np
    import ratequeue as rq
    from hdrh.histogram import HdrHistogram

    rng = np.random.default_rng(1)
    ns = np.rint(rng.lognormal(np.log(5e6), 1.5, n)).clip(1, 10**12)
    h = rq.Histogram()
    h.record_many(ns / 1e9)
    hh = HdrHistogram(1, 10**13, 3)
    for v in ns.astype(np.int64).tolist():
        hh.record_value(v)
    xs = sorted((ns / 1e9).tolist())
    les = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0]
    floor = _Floor()

    def srt_pct(q: float) -> float:
        k = max(1, -(-int(q * len(xs)) // 100))
        return float(xs[k - 1])

    rows = [
        Row("floor", "floor", "obj.count() (no-op Python method)", floor.count),
        Row("count", "ratequeue", "h.count", lambda: h.count),
        Row("count", "hdrhistogram", "hh.get_total_count()", hh.get_total_count),
        Row("count", "bisect", "len(xs)", lambda: len(xs)),
        Row("sum", "ratequeue", "h.sum", lambda: h.sum),
        Row("min/max", "ratequeue", "h.min, h.max", lambda: (h.min, h.max)),
        Row(
            "min/max",
            "hdrhistogram",
            "hh.get_min_value(), hh.get_max_value()",
            lambda: (hh.get_min_value(), hh.get_max_value()),
        ),
        Row("min/max", "bisect", "xs[0], xs[-1]", lambda: (xs[0], xs[-1])),
        Row("p99", "ratequeue", "h.percentile(99)", lambda: h.percentile(99)),
        Row(
            "p99",
            "hdrhistogram",
            "hh.get_value_at_percentile(99)",
            lambda: hh.get_value_at_percentile(99),
        ),
        Row("p99", "bisect", "xs[ceil(.99 n) - 1]", lambda: srt_pct(99.0)),
        Row("4 percentiles", "ratequeue", f"h.percentiles({QS})", lambda: h.percentiles(QS)),
        Row(
            "4 percentiles",
            "hdrhistogram",
            f"hh.get_percentile_to_value_dict({QS})",
            lambda: hh.get_percentile_to_value_dict(QS),
        ),
        Row(
            "4 percentiles", "bisect", "[xs[ceil(q n) - 1] for q]", lambda: [srt_pct(q) for q in QS]
        ),
        Row("8 le counts", "ratequeue", "h.cumulative(les)", lambda: h.cumulative(les)),
        Row(
            "8 le counts",
            "bisect",
            "[bisect_right(xs, le) for le]",
            lambda: [bisect.bisect_right(xs, le) for le in les],
        ),
        Row("copy", "ratequeue", "h.copy()", h.copy),
    ]
    if hasattr(hh, "get_count_at_value"):
        rows.insert(
            -2,
            Row(
                "8 le counts",
                "hdrhistogram",
                "[hh.get_count_at_value(le) ...] (one bucket each, not cumulative)",
                lambda: [hh.get_count_at_value(int(le * 1e9)) for le in les],
            ),
        )
    return rows


def calibrate(r: Row, target_ns: float) -> None:
    r.number = 10
    while True:
        t0 = time.perf_counter_ns()
        for _ in range(r.number):
            r.fn()
        ns = time.perf_counter_ns() - t0
        if ns >= target_ns / 4 or r.number >= 1_000_000:
            break
        r.number *= 4
    r.number = max(10, min(1_000_000, int(target_ns * r.number / max(ns, 1))))


def fmt(ns: float) -> str:
    if ns >= 1e3:
        return f"{ns / 1e3:,.2f} µs"
    return f"{ns:,.0f} ns"


def section(rows: list[Row], label: str, args: argparse.Namespace) -> str:
    floor = statistics.median(next(r for r in rows if r.read == "floor").samples)
    lines = [
        f"## {label}",
        "",
        f"Generated by `benches/bench_histogram_reads.py --label {label}` on"
        f" {dt.date.today().isoformat()}: python {platform.python_version()},"
        f" ratequeue {version('ratequeue')}, hdrhistogram {version('hdrhistogram')},"
        f" {args.n:.0e} lognormal values (median 5 ms, sigma 1.5), {args.rounds} interleaved"
        " rounds.",
        "",
        "| read | candidate | timed | min | median | median / floor |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        med = statistics.median(r.samples)
        lines.append(
            f"| {r.read} | {r.name} | `{r.timed}` | {fmt(min(r.samples))} | {fmt(med)}"
            f" | {med / floor:.1f} |"
        )
    return "\n".join(lines) + "\n"


HEADER = """# Histogram reads: ratequeue vs hdrhistogram vs bisect over a sorted list

Cost of one read from Python (ns per call, including the call itself: the floor row is a
no-op Python method). Each section is one run of `benches/bench_histogram_reads.py`, all
candidates side by side in that run.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--label", required=True)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--target-ms", type=float, default=20.0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    rows = build_rows(args.n)
    for r in rows:
        calibrate(r, args.target_ms * 1e6)
    for _ in range(args.rounds):
        for r in rows:
            r.batch()
    text = section(rows, args.label, args)
    print(text)
    if not args.no_write:
        old = args.out.read_text() if args.out.exists() else HEADER
        parts = re.split(r"(?m)^(?=## )", old)
        kept = [p for p in parts[1:] if not p.startswith(f"## {args.label}\n")]
        args.out.write_text(
            parts[0].rstrip() + "\n\n" + "\n".join(p.rstrip() + "\n" for p in [*kept, text])
        )
        print(f"written: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
