"""Side-by-side runs of two builds, for the before/after benches.

Each build is an interpreter (``LABEL=PYTHON``, e.g. a venv holding another revision's
wheel) that runs the bench script's child mode in a subprocess and prints one JSON object
of figures; the builds alternate round by round, the order rotating each round, so a
drift of the shared machine hits both alike. Also: the CPU other processes used meanwhile
(read from ``/proc/stat``), per-call and thread-group timers, and a private redis-server.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

Figures = dict[str, float]


def builds_from(specs: Sequence[str], this: str | None = "this build") -> list[tuple[str, str]]:
    """``LABEL=PYTHON`` specs as (label, python); ``this`` (if given) leads with sys.executable."""
    out = [(this, sys.executable)] if this is not None else []
    for spec in specs:
        label, sep, python = spec.partition("=")
        if not sep or not label or not python:
            raise SystemExit(f"a build is LABEL=PYTHON, got {spec!r}")
        out.append((label, python))
    return out


def run_rounds(
    script: str | Path,
    builds: Sequence[tuple[str, str]],
    rounds: int,
    variants: Mapping[str, Sequence[str]],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    progress: bool = True,
) -> dict[str, dict[str, list[Figures]]]:
    """``[python, script, *variant_args]`` for every variant and build, ``rounds`` times.

    Returns ``results[variant][label]``: one dict of figures per round (the child's last
    stdout line, a JSON object). Within a round the build order rotates by one each round.
    """
    results: dict[str, dict[str, list[Figures]]] = {
        v: {label: [] for label, _ in builds} for v in variants
    }
    script = str(Path(script).resolve())
    full_env = dict(os.environ, **(env or {}))
    for k in range(rounds):
        order = list(builds[k % len(builds) :]) + list(builds[: k % len(builds)])
        for variant, args in variants.items():
            for label, python in order:
                proc = subprocess.run(
                    [python, script, *args],
                    capture_output=True,
                    text=True,
                    env=full_env,
                    cwd=cwd,
                )
                if proc.returncode != 0:
                    raise SystemExit(
                        f"{label} ({python}) failed on {variant or 'the rows'}:\n{proc.stderr}"
                    )
                last = proc.stdout.strip().splitlines()[-1]
                results[variant][label].append(json.loads(last))
        if progress:
            print(f"round {k + 1}/{rounds} done", file=sys.stderr, flush=True)
    return results


def best(runs: Sequence[Figures]) -> Figures:
    """The lowest figure of each key over the rounds (keys absent in a round are skipped)."""
    out: Figures = {}
    for r in runs:
        for key, v in r.items():
            out[key] = min(v, out.get(key, v))
    return out


def median(runs: Sequence[Figures]) -> Figures:
    """The median of each key over the rounds that have it."""
    keys = {key for r in runs for key in r}
    return {key: statistics.median(r[key] for r in runs if key in r) for key in keys}


def _busy_jiffies() -> int:
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in parts[:8])
    return user + nice + system + irq + softirq + steal


def _own_cpu_s() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass
class Machine:
    """How busy the machine was while a bench ran: load averages and others' CPU."""

    load_start: float = field(default_factory=lambda: os.getloadavg()[0])
    _t0: float = field(default_factory=time.monotonic)
    _busy0: int = field(default_factory=_busy_jiffies)
    _own0: float = field(default_factory=_own_cpu_s)

    def summary(self) -> str:
        """One sentence: interpreter, CPUs, loads, and the CPUs other processes used."""
        elapsed = time.monotonic() - self._t0
        hz = os.sysconf("SC_CLK_TCK")
        busy = (_busy_jiffies() - self._busy0) / hz
        others = max(0.0, busy - (_own_cpu_s() - self._own0)) / max(elapsed, 1e-9)
        return (
            f"Python {platform.python_version()}, {platform.system()} {platform.machine()}, "
            f"{os.cpu_count()} CPUs; load average {self.load_start:.1f} at the start and "
            f"{os.getloadavg()[0]:.1f} at the end; other processes used {others:.2f} CPUs "
            f"on average during the {elapsed:.0f} s run"
        )


def per_call_us(fn: Callable[[], object], n: int = 200_000) -> float:
    """Wall µs per call of ``fn`` over ``n`` calls."""
    perf = time.perf_counter
    t0 = perf()
    for _ in range(n):
        fn()
    return (perf() - t0) / n * 1e6


def cpu_per_call_us(fn: Callable[[], object], n: int = 200_000) -> float:
    """CPU µs (this process, every thread) per call of ``fn`` over ``n`` calls."""
    cpu = time.process_time
    t0 = cpu()
    for _ in range(n):
        fn()
    return (cpu() - t0) / n * 1e6


def threads(work: Callable[[int], None], n_threads: int, total: int) -> tuple[float, float]:
    """Elapsed s and CPU µs per unit for ``total`` units of ``work`` over ``n_threads``."""
    each = total // n_threads
    start = threading.Barrier(n_threads + 1)

    def run() -> None:
        start.wait()
        work(each)

    ts = [threading.Thread(target=run) for _ in range(n_threads)]
    for t in ts:
        t.start()
    c0 = time.process_time()
    start.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    elapsed = time.perf_counter() - t0
    return elapsed, (time.process_time() - c0) / (each * n_threads) * 1e6


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A private redis-server on a free loopback port (no persistence); yields its URL."""
    binary = os.environ.get("RATEQUEUE_REDIS_SERVER") or shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="rq-bench-redis-")
    proc = subprocess.Popen(
        [
            *(binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""),
            *("--appendonly", "no", "--dir", workdir, "--loglevel", "warning"),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", port), timeout=0.2) as s,
            ):
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"redis-server did not start on port {port}")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
