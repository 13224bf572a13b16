"""The LLM transport's added cache misses per call, counted in cachegrind (load-independent).

    .venv/bin/python benches/cachesim_transport.py [--row loopback|memory] [--calls 300]
                                                   [--top 30] [--out FILE] [--pages]
                                                   [--keep DIR]

On loopback the transport's added time is mostly cache misses: between two socket calls
the kernel, httpcore and h11 push its code and objects out of L2 (README, "LLM clients").
Timing cannot compare two builds on a shared machine within a few µs; this can. The same
chat POST as ``bench_transport.py`` is sent through the bare transport (the floor) and
through ``RateLimitedTransport`` over a Limiter of requests and tokens, each in a process
of its own under ``valgrind --tool=cachegrind`` with a 2 MiB last level (this CPU's two
L2s together) and 4 MiB written before every call. Each process makes 200 warm-up calls,
then 0 or ``--calls`` more; per call = (run of N - run of 0) / N, added = transport - floor.
Prints the totals (instructions; first-level and last-level misses of code and data) and
the functions with the most added last-level code misses. Instruction counts move by a
few thousand between runs (a one-time clock calibration spins for wall time under
valgrind); the miss counts much less. ``--pages`` counts instead the extension's
instructions, code lines and 4 KiB pages each transport call runs (callgrind): the pages
a call after an idle core must walk the page tables for again. ``--keep`` writes
valgrind's own output files into a folder, for ``cg_annotate`` or another sort.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

EVENTS = ("Ir", "I1mr", "ILmr", "Dr", "D1mr", "DLmr", "Dw", "D1mw", "DLmw")
WARM = 200


def child(which: str, n: int, row: str, url: str) -> None:
    """One measured process: warm-up calls, then ``n`` more, cache-trashing before each."""
    import bench_transport as bt
    import httpx2
    from ratequeue.httpx import RateLimitedTransport

    inner = httpx2.HTTPTransport() if row == "loopback" else httpx2.MockTransport(bt.answer)
    t = inner if which == "floor" else RateLimitedTransport(inner, bt.roomy())
    if isinstance(t, RateLimitedTransport):
        t.estimator.load(60)  # type: ignore[attr-defined]
    client = httpx2.Client(transport=t)
    data = json.dumps(bt.BODY).encode()
    headers = {"content-type": "application/json"}
    target = (url if row == "loopback" else "http://mock") + "/v1/chat/completions"
    trash = bytearray(4 << 20)
    ones = b"\x01" * (len(trash) // 64)

    def run(k: int) -> None:
        for _ in range(k):
            trash[::64] = ones  # one byte per line: L2 as a socket call leaves it
            client.post(target, content=data, headers=headers).read()

    run(WARM)
    gc.collect()
    gc.freeze()
    run(n)


def valgrind(tool: list[str], which: str, n: int, row: str, url: str) -> None:
    """One measured process (``child``) under valgrind with ``tool``'s options."""
    cmd = ["valgrind", *tool, sys.executable, __file__, "--child", which, str(n), row, url]
    subprocess.run(
        cmd,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )


def parse(path: Path) -> tuple[list[int], dict[str, list[int]]]:
    """Cachegrind's totals and per-function counts of one output file."""
    total: list[int] = []
    per: dict[str, list[int]] = collections.defaultdict(lambda: [0] * len(EVENTS))
    fn = None
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("fn="):
            fn = line[3:]
        elif line.startswith("summary:"):
            total = [int(x) for x in line.split()[1:]]
        elif fn is not None and line[:1].isdigit():
            for i, v in enumerate(line.split()[1:]):
                per[fn][i] += int(v)
    return total, per


Counts = tuple[list[float], dict[str, list[float]]]


def measure(row: str, calls: int, url: str, work: Path) -> dict[str, Counts]:
    """Per call, for the floor and the transport: totals and per-function counts."""
    out: dict[str, Counts] = {}
    for which in ("floor", "tok"):
        runs = []
        for n in (0, calls):
            f = work / f"cg.{which}.{n}"
            tool = ["--tool=cachegrind", "--cache-sim=yes", "--LL=2097152,16,64"]
            valgrind([*tool, f"--cachegrind-out-file={f}"], which, n, row, url)
            runs.append(parse(f))
        (t0, p0), (t1, p1) = runs
        zero = [0] * len(EVENTS)
        per = {
            k: [(b - a) / calls for a, b in zip(p0.get(k, zero), v, strict=True)]
            for k, v in p1.items()
        }
        out[which] = ([(b - a) / calls for a, b in zip(t0, t1, strict=True)], per)
    return out


def instructions(path: Path) -> dict[int, int]:
    """Times each instruction of the extension ran, by address, from a callgrind output
    written with ``--dump-instr=yes --compress-pos=no --compress-strings=no``."""
    counts: dict[int, int] = collections.defaultdict(int)
    ours = after_call = False
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("ob="):
            ours = "_ratequeue" in line
        elif line.startswith("calls="):
            after_call = True  # the next cost line is the call's, not an instruction's
        elif line.startswith("0x"):
            if not after_call and ours:
                address, _line, cost = line.split()[:3]
                counts[int(address, 16)] += int(cost)
            after_call = False
    return counts


def pages(row: str, calls: int, url: str, work: Path) -> list[str]:
    """The extension's code each transport call runs: instructions, 64-byte lines and
    4 KiB pages (an instruction counts when it ran ``calls`` more times in the run of
    ``calls`` calls than in the run of none)."""
    runs = []
    for n in (0, calls):
        f = work / f"callgrind.{n}"
        tool = ["--tool=callgrind", "--dump-instr=yes", "--compress-pos=no"]
        tool += ["--compress-strings=no", f"--callgrind-out-file={f}"]
        valgrind(tool, "tok", n, row, url)
        runs.append(instructions(f))
    none, some = runs
    ran = [a for a, c in some.items() if c - none.get(a, 0) >= calls]
    return [
        f"## {row}: the extension's code per transport call ({calls} calls)",
        "",
        "| instructions | 64-byte lines | 4 KiB pages |",
        "|--:|--:|--:|",
        f"| {len(ran):,} | {len({a >> 6 for a in ran}):,} | {len({a >> 12 for a in ran})} |",
        "",
    ]


def report(row: str, calls: int, got: dict[str, Counts], top: int) -> list[str]:
    floor, tok = got["floor"], got["tok"]
    added = [t - f for f, t in zip(floor[0], tok[0], strict=True)]
    lines = [
        f"## {row}: per call ({calls} calls, after {WARM} to warm up)",
        "",
        "| | instructions | L1 code misses | **LL code misses** | LL data read misses "
        "| LL data write misses |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for name, v, sign in (
        ("floor", floor[0], ""),
        ("transport", tok[0], ""),
        ("added", added, "+"),
    ):
        c = [f"{x:{sign},.0f}" for x in v]
        lines.append(f"| {name} | {c[0]} | {c[1]} | **{c[2]}** | {c[5]} | {c[8]} |")
    zero = [0.0] * len(EVENTS)
    rows = []
    for k in set(floor[1]) | set(tok[1]):
        f, t = floor[1].get(k, zero), tok[1].get(k, zero)
        rows.append((t[2] - f[2], t[5] + t[8] - f[5] - f[8], t[0] - f[0], k))
    rows.sort(reverse=True)
    native = sum(r[0] for r in rows if "::" in r[3])
    lines += [
        "",
        f"Added LL code misses in Rust functions (names with `::`): {native:,.0f} of "
        f"{added[2]:,.0f}.",
        "",
        f"The {top} functions with the most added LL code misses (code, data, instructions):",
        "",
        "```",
    ]
    lines += [f"{r[0]:6.0f} {r[1]:6.0f} {r[2]:8.0f}  {r[3][:100]}" for r in rows[:top]]
    return [*lines, "```", ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--row", choices=["loopback", "memory"], default="loopback")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--keep", type=Path, help="write valgrind's output files here (kept)")
    ap.add_argument(
        "--pages",
        action="store_true",
        help="count the extension's code lines and pages a call runs (callgrind) instead",
    )
    ap.add_argument("--child", nargs=4, metavar=("WHICH", "N", "ROW", "URL"))
    args = ap.parse_args()
    if args.child:
        which, n, row, url = args.child
        child(which, int(n), row, url)
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (apt install valgrind)")
    from bench_transport import provider_process

    with provider_process(None) as url, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) if args.keep is None else args.keep
        work.mkdir(parents=True, exist_ok=True)
        if args.pages:
            lines = ["# The LLM transport's code per call (callgrind)", ""]
            lines += pages(args.row, args.calls, url, work)
        else:
            got = measure(args.row, args.calls, url, work)
            lines = [
                "# The LLM transport's added cache misses (cachegrind)",
                "",
                *report(args.row, args.calls, got, args.top),
            ]
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
