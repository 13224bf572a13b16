"""Run the benchmark scripts and gather their markdown into ``benches/results/RESULTS.md``.

Each script (by default ``compare_peers.py``, ``bench_waiting.py`` and
``bench_histogram.py``, those present) runs in its own process with this interpreter and
writes its own markdown into ``benches/results/``; this script then concatenates every
``results/*.md`` (the scripts' first, in run order, then any other, e.g. from
``bench_keyed.py``) under one header, with the latest asv results if there are any.
A script that fails or times out gets a section saying so; the others still run.

Usage::

    .venv/bin/python benches/report.py [--quick] [--skip compare_peers.py ...]
        [--collect-only] [--timeout 1800] [--out benches/results/RESULTS.md]

``make bench`` runs it last, with ``--skip compare_peers.py`` since ``bench-peers`` has
just written that table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
DEFAULT_OUT = RESULTS / "RESULTS.md"
SCRIPTS = ("compare_peers.py", "bench_waiting.py", "bench_histogram.py")
# Flags that make a script short, passed with --quick when the script knows them.
QUICK: dict[str, list[str]] = {
    "compare_peers.py": ["--rounds", "5"],
    "bench_waiting.py": ["--quick"],
    "bench_histogram.py": ["--rounds", "3", "--bulk-rounds", "1", "--no-cargo"],
}


@dataclass
class Ran:
    script: str
    code: int | None  # None: timed out
    seconds: float
    wrote: list[Path]
    tail: str


def _accepts(script: Path, flag: str) -> bool:
    return f'"{flag}"' in script.read_text(errors="replace")


def run_script(script: Path, extra: list[str], timeout: float) -> Ran:
    """Run one benchmark script; note which markdown files it wrote."""
    before = {p: p.stat().st_mtime for p in RESULTS.glob("*.md")}
    start = time.time()
    cmd = [sys.executable, str(script), *extra]
    print(f"== {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        code: int | None = proc.returncode
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code = None
        output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else ""
    wrote = sorted(
        p
        for p in RESULTS.glob("*.md")
        if p.name != DEFAULT_OUT.name and p.stat().st_mtime > before.get(p, 0.0)
    )
    tail = "\n".join(output.strip().splitlines()[-15:])
    took = time.time() - start
    status = "timed out" if code is None else f"exit {code}"
    print(f"   {status} after {took:.0f} s; wrote {[p.name for p in wrote]}", file=sys.stderr)
    return Ran(script.name, code, took, wrote, tail)


def _demote(markdown: str) -> str:
    """Push every heading down one level (outside code fences), so each file nests."""
    out: list[str] = []
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,5} ", line):
            line = "#" + line
        out.append(line)
    return "\n".join(out).strip() + "\n"


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _asv_section() -> str | None:
    conf = HERE / "asv" / "asv.conf.json"
    asv = shutil.which("asv") or str(Path(sys.executable).with_name("asv"))
    commit = _git("rev-parse", "HEAD")[:8]
    if not conf.exists() or not Path(asv).exists() or not commit:
        return None
    if not any((HERE / "asv" / "results").glob(f"*/{commit}*.json")):
        return None
    try:
        shown = subprocess.run(
            [asv, "show", commit], cwd=conf.parent, capture_output=True, text=True, timeout=60
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if not shown:
        return None
    return f"## asv (`benches/asv`, commit {commit})\n\n```\n{shown}\n```\n"


def assemble(ran: list[Ran], out: Path) -> Path:
    """Write RESULTS.md from the scripts' markdown (and every other results/*.md)."""
    parts = [
        "# ratequeue benchmark results",
        "",
        f"Gathered by `benches/report.py` on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} "
        f"UTC: commit {_git('rev-parse', '--short', 'HEAD') or '?'}"
        f"{' (dirty tree)' if _git('status', '--porcelain', '--untracked-files=no') else ''}, "
        f"Python {platform.python_version()} ({platform.python_implementation()}), "
        f"{platform.system()} {platform.release()} {platform.machine()}, "
        f"{os.cpu_count()} CPUs. Each section below is one script's own file in "
        "`benches/results/`; read the ratios, not the absolute times, on a shared machine.",
        "",
    ]
    if ran:
        parts += ["| script | outcome | seconds | wrote |", "|---|---|---|---|"]
        for r in ran:
            outcome = "timed out" if r.code is None else ("ok" if r.code == 0 else f"exit {r.code}")
            wrote = ", ".join(f"`{p.name}`" for p in r.wrote) or "-"
            parts.append(f"| `{r.script}` | {outcome} | {r.seconds:.0f} | {wrote} |")
        parts.append("")
    ordered: list[Path] = []
    for r in ran:
        ordered += [p for p in r.wrote if p not in ordered]
    ordered += sorted(p for p in RESULTS.glob("*.md") if p not in ordered and p.name != out.name)
    for p in ordered:
        parts.append(_demote(p.read_text()))
    for r in ran:
        if r.code != 0:
            parts.append(
                f"## `{r.script}` did not finish ({'timed out' if r.code is None else r.code})"
                f"\n\n```\n{r.tail}\n```\n"
            )
    asv = _asv_section()
    if asv:
        parts.append(asv)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(parts).rstrip() + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--scripts", nargs="*", default=list(SCRIPTS), help="scripts to run")
    ap.add_argument("--skip", action="append", default=[], help="a script not to run")
    ap.add_argument("--quick", action="store_true", help="short runs (fewer rounds)")
    ap.add_argument("--collect-only", action="store_true", help="run nothing, only gather")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per script")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    ran: list[Ran] = []
    if not args.collect_only:
        for name in args.scripts:
            script = HERE / name
            if name in args.skip or not script.exists():
                continue
            extra = []
            if args.quick:
                flags = QUICK.get(name, [])
                if flags and _accepts(script, flags[0]):
                    extra = flags
            ran.append(run_script(script, extra, args.timeout))
    out = assemble(ran, args.out)
    print(f"wrote {out}")
    return 0 if all(r.code == 0 for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
