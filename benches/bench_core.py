"""pytest-benchmark benches of ratequeue's Python calls (the installed extension).

Run (from this folder, against the package installed in .venv)::

    cd benches && ../.venv/bin/python -m pytest -q bench_core.py --benchmark-only

Every bench states what the call must return and checks it once more after timing, so a
bench that silently measures the wrong path (e.g. a refusal instead of an admission, once
a bucket has run dry) fails instead of reporting a flattering figure.

Limits used for "admit": 1e9 units per second (one unit per ns, ratequeue's fastest rate)
with a burst far larger than what the bench can consume, so every call is admitted.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("pytest_benchmark")
rq = pytest.importorskip("ratequeue")

# Burst of the always-admitting limits: 1e9 units at 1e9/s is a one-second window;
# 1e15 (about 11.6 days at 1e9/s) is used where the clock does not move.
BURST = 10**9
BURST_FROZEN = 10**15


@pytest.fixture(autouse=True, scope="module")
def _warm_clock() -> None:
    """Read the monotonic clock once before any timing: the first read in a process
    calibrates the TSC (about 0.6 ms here), which would otherwise land in
    pytest-benchmark's calibration and make it pick 1 iteration per round."""
    rq.MonotonicClock().now_ns()


def always(**kw: object) -> rq.Limiter:
    """A limiter that admits every call of a bench (monotonic clock unless given)."""
    return rq.Limiter(rq.Rate(1e9, per="second", burst=BURST), **kw)


def drained() -> rq.Limiter:
    """A limiter that refuses every call of a bench: 1 per day, its only unit spent."""
    lim = rq.Limiter(rq.Rate(1, per="day", burst=1))
    assert lim.try_acquire() is True
    return lim


@pytest.mark.benchmark(group="floor")
def test_noop_floor(benchmark):
    """_Floor().noop(): the cost of calling a method of the extension at all."""
    assert benchmark(rq._ratequeue._Floor().noop) is None


@pytest.mark.benchmark(group="try_acquire")
def test_try_acquire_admit(benchmark):
    """try_acquire() on one rate, monotonic clock, admitted: the hot path."""
    lim = always()
    assert lim.try_acquire() is True
    assert benchmark(lim.try_acquire) is True
    assert lim.try_acquire() is True


@pytest.mark.benchmark(group="try_acquire")
def test_try_acquire_refuse(benchmark):
    """try_acquire() refused (returns False, raises nothing, consumes nothing)."""
    lim = drained()
    assert lim.try_acquire() is False
    assert benchmark(lim.try_acquire) is False
    assert lim.try_acquire() is False


@pytest.mark.benchmark(group="try_acquire")
def test_try_acquire_cost_positional(benchmark):
    """try_acquire(1): the same decision as try_acquire(), with the cost passed."""
    lim = always()
    assert benchmark(lim.try_acquire, 1) is True


@pytest.mark.benchmark(group="try_acquire")
def test_try_acquire_two_units(benchmark):
    """try_acquire(tokens=100) on requests + tokens: two buckets, all-or-nothing."""
    lim = rq.Limiter(
        rq.Rate(1e9, per="second", burst=BURST, unit="requests"),
        rq.Rate(1e9, per="second", burst=BURST_FROZEN, unit="tokens"),
    )
    assert lim.try_acquire(tokens=100) is True
    assert benchmark(lim.try_acquire, tokens=100) is True
    assert lim.try_acquire(tokens=100) is True


@pytest.mark.benchmark(group="try_acquire")
def test_try_acquire_manual_clock(benchmark):
    """try_acquire() with a ManualClock that never moves (no clock read cost)."""
    clock = rq.ManualClock()
    lim = rq.Limiter(rq.Rate(1e9, per="second", burst=BURST_FROZEN), clock=clock)
    assert lim.try_acquire() is True
    assert benchmark(lim.try_acquire) is True
    assert lim.try_acquire() is True


@pytest.mark.benchmark(group="reserve")
def test_reserve_admit(benchmark):
    """reserve() granted at once: returns a Reservation with delay 0."""
    lim = always()
    r = benchmark(lim.reserve)
    assert isinstance(r, rq.Reservation)
    assert r.delay == 0.0


@pytest.mark.benchmark(group="reserve")
def test_reserve_overloaded(benchmark):
    """reserve(max_wait=0) refused: raises Overloaded (timed with its try/except)."""
    lim = drained()

    def call() -> bool:
        try:
            lim.reserve(max_wait=0)
        except rq.Overloaded:
            return True
        return False

    assert benchmark(call) is True


@pytest.mark.benchmark(group="clock")
def test_manual_clock_now_ns(benchmark):
    """ManualClock.now_ns(): reading a manual clock from Python."""
    clock = rq.ManualClock()
    assert benchmark(clock.now_ns) == 0


@pytest.mark.benchmark(group="clock")
def test_monotonic_clock_now_ns(benchmark):
    """MonotonicClock.now_ns(): the clock every limiter reads by default."""
    clock = rq.MonotonicClock()
    assert benchmark(clock.now_ns) >= 0


# ---- side by side in one process: ``python benches/bench_core.py [ROUNDS N] [--cpu]`` -----

_SIDE_BY_SIDE = [
    ("the timing loop alone", "pass"),
    ("floor: a plain Python function call", "py_noop()"),
    ("floor: the extension's no-op method", "floor.noop()"),
    ("try_acquire() admitted (monotonic clock)", "lim.try_acquire()"),
    ("try_acquire(1) admitted", "lim.try_acquire(1)"),
    ("try_acquire() refused", "dry.try_acquire()"),
    ("try_acquire() admitted (ManualClock)", "frozen.try_acquire()"),
]


def _floor(lim: rq.Limiter) -> object:
    """An object whose ``noop()`` method is the extension's own no-op method (``_Floor``,
    or the limiter itself, whose ``_noop`` it was before ``_Floor`` existed)."""
    floor = getattr(rq._ratequeue, "_Floor", None)
    return floor() if floor is not None else lim


def side_by_side(rounds: int = 31, number: int = 200_000, cpu: bool = False) -> str:
    """Interleaved rounds of plain timing loops; a markdown table of ns per call (of this
    thread's CPU time with ``cpu``: a descheduled thread accrues none, so the figures hold
    on a loaded machine)."""
    import os
    import statistics
    import timeit

    def py_noop() -> None:
        return None

    rq.MonotonicClock().now_ns()
    lim = always()
    env = {
        "py_noop": py_noop,
        "floor": _floor(lim),
        "lim": lim,
        "dry": drained(),
        "frozen": rq.Limiter(
            rq.Rate(1e9, per="second", burst=BURST_FROZEN), clock=rq.ManualClock()
        ),
    }
    assert env["lim"].try_acquire() and env["frozen"].try_acquire() and not env["dry"].try_acquire()
    noop = "floor.noop()" if hasattr(env["floor"], "noop") else "floor._noop()"
    clock = time.thread_time if cpu else time.perf_counter
    timers = {
        stmt: timeit.Timer(noop if stmt == "floor.noop()" else stmt, timer=clock, globals=env)
        for _, stmt in _SIDE_BY_SIDE
    }
    runs: dict[str, list[float]] = {stmt: [] for _, stmt in _SIDE_BY_SIDE}
    load0, cpu0, t0 = os.getloadavg()[0], os.times(), time.perf_counter()
    for r in range(rounds):
        order = _SIDE_BY_SIDE[r % len(_SIDE_BY_SIDE) :] + _SIDE_BY_SIDE[: r % len(_SIDE_BY_SIDE)]
        for _, stmt in order:
            runs[stmt].append(timers[stmt].timeit(number) / number * 1e9)
    assert env["lim"].try_acquire() and env["frozen"].try_acquire() and not env["dry"].try_acquire()
    wall, cpu1 = time.perf_counter() - t0, os.times()
    own = (cpu1.user - cpu0.user + cpu1.system - cpu0.system) / wall
    loop_med = statistics.median(runs["pass"])
    loop_min = min(runs["pass"])
    noop_med = statistics.median(runs["floor.noop()"]) - loop_med
    noop_min = min(runs["floor.noop()"]) - loop_min
    lines = [
        f"{rounds} interleaved rounds of {number:,} calls each (timeit loops); ns per call"
        + (" of the thread's CPU time (`time.thread_time`)," if cpu else " (wall time),"),
        "then the same less the timing loop alone; ratio = (call - loop) / (no-op - loop).",
        f"Load average at start {load0:.2f} (2 vCPUs); this process used {own:.0%} of one core.",
        "",
        "| call | min ns | median ns | median - loop | ratio to the no-op (median) | (min) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, stmt in _SIDE_BY_SIDE:
        med, lo = statistics.median(runs[stmt]), min(runs[stmt])
        if stmt == "pass":
            lines.append(f"| {name} | {lo:.1f} | {med:.1f} | | | |")
            continue
        lines.append(
            f"| {name} (`{stmt}`) | {lo:.1f} | {med:.1f} | {med - loop_med:.1f} |"
            f" {(med - loop_med) / noop_med:.2f}x | {(lo - loop_min) / noop_min:.2f}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    args = [a for a in sys.argv[1:] if a != "--cpu"]
    print(side_by_side(*(int(a) for a in args[:2]), cpu="--cpu" in sys.argv[1:]))
