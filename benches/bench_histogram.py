"""Cost of recording a duration: ratequeue's Histogram against prometheus_client and
hdrhistogram, one value at a time from Python and in bulk from numpy.

Two tables, both measured in ONE process in interleaved rounds (A B C ... A B C ...), so
slow drifts of the machine (a shared 2-core VM) hit every candidate alike:

1. *Per call*: ``rq.Histogram.record(seconds)`` vs ``prometheus_client.Histogram.observe``
   (ratequeue's default Prometheus buckets) vs ``hdrh.histogram.HdrHistogram.record_value``
   (1 ns .. 10^13 ns, 3 significant digits: the same range and precision as ratequeue).
   Each batch is a plain ``for v in values: f(v)`` loop over pre-built values (floats in
   seconds; ints in nanoseconds for hdrhistogram, its native unit), with the cyclic GC
   off; the loop's own cost is in every figure and the "empty loop" row measures it.
2. *Bulk*: ``rq.Histogram.record_many`` vs ``numpy.histogram`` on the same 10^7 float64
   values, with ratequeue's own bucket edges (same layout, so the counts must match
   exactly: they are checked) and with 1000 uniform bins (numpy's fast path, a different
   and coarser layout, for scale). A Python loop of prometheus_client ``observe`` (and of
   ``rq.Histogram.record``) over the first values, capped, gives the per-value cost
   without batching.

Per candidate: min and median over rounds of ns per value, values/s at the median, and
the ratio of its median to ratequeue's (> 1: slower than ratequeue). Finally the Rust
core's own figure: ``cargo bench -p ratequeue-core --bench histogram`` (criterion,
single-threaded ``Histogram::record``; target <= 10 ns).

Usage::

    .venv/bin/python benches/bench_histogram.py [--rounds 15] [--bulk-rounds 5]
        [--bulk-n 10000000] [--no-cargo] [--no-write] [--out PATH]

Peers are optional: a peer that is not importable gets a row saying so. Install them
with ``.venv/bin/pip install prometheus_client hdrhistogram`` (the "bench" extra).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib.metadata
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benches" / "results" / "histogram.md"
CARGO_TARGET_NS = 10.0


@dataclass
class Row:
    """One timed candidate: ``run(n)`` times n values and returns elapsed ns."""

    name: str
    timed: str
    run: Callable[[int], int] | None
    kind: str = "peer"  # "ratequeue" | "floor" | "peer"
    note: str = ""
    number: int = 0
    samples: list[float] = field(default_factory=list)  # ns per value

    def batch(self) -> None:
        assert self.run is not None
        gc.disable()
        try:
            ns = self.run(self.number)
        finally:
            gc.enable()
        self.samples.append(ns / self.number)


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


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


def loop_runner(fn: Callable[[Any], Any] | None, values: Sequence[Any]) -> Callable[[int], int]:
    """Times ``for v in values[:n]: fn(v)`` (or an empty loop when fn is None)."""

    def run(n: int) -> int:
        vals = values[:n] if n < len(values) else values
        if fn is None:
            t0 = time.perf_counter_ns()
            for _v in vals:
                pass
            return time.perf_counter_ns() - t0
        f = fn
        t0 = time.perf_counter_ns()
        for v in vals:
            f(v)
        return time.perf_counter_ns() - t0

    return run


def calibrate(row: Row, target_ns: float, cap: int) -> None:
    """Pick the batch size so one batch takes about ``target_ns`` (at most ``cap``)."""
    n = 1000
    while True:
        ns = row.run(n) if row.run else 0
        if ns >= target_ns / 4 or n >= cap:
            break
        n = min(cap, n * 4)
    per = max(ns / n, 1e-3)
    row.number = max(1000, min(cap, int(target_ns / per)))


def interleave(rows: list[Row], rounds: int) -> None:
    live = [r for r in rows if r.run is not None]
    for _ in range(rounds):
        for r in live:
            r.batch()


# --------------------------------------------------------------------------- candidates


def sample_seconds(n: int, seed: int = 1) -> Any:
    """Queue-wait-like durations: lognormal, median 5 ms, sigma 1.5, whole nanoseconds
    (so every implementation sees exactly the same values), all below 10^4 s."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ns = np.rint(rng.lognormal(np.log(5e6), 1.5, n)).clip(1, 10**12)
    return ns / 1e9


def per_call_rows(values_s: list[float], values_ns: list[int]) -> list[Row]:
    """The per-call candidates, each looping over the same values."""
    import ratequeue as rq

    rows: list[Row] = []
    h = rq.Histogram()
    rows.append(
        Row(
            "ratequeue",
            "rq.Histogram.record(seconds)",
            loop_runner(h.record, values_s),
            "ratequeue",
        )
    )
    try:
        from prometheus_client import Histogram as PHistogram
        from ratequeue.prometheus import DEFAULT_BUCKETS

        ph = PHistogram("bench_seconds", "bench", buckets=DEFAULT_BUCKETS, registry=None)
        rows.append(
            Row(
                "prometheus_client",
                f"Histogram.observe(seconds), {len(DEFAULT_BUCKETS) + 1} buckets",
                loop_runner(ph.observe, values_s),
            )
        )
    except ImportError as e:
        rows.append(Row("prometheus_client", "Histogram.observe", None, note=f"skipped: {e}"))
    try:
        from hdrh.histogram import HdrHistogram

        hh = HdrHistogram(1, 10**13, 3)
        rows.append(
            Row(
                "hdrhistogram",
                "HdrHistogram(1, 10**13, 3).record_value(ns)",
                loop_runner(hh.record_value, values_ns),
            )
        )
    except ImportError as e:
        rows.append(Row("hdrhistogram", "HdrHistogram.record_value", None, note=f"skipped: {e}"))
    rows.append(
        Row("floor", "empty loop: for v in values: pass", loop_runner(None, values_s), "floor")
    )
    return rows


def bulk_rows(x: Any, cap: int) -> list[Row]:
    import numpy as np
    import ratequeue as rq

    rows: list[Row] = []
    h = rq.Histogram()
    h.record_many(x)
    counts, edges = h.to_numpy()
    # The same layout through numpy: the counts must agree exactly.
    np_counts = np.histogram(x, bins=edges)[0]
    assert np.array_equal(np_counts, counts.astype(np.int64)), "numpy and ratequeue disagree"
    assert h.count == len(x)
    n = len(x)

    def rq_bulk(_n: int) -> int:
        h.reset()
        t0 = time.perf_counter_ns()
        h.record_many(x)
        return time.perf_counter_ns() - t0

    def np_edges(_n: int) -> int:
        t0 = time.perf_counter_ns()
        np.histogram(x, bins=edges)
        return time.perf_counter_ns() - t0

    lo, hi = float(x.min()), float(x.max())

    def np_uniform(_n: int) -> int:
        t0 = time.perf_counter_ns()
        np.histogram(x, bins=1000, range=(lo, hi))
        return time.perf_counter_ns() - t0

    rows.append(Row("ratequeue", f"h.record_many(x), {n:.0e} values", rq_bulk, "ratequeue"))
    rows.append(Row("numpy", f"np.histogram(x, bins=ratequeue's {len(edges)} edges)", np_edges))
    rows.append(Row("numpy", "np.histogram(x, bins=1000, range=...) (uniform)", np_uniform))
    for r in rows:
        r.number = n
    capped = x[:cap].tolist()
    try:
        from prometheus_client import Histogram as PHistogram
        from ratequeue.prometheus import DEFAULT_BUCKETS

        ph = PHistogram("bulk_seconds", "bench", buckets=DEFAULT_BUCKETS, registry=None)
        r = Row(
            "prometheus_client",
            f"for v in x[:{cap:.0e}]: observe(v) (Python loop, capped)",
            loop_runner(ph.observe, capped),
        )
        r.number = len(capped)
        rows.append(r)
    except ImportError as e:
        rows.append(Row("prometheus_client", "observe loop", None, note=f"skipped: {e}"))
    h2 = rq.Histogram()
    r = Row(
        "ratequeue",
        f"for v in x[:{cap:.0e}]: record(v) (Python loop, capped)",
        loop_runner(h2.record, capped),
    )
    r.number = len(capped)
    rows.append(r)
    return rows


# --------------------------------------------------------------------------- cargo


CARGO_RE = re.compile(
    r"histogram_record\s+time:\s+\[([\d.]+)\s*(\S+)\s+([\d.]+)\s*(\S+)\s+([\d.]+)\s*(\S+)\]"
)
UNIT_NS = {"ps": 1e-3, "ns": 1.0, "µs": 1e3, "us": 1e3, "ms": 1e6, "s": 1e9}


def cargo_bench(existing: Path | None) -> tuple[list[float] | None, str]:
    """(low, estimate, high) ns of criterion's histogram_record, and how it was got."""
    if existing is not None:
        text = existing.read_text()
        how = f"parsed from {existing}"
    else:
        cargo = shutil.which("cargo")
        if cargo is None:
            return None, "cargo not found"
        cmd = [cargo, "bench", "-p", "ratequeue-core", "--bench", "histogram"]
        print("running:", " ".join(cmd[1:]), file=sys.stderr)
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        text = p.stdout + p.stderr
        if p.returncode != 0:
            return None, f"cargo bench failed ({p.returncode}): {text[-500:]}"
        how = "cargo bench -p ratequeue-core --bench histogram"
    m = CARGO_RE.search(text)
    if m is None:
        return None, f"no histogram_record line in the output ({how})"
    g = m.groups()
    return [float(g[i]) * UNIT_NS[g[i + 1]] for i in (0, 2, 4)], how


# --------------------------------------------------------------------------- report


def fmt_ns(ns: float) -> str:
    if ns >= 1e6:
        return f"{ns / 1e6:,.1f} ms"
    return f"{ns:,.1f}" if ns < 100 else f"{ns:,.0f}"


def fmt_rate(per_s: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if per_s >= div:
            return f"{per_s / div:.2f} {unit}"
    return f"{per_s:.0f}"


def table(rows: list[Row], unit: str, total_of: int | None = None) -> list[str]:
    ref = next(r for r in rows if r.kind == "ratequeue" and r.samples)
    ref_med = statistics.median(ref.samples)
    head = f"| candidate | timed | min ns/{unit} | median ns/{unit} | {unit}s/s (median) | ratio |"
    sep = "|---|---|---:|---:|---:|---:|"
    if total_of is not None:
        head += f" time for {total_of:.0e} (median) |"
        sep += "---:|"
    lines = [head, sep]
    for r in rows:
        if not r.samples:
            cells = [r.name, r.timed, "—", "—", "—", r.note]
        else:
            med, lo = statistics.median(r.samples), min(r.samples)
            ratio = "1.00 (ref)" if r is ref else f"{med / ref_med:.2f}"
            cells = [r.name, f"`{r.timed}`", fmt_ns(lo), fmt_ns(med), fmt_rate(1e9 / med), ratio]
        if total_of is not None:
            cells.append(
                f"{statistics.median(r.samples) * total_of / 1e9:.2f} s" if r.samples else "—"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(
    per_call: list[Row],
    bulk: list[Row],
    cargo: tuple[list[float] | None, str],
    args: argparse.Namespace,
) -> str:
    lines = [
        "# Histogram recording: ratequeue vs prometheus_client vs hdrhistogram vs numpy",
        "",
        f"Generated by `benches/bench_histogram.py` on {dt.date.today().isoformat()}.",
        "",
        f"- machine: {machine()}",
        f"- python: {platform.python_implementation()} {platform.python_version()}",
        "- packages: "
        + ", ".join(
            f"{d} {version(d)}" for d in ("ratequeue", "numpy", "prometheus_client", "hdrhistogram")
        ),
        f"- rounds: {args.rounds} interleaved (per call, ~{args.target_ms:g} ms per batch),"
        f" {args.bulk_rounds} (bulk); min and median over rounds",
        "- values: lognormal durations, median 5 ms, sigma 1.5, whole nanoseconds"
        " (the same values for every candidate: floats in seconds, ints in ns for hdrhistogram)",
        "- ratio = candidate's median / ratequeue's median (> 1: slower than ratequeue)",
        "",
        "## One value per call, from Python",
        "",
        *table(per_call, "call"),
        "",
        "The loop's own cost (the empty-loop row) is in every figure.",
        "",
        f"## Bulk: {args.bulk_n:.0e} float64 values",
        "",
        *table(bulk, "value", total_of=args.bulk_n),
        "",
        "`record_many` and `np.histogram` with ratequeue's edges produce identical counts"
        " (checked). The capped Python loops time the first"
        f" {min(args.cap, args.bulk_n):.0e} values; their total is extrapolated.",
        "",
        "## Rust core: `cargo bench -p ratequeue-core --bench histogram`",
        "",
    ]
    figs, how = cargo
    if figs is None:
        lines.append(f"Not measured: {how}.")
    else:
        lo, est, hi = figs
        verdict = "met" if est <= CARGO_TARGET_NS else "MISSED"
        lines += [
            "| bench | low | estimate | high | target | verdict |",
            "|---|---:|---:|---:|---:|---|",
            f"| `Histogram::record` (criterion `histogram_record`) | {lo:.2f} ns | {est:.2f} ns"
            f" | {hi:.2f} ns | <= {CARGO_TARGET_NS:g} ns | {verdict} |",
            "",
            f"Source: {how}. Criterion's confidence interval for the time of one"
            " `record` of a pseudo-random value (LCG, values up to ~17 s), single thread.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--target-ms", type=float, default=20.0)
    ap.add_argument("--bulk-rounds", type=int, default=5)
    ap.add_argument("--bulk-n", type=int, default=10_000_000)
    ap.add_argument("--cap", type=int, default=1_000_000, help="values for the Python loops")
    ap.add_argument("--no-cargo", action="store_true", help="skip cargo bench")
    ap.add_argument("--cargo-output", type=Path, help="parse this saved cargo bench output")
    ap.add_argument("--out", type=Path, default=RESULTS, help="markdown file to write")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)

    import numpy as np

    x = sample_seconds(args.bulk_n)
    per = x[: 1 << 20]
    values_s = per.tolist()
    values_ns = np.rint(per * 1e9).astype(np.int64).tolist()

    per_call = per_call_rows(values_s, values_ns)
    for r in per_call:
        if r.run is not None:
            calibrate(r, args.target_ms * 1e6, len(values_s))
    print(f"per call: {args.rounds} rounds ...", file=sys.stderr)
    interleave(per_call, args.rounds)

    bulk = bulk_rows(x, min(args.cap, args.bulk_n))
    print(f"bulk: {args.bulk_rounds} rounds of {args.bulk_n:.0e} values ...", file=sys.stderr)
    interleave(bulk, args.bulk_rounds)

    if args.no_cargo and args.cargo_output is None:
        cargo: tuple[list[float] | None, str] = (None, "skipped (--no-cargo)")
    else:
        cargo = cargo_bench(args.cargo_output)

    text = report(per_call, bulk, cargo, args)
    print(text)
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"written: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
