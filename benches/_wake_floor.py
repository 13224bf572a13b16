"""The floor of a timed wake-up, for the threads rows of ``bench_waiting.py``.

Threads that sleep to absolute deadlines through libc's ``clock_nanosleep`` (``ctypes``
releases the GIL around the call, as ratequeue's blocked ``acquire()`` does around its
wait) with this thread's timer slack at 1 ns (``prctl(PR_SET_TIMERSLACK, 1)``, as
ratequeue's self-timed waiters set it), no limiter at all. The lateness of each wake is
measured as ratequeue's: ``clock.now_ns()`` of ``rq.MonotonicClock`` read just after the
call returns, minus the time it was due (here the deadline; for ratequeue the grant's
schedule time), so a row of it is what the OS and the interpreter cost for one timed wake:

* one thread sleeping to deadlines ``gap`` apart (the floor of one timed wake);
* ``threads`` threads taking turns on the same schedule (slot ``i`` is thread
  ``i % threads``'s; each sleeps to its own slot): the floor of the scenario itself.

A slot whose deadline has already passed when its thread comes to it is not slept for
(as a grant due before its waiter arrives is granted at once, not queued) and is counted.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

CLOCK_MONOTONIC = 1
TIMER_ABSTIME = 1
PR_SET_TIMERSLACK = 29
PR_GET_TIMERSLACK = 30


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def available() -> bool:
    """True where libc's clock_nanosleep and prctl can be called (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return hasattr(libc, "clock_nanosleep") and hasattr(libc, "prctl")
    except OSError:
        return False


def run(clock: Any, threads: int, n: int, gap_ns: int) -> dict[str, Any]:
    """``n`` slots ``gap_ns`` apart shared round robin by ``threads`` threads; the
    figures of one run: lateness (seconds, sorted), missed slots, elapsed, CPU."""
    libc = ctypes.CDLL(None, use_errno=True)  # a CDLL call releases the GIL
    sleep = libc.clock_nanosleep
    sleep.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Timespec), ctypes.c_void_p]
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    mono = time.clock_gettime_ns
    now = clock.now_ns
    late: list[list[int]] = [[] for _ in range(threads)]
    missed = [0] * threads
    start = threading.Barrier(threads + 1)
    t0 = [0]
    last = [0] * threads

    def worker(k: int) -> None:
        prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
        ts = _Timespec()
        ref = ctypes.byref(ts)
        mine = late[k]
        start.wait()
        base = t0[0]
        for i in range(k, n, threads):
            due = base + i * gap_ns
            # The deadline on the OS clock: ratequeue's clock is the TSC scaled to
            # nanoseconds, so the two are paired afresh (between two readings of it).
            a = now()
            m = mono(CLOCK_MONOTONIC)
            b = now()
            if b >= due:
                missed[k] += 1
                continue
            at = due - (a + b) // 2 + m
            ts.tv_sec, ts.tv_nsec = divmod(at, 1_000_000_000)
            while sleep(CLOCK_MONOTONIC, TIMER_ABSTIME, ref, None) == 4:  # EINTR
                pass
            woke = now()
            mine.append(woke - due)
        last[k] = now()

    pool = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(threads)]
    for t in pool:
        t.start()
    cpu0 = time.process_time()
    # The first slot 1 ms after the start: every thread is at its first wait by then.
    begin = now()
    t0[0] = begin + 1_000_000
    start.wait()
    for t in pool:
        t.join()
    cpu = time.process_time() - cpu0
    return {
        "lateness": sorted(x / 1e9 for xs in late for x in xs),
        "missed": sum(missed),
        "elapsed": (max(last) - begin) / 1e9,
        "cpu": cpu,
        "grants": n,
    }
