"""Issue 10, defect 8: percentiles rank exactly; a snapshot is never inconsistent.

``percentile(q)`` is the value of rank ceil(q/100 * n) (nearest rank, at least 1), with
q read as the decimal it prints as: computed in floating point, p7, p14, p28, p55 and
p56 of 100 values landed one rank high. A snapshot taken while another thread records
could show values counted with min = MAX and max = 0.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from fractions import Fraction

import numpy as np
import pytest
import ratequeue as rq


def exact_rank(q: float, n: int) -> int:
    return max(1, math.ceil(Fraction(repr(q)) * n / 100))


def filled(n: int) -> rq.Histogram:
    """Values 1..n nanoseconds: every one in its own exact bucket."""
    h = rq.Histogram()
    h.record_many(np.arange(1, n + 1, dtype=np.float64) / 1e9)
    assert h.count == n
    return h


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 99, 100, 101, 333, 1000])
def test_every_integer_percentile_has_the_exact_rank(n: int) -> None:
    h = filled(n)
    qs = [float(q) for q in range(101)]
    want = [exact_rank(q, n) for q in qs]
    got_one = [round(h.percentile(q) * 1e9) for q in qs]
    got_many = [round(v * 1e9) for v in h.percentiles(qs)]
    assert got_one == want
    assert got_many == want


def test_p7_of_1_to_100_is_the_7th_value() -> None:
    h = filled(100)
    for q in (7, 14, 28, 55, 56):
        assert round(h.percentile(q) * 1e9) == q


@pytest.mark.parametrize("q", [0.1, 0.5, 12.5, 33.3, 66.7, 99.9, 99.99, 1e-9, 50.000001])
@pytest.mark.parametrize("n", [10, 1000])
def test_decimal_percentiles_rank_as_written(q: float, n: int) -> None:
    assert round(filled(n).percentile(q) * 1e9) == exact_rank(q, n)


def test_snapshot_never_inconsistent_while_recording() -> None:
    """record_many adds with the GIL released while this thread resets and reads."""
    values = np.geomspace(1e-6, 10.0, 5000)
    lo, hi = float(values[0]), float(values[-1])
    h = rq.Histogram()
    stop = threading.Event()
    errors: list[BaseException] = []

    def record() -> None:
        try:
            while not stop.is_set():
                h.record_many(values)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    bad: list[tuple[str, int, float, float]] = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=record)
    t.start()
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and len(bad) < 5:
            for name, s in (("reset", h.reset()), ("live", h.copy())):
                n = s.count
                if n == 0:
                    continue
                mn, mx = s.min, s.max
                if not (lo * 0.99 <= mn <= mx <= hi * 1.01):
                    bad.append((name, n, mn, mx))
                p = s.percentiles([0, 100])
                if not (mn <= p[0] <= p[1] <= mx):
                    bad.append((name + " percentiles", n, p[0], p[1]))
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert not errors
    assert not bad, bad[:5]
