"""Keyed limits: decisions per second and bytes per key, ratequeue beside the peers.

Every candidate keeps one limit per key in process memory and is configured so that it
admits every call (rates far above what one thread can reach), so the table compares
the price of a *decision* and of a *key*, not of a refusal. Per candidate:

- new-key decisions/s: the first decision on each of N distinct keys (the map grows);
- hot-key decisions/s: N more decisions cycling over 1,000 keys already held;
- bytes/key: the growth of the resident set (``/proc/self/statm``) over the new-key
  phase divided by N, after ``gc.collect()``. The keys themselves (Python strings or a
  numpy array) are built before the first reading, so only what the limiter keeps is
  counted: ratequeue keeps a 64-bit hash and a 64-bit TAT per key, the Python peers keep
  dict entries, their own key strings and bucket objects.

Each measurement runs in a fresh subprocess (one candidate per process, nothing else
allocated in it), so the RSS numbers are clean; candidates are run in interleaved rounds
(A B C ... then B C ... A) and the table shows the median over rounds. The per-call rows
use N = 200,000 distinct str keys (``f"user:{i}"``) and a plain ``for`` loop calling a
bound method (the loop's cost is in every figure); the numpy rows decide uint64 keys in
batches of 65,536 (one ``try_acquire_many`` call per batch, GIL released), at 200,000 and
at 1,000,000 keys. The cyclic GC stays on, as in a real process.

Usage::

    .venv/bin/python benches/bench_keyed.py [--rounds 3] [--keys 200000] [--big 1000000]
        [--only NAME ...] [--out benches/results/keyed.md]

Peers are optional (a row says when one is not installed):
``.venv/bin/pip install token-bucket limits throttled-py``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "keyed.md"
HUGE = 10**9
HOT = 1_000
CHUNK = 65_536
GOLDEN = 0x9E3779B97F4A7C15

# Targets (issue 6): memory at a million keys, and batch throughput on one thread.
TARGET_BYTES_PER_KEY = 64
TARGET_U64_PER_S = 20e6


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --------------------------------------------------------------------------- workers
#
# A worker builds its keys, makes its limiter, and returns (setup, new, hot):
#   new(): decides every key once (first touch), returns the number admitted;
#   hot(): decides N times over the first HOT keys, returns the number admitted.


@dataclass
class Worker:
    label: str
    dist: str  # the distribution whose version is shown
    config: str
    big: bool  # uses --big keys instead of --keys
    build: Callable[[int], tuple[Callable[[], int], Callable[[], int], Callable[[], int]]]


def str_keys(n: int, prefix: str = "user:") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def per_call(decide: Callable[[str], Any], ok: Callable[[Any], bool], n: int):
    keys = str_keys(n)
    warm = str_keys(HOT, "warm:")
    hot_keys = keys[:HOT] * (n // HOT)

    def run(ks: list[str]) -> int:
        admitted = 0
        for k in ks:
            if ok(decide(k)):
                admitted += 1
        return admitted

    return (lambda: run(warm)), (lambda: run(keys)), (lambda: run(hot_keys))


def build_rq_str(n: int):
    import ratequeue as rq

    kl = rq.KeyedLimiter(rq.Rate(HUGE, per="second", burst=HUGE))
    warm, new, hot = per_call(kl.try_acquire, bool, n)

    def new_checked() -> int:
        got = new()
        assert len(kl) == n + HOT, len(kl)
        return got

    return warm, new_checked, hot


def build_rq_many_str(n: int):
    import ratequeue as rq

    kl = rq.KeyedLimiter(rq.Rate(HUGE, per="second", burst=HUGE))
    keys = str_keys(n)
    chunks = [keys[i : i + CHUNK] for i in range(0, n, CHUNK)]
    hot_keys = keys[:HOT] * (n // HOT)
    hot_chunks = [hot_keys[i : i + CHUNK] for i in range(0, len(hot_keys), CHUNK)]
    warm = str_keys(HOT, "warm:")

    def run(cs: list[list[str]]) -> int:
        return sum(int(kl.try_acquire_many(c).sum()) for c in cs)

    return (lambda: run([warm])), (lambda: run(chunks)), (lambda: run(hot_chunks))


def build_rq_u64(n: int):
    import numpy as np
    import ratequeue as rq

    # max_keys = 2^21 from 1,000,000 keys on: at the default 2^20, one of the 256 shards
    # (~3,900 keys each) reaches its cap of 4,096 for about a third of the hash seeds and
    # drops its full buckets (every bucket here is full again a nanosecond later), which
    # the check below refuses. Either way each shard's table ends at 8,192 slots: the
    # same memory.
    max_keys = 2**21 if n >= 1_000_000 else 2**20
    kl = rq.KeyedLimiter(rq.Rate(HUGE, per="second", burst=HUGE), max_keys=max_keys)
    keys = np.arange(n, dtype=np.uint64) * np.uint64(GOLDEN)  # distinct, scattered
    warm = np.arange(n, n + HOT, dtype=np.uint64) * np.uint64(GOLDEN)
    hot_keys = np.tile(keys[:HOT], n // HOT)

    def run(arr: Any) -> int:
        admitted = 0
        for i in range(0, len(arr), CHUNK):
            admitted += int(kl.try_acquire_many(arr[i : i + CHUNK]).sum())
        return admitted

    def new() -> int:
        got = run(keys)
        assert len(kl) == n + HOT, len(kl)
        return got

    return (lambda: run(warm)), new, (lambda: run(hot_keys))


def build_token_bucket(n: int):
    import token_bucket

    tb = token_bucket.Limiter(HUGE, HUGE, token_bucket.MemoryStorage())
    return per_call(tb.consume, bool, n)


def build_limits(n: int):
    from limits import RateLimitItemPerSecond
    from limits.storage import MemoryStorage
    from limits.strategies import FixedWindowRateLimiter

    item = RateLimitItemPerSecond(HUGE)
    lim = FixedWindowRateLimiter(MemoryStorage())
    return per_call(lambda k: lim.hit(item, k), bool, n)


def build_throttled(n: int):
    import throttled

    # MemoryStore is an LRU of MAX_SIZE keys (default 1024): room for every key here.
    store = throttled.MemoryStore(options={"MAX_SIZE": 4 * n})
    th = throttled.Throttled(using="gcra", quota=throttled.per_sec(HUGE, burst=HUGE), store=store)
    return per_call(th.limit, lambda r: not r.limited, n)


WORKERS: dict[str, Worker] = {
    "rq-str": Worker(
        "ratequeue try_acquire(str)",
        "ratequeue",
        "KeyedLimiter(Rate(1e9/s, burst=1e9)); one call per decision",
        False,
        build_rq_str,
    ),
    "rq-many-str": Worker(
        "ratequeue try_acquire_many(list[str])",
        "ratequeue",
        "same; lists of 65,536 str keys per call",
        False,
        build_rq_many_str,
    ),
    "rq-u64": Worker(
        "ratequeue try_acquire_many(uint64)",
        "ratequeue",
        "same; numpy uint64 arrays of 65,536 keys per call",
        False,
        build_rq_u64,
    ),
    "rq-u64-big": Worker(
        "ratequeue try_acquire_many(uint64)",
        "ratequeue",
        "same, at the --big key count (max_keys = 2^21, see build_rq_u64)",
        True,
        build_rq_u64,
    ),
    "token-bucket": Worker(
        "token-bucket consume",
        "token-bucket",
        "Limiter(1e9, 1e9, MemoryStorage()); consume(key)",
        False,
        build_token_bucket,
    ),
    "limits": Worker(
        "limits FixedWindow hit",
        "limits",
        "FixedWindowRateLimiter(MemoryStorage()); hit(RateLimitItemPerSecond(1e9), key)",
        False,
        build_limits,
    ),
    "throttled": Worker(
        "throttled-py GCRA limit",
        "throttled-py",
        "Throttled(using='gcra', quota=per_sec(1e9, burst=1e9), "
        "store=MemoryStore(MAX_SIZE=4N)); limit(key)",
        False,
        build_throttled,
    ),
}


def worker_main(name: str, n: int) -> None:
    """Runs in the subprocess: measures one candidate, prints one JSON line."""
    w = WORKERS[name]
    try:
        warm, new, hot = w.build(n)
    except ImportError as e:
        print(json.dumps({"error": f"not installed ({e.name})"}))
        return
    warm()  # first calls: imports, code paths, small allocations
    gc.collect()
    before = rss_bytes()
    t0, c0 = time.perf_counter(), time.thread_time()
    admitted_new = new()
    t_new, c_new = time.perf_counter() - t0, time.thread_time() - c0
    gc.collect()
    after = rss_bytes()
    t0, c0 = time.perf_counter(), time.thread_time()
    admitted_hot = hot()
    t_hot, c_hot = time.perf_counter() - t0, time.thread_time() - c0
    n_hot = (n // HOT) * HOT
    out = {
        "n": n,
        "new_per_s": n / t_new,
        "hot_per_s": n_hot / t_hot,
        # Per second of this thread's CPU time (the decisions run on it, GIL released
        # or not): unlike the wall time, not slowed by waiting for a core on a loaded
        # machine.
        "new_per_cpu_s": n / c_new,
        "hot_per_cpu_s": n_hot / c_hot,
        "bytes_per_key": (after - before) / n,
        "all_admitted": admitted_new == n and admitted_hot == n_hot,
    }
    print(json.dumps(out))


# --------------------------------------------------------------------------- parent


def run_one(name: str, n: int, python: str = sys.executable) -> dict[str, Any]:
    cmd = [python, __file__, "--worker", name, "--n", str(n)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def fmt_rate(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f} M/s"
    return f"{x / 1e3:.0f} k/s"


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} CPUs; {platform.system()} {platform.release()}; "
        f"Python {platform.python_version()}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keys", type=int, default=200_000, help="keys of the per-call rows")
    ap.add_argument("--big", type=int, default=1_000_000, help="keys of the big numpy row")
    ap.add_argument("--only", nargs="*", choices=sorted(WORKERS), help="run these only")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument(
        "--baseline",
        help="a Python with another ratequeue build (and numpy): its ratequeue rows run "
        "beside this build's, in the same interleaved rounds",
    )
    ap.add_argument("--baseline-label", default="baseline", help="what the baseline is")
    ap.add_argument("--label", default="this build", help="what this build is, with --baseline")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.n)
        return 0

    # A run is a candidate under an interpreter: with --baseline, each ratequeue
    # candidate twice (the baseline's build first), as "name@base".
    names: list[str] = []
    for name in args.only or list(WORKERS):
        if args.baseline and WORKERS[name].dist == "ratequeue":
            names.append(f"{name}@base")
        names.append(name)

    def worker(run: str) -> Worker:
        return WORKERS[run.split("@")[0]]

    def label_of(run: str) -> str:
        w = worker(run)
        if not args.baseline or w.dist != "ratequeue":
            return f"{w.label} ({w.dist} {version(w.dist)})"
        return f"{w.label} [{args.baseline_label if run.endswith('@base') else args.label}]"

    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    errors: dict[str, str] = {}
    started = time.monotonic()
    load_before = os.getloadavg()
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            if name in errors:
                continue
            n = args.big if worker(name).big else args.keys
            python = args.baseline if name.endswith("@base") else sys.executable
            res = run_one(name.split("@")[0], n, python)
            if "error" in res:
                errors[name] = res["error"]
                print(f"  {name}: {res['error']}", file=sys.stderr)
                continue
            results[name].append(res)
            print(
                f"  round {r + 1} {name:18} n={n:>9,} new {fmt_rate(res['new_per_s']):>10}"
                f" ({fmt_rate(res['new_per_cpu_s'])} CPU)"
                f"  hot {fmt_rate(res['hot_per_s']):>10} ({fmt_rate(res['hot_per_cpu_s'])} CPU)"
                f"  {res['bytes_per_key']:7.1f} B/key",
                file=sys.stderr,
            )

    load_after = os.getloadavg()
    load = (
        f"load average (1/5/15 min) {' / '.join(f'{x:.1f}' for x in load_before)} before, "
        f"{' / '.join(f'{x:.1f}' for x in load_after)} after"
    )

    def med(name: str, field: str) -> float:
        return statistics.median(x[field] for x in results[name])

    ref = "rq-str" if results.get("rq-str") else None
    lines = [
        "| candidate | keys | new-key decisions/s | hot-key decisions/s "
        "| per CPU second: new / hot | bytes/key (RSS) | new-key vs ratequeue str |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in names:
        label = label_of(name)
        if name in errors:
            lines.append(f"| {label} | | {errors[name]} | | | | |")
            continue
        n = results[name][0]["n"]
        new, hot, b = med(name, "new_per_s"), med(name, "hot_per_s"), med(name, "bytes_per_key")
        cpu = f"{fmt_rate(med(name, 'new_per_cpu_s'))} / {fmt_rate(med(name, 'hot_per_cpu_s'))}"
        ratio = f"{new / med(ref, 'new_per_s'):.3f}x" if ref else ""
        flag = "" if all(x["all_admitted"] for x in results[name]) else " (NOT all admitted!)"
        lines.append(
            f"| {label}{flag} | {n:,} | {fmt_rate(new)} | {fmt_rate(hot)} | {cpu} | {b:.1f} "
            f"| {ratio} |"
        )
    table = "\n".join(lines)

    checks = []
    if results.get("rq-u64-big"):
        b = med("rq-u64-big", "bytes_per_key")
        new = med("rq-u64-big", "new_per_s")
        hot = med("rq-u64-big", "hot_per_s")
        ok_b = "PASS" if b <= TARGET_BYTES_PER_KEY else "FAIL"
        checks.append(
            f"- memory: {b:.1f} bytes/key at {args.big:,} keys "
            f"(target <= {TARGET_BYTES_PER_KEY}): **{ok_b}**"
        )
        for what, v in (("new keys", new), ("hot keys", hot)):
            ok = "PASS" if v >= TARGET_U64_PER_S else "FAIL"
            checks.append(
                f"- uint64 batch throughput, {what}: {fmt_rate(v)} on one thread "
                f"(target >= {TARGET_U64_PER_S / 1e6:.0f} M/s): **{ok}**"
            )

    print(table)
    if checks:
        print()
        print("\n".join(checks))

    configs = "\n".join(
        f"- **{worker(n).label}** ({n}): {worker(n).config}" for n in names if "@" not in n
    )
    if args.baseline:
        configs += (
            f"\n- `[{args.baseline_label}]` rows: the same candidate run by `{args.baseline}` "
            f"(another ratequeue build), `[{args.label}]` rows by `{sys.executable}`, in the "
            "same interleaved rounds"
        )
    doc = f"""# Keyed limits: decisions/s and bytes per key

Generated by `benches/bench_keyed.py` on {dt.date.today().isoformat()}
({args.rounds} rounds, median; {time.monotonic() - started:.0f} s in all).
Machine: {machine()}; {load}.

{table}

Targets (issue 6):

{chr(10).join(checks) if checks else "- (the big uint64 row was not run)"}

What is measured (see the script's docstring): each candidate runs alone in a fresh
subprocess; *new-key* is the first decision on each of the N distinct keys (the map
grows), *hot-key* is N more decisions over 1,000 keys already held; *bytes/key* is the
resident-set growth over the new-key phase divided by N (the keys were built before);
*per CPU second* counts the worker thread's CPU time instead of the wall time (on a loaded
machine, the wall time also counts waiting for a core).
Every limit is far above what one thread reaches, so every decision admits. Per-call
rows: a `for` loop over `f"user:{{i}}"` keys calling a bound method; numpy rows: one
`try_acquire_many` per 65,536 uint64 keys.

Configurations:

{configs}
"""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(doc)
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
