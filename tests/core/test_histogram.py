"""rq.Histogram (values in seconds, decimal log-linear, 3 significant digits) and the
queue-wait statistics of Limiter and Concurrency.

Percentiles are checked against the exact nearest rank, ceil(q/100 * n) with q read as
the decimal it prints as (numpy's method="inverted_cdf" computes that rank in floating
point and lands one high, e.g. at p7 of 100 values),
bucket counts against numpy.histogram on the exported edges, ``le`` counts against exact
counting, and limiter statistics against a scripted run on a ManualClock whose every
grant time is known in advance (rates of whole units per second, so schedule times are
exact in nanoseconds).

Edge cases found while writing these tests (overflowing min, inconsistent serialised
headers, a wrapping sum, Concurrency waits and tries) are pinned as regular tests.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import pytest

if os.environ.get("CI", "").lower() == "true":
    # In CI (the test extra) a missing package is a failure, never a silent skip.
    import hypothesis  # noqa: F401
    import numpy as np
else:
    np = pytest.importorskip("numpy")
    pytest.importorskip("hypothesis")

import ratequeue as rq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

NS = 1_000_000_000
#: Values below this are counted as underflow (1 us), above MAX_S as overflow (10^10 s).
UNDERFLOW_S = 1e-6
MAX_S = 1e10
MAX_NS = 10**19

QS = [50.0, 90.0, 99.0, 99.9]

SLOW = settings(
    deadline=None,
    max_examples=30,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --------------------------------------------------------------------------- helpers


def hist_of(values: Any) -> rq.Histogram:
    h = rq.Histogram()
    h.record_many(np.ascontiguousarray(values, dtype=np.float64))
    return h


def ns_to_s(ns: Any) -> Any:
    """Integer nanoseconds as float seconds, the way the library converts them."""
    return np.asarray(ns, dtype=np.int64).astype(np.float64) / 1e9


def state(h: rq.Histogram) -> tuple[Any, ...]:
    """Everything observable about a histogram, for equality checks."""
    counts, edges = h.to_numpy()
    return (
        h.count,
        h.sum,
        None if h.count == 0 else h.min,
        None if h.count == 0 else h.max,
        h.underflow,
        h.overflow,
        counts.tolist(),
        edges.tolist(),
        h.to_bytes(),
    )


def sample(shape: str, rng: Any, n: int, a: float, b: float) -> Any:
    """n seconds of a given shape; every percentile up to 99.9 stays well inside the
    tracked range (1 us .. 10^4 s)."""
    if shape == "uniform":
        low = a  # [0, 1] s
        width = 10.0**b  # 1 ms .. 100 s
        return rng.uniform(low, low + width, n)
    if shape == "lognormal":
        median = 10.0**a  # 0.1 ms .. 1 s
        return rng.lognormal(math.log(median), b, n)  # sigma 0.25 .. 2
    if shape == "pareto":
        xm = 10.0**a  # 0.1 ms .. 10 ms
        return xm * (1.0 + rng.pareto(b, n))  # alpha 0.8 .. 3: heavy tail
    raise AssertionError(shape)


SHAPES = {
    "uniform": (st.floats(0.0, 1.0), st.floats(-3.0, 2.0)),
    "lognormal": (st.floats(-4.0, 0.0), st.floats(0.25, 2.0)),
    "pareto": (st.floats(-4.0, -2.0), st.floats(0.8, 3.0)),
}


@st.composite
def datasets(draw: Callable[..., Any]) -> tuple[str, Any]:
    shape = draw(st.sampled_from(sorted(SHAPES)))
    pa, pb = SHAPES[shape]
    a, b = draw(pa), draw(pb)
    n = draw(st.integers(100_000, 200_000))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    return f"{shape}(a={a:.3g}, b={b:.3g}, n={n}, seed={seed})", sample(shape, rng, n, a, b)


def nearest_rank(x: Any, q: float) -> float:
    k = max(1, math.ceil(Fraction(repr(q)) * len(x) / 100))
    return float(np.partition(np.asarray(x), k - 1)[k - 1])


# --------------------------------------------------------------------------- percentiles


@SLOW
@given(datasets())
def test_percentiles_within_one_percent_of_nearest_rank(data: tuple[str, Any]) -> None:
    label, x = data
    h = hist_of(x)
    assert h.count == len(x)
    got = h.percentiles(QS)
    for q, g in zip(QS, got, strict=True):
        want = nearest_rank(x, q)
        assert abs(g - want) <= 0.01 * want, (label, q, g, want)
        # The documented bound: the bucket midpoint is within 0.5 % (plus the 0.5 ns
        # rounding of each value to whole nanoseconds).
        assert abs(g - want) <= 0.005 * want + 0.5e-9, (label, q, g, want)
        assert g == h.percentile(q)


def test_percentiles_of_record_loop_match_record_many() -> None:
    rng = np.random.default_rng(7)
    x = rng.lognormal(math.log(0.02), 1.0, 100_000)
    h = rq.Histogram()
    for v in x.tolist():
        h.record(v)
    assert state(h) == state(hist_of(x))
    for q, g in zip(QS, h.percentiles(QS), strict=True):
        want = nearest_rank(x, q)
        assert abs(g - want) <= 0.01 * want


def test_percentiles_exact_below_one_microsecond() -> None:
    rng = np.random.default_rng(3)
    ns = rng.integers(0, 1000, 100_000)
    x = ns_to_s(ns)
    h = hist_of(x)
    assert h.underflow == len(x)
    qs = [0.0, 1.0, 25.0, *QS, 100.0]
    for q, g in zip(qs, h.percentiles(qs), strict=True):
        assert g == nearest_rank(x, q), q
    assert h.percentile(0) == h.min == x.min()
    assert h.percentile(100) == h.max == x.max()


def test_percentile_edge_cases() -> None:
    h = rq.Histogram()
    assert math.isnan(h.percentile(50))
    assert all(math.isnan(v) for v in h.percentiles([0, 50, 100]))
    assert h.percentiles([]) == []
    h.record(0.25)
    # One value: every percentile is that value (clamped to [min, max]).
    assert h.percentiles([0, 50, 100]) == [0.25, 0.25, 0.25]
    for bad in [-0.1, 100.1, math.nan, math.inf]:
        with pytest.raises(ValueError):
            h.percentile(bad)
        with pytest.raises(ValueError):
            h.percentiles([50, bad])


# --------------------------------------------------------------------------- threads


THREADS = 8


def run_threads(target: Callable[[int], None], n: int = THREADS) -> None:
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            barrier.wait()
            target(i)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in ts)


def thread_values(i: int, n: int) -> Any:
    """Per-thread integer-nanosecond values (so sums are exact), 1 us .. ~100 s."""
    rng = np.random.default_rng(1000 + i)
    return rng.integers(1_000, 100 * NS, n)


def test_threads_record_lose_nothing() -> None:
    per = 20_000
    values = [ns_to_s(thread_values(i, per)).tolist() for i in range(THREADS)]
    h = rq.Histogram()

    def work(i: int) -> None:
        rec = h.record
        for v in values[i]:
            rec(v)

    run_threads(work)
    assert h.count == THREADS * per
    reference = hist_of(np.concatenate([np.asarray(v) for v in values]))
    assert state(h) == state(reference)


def test_threads_record_many_and_record_together_lose_nothing() -> None:
    per, rounds = 50_000, 5
    arrays = [ns_to_s(thread_values(i, per)) for i in range(THREADS)]
    h = rq.Histogram()

    def work(i: int) -> None:
        if i % 2:
            for _ in range(rounds):
                h.record_many(arrays[i])
        else:
            rec = h.record
            for v in arrays[i][: per // 5].tolist():
                rec(v)

    # A reader taking snapshots meanwhile sees the count only grow.
    seen: list[int] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            seen.append(h.count)
            time.sleep(0.0005)

    r = threading.Thread(target=reader)
    r.start()
    try:
        run_threads(work)
    finally:
        stop.set()
        r.join()
    expected = [
        np.tile(arrays[i], rounds) if i % 2 else arrays[i][: per // 5] for i in range(THREADS)
    ]
    want = np.concatenate(expected)
    assert h.count == len(want)
    assert state(h) == state(hist_of(want))
    assert seen == sorted(seen)


def test_reset_while_recording_loses_nothing() -> None:
    per = 20_000
    arrays = [ns_to_s(thread_values(i, per)) for i in range(4)]
    h = rq.Histogram()
    total = rq.Histogram()
    done = threading.Event()
    resets = 0

    def resetter() -> None:
        nonlocal resets
        while not done.is_set():
            total.merge(h.reset())
            resets += 1
            time.sleep(0.0002)

    def writer(i: int) -> None:
        for chunk in np.array_split(arrays[i], 50):
            h.record_many(chunk)
        for v in arrays[i][:2000].tolist():
            h.record(v)

    r = threading.Thread(target=resetter)
    r.start()
    try:
        run_threads(writer, 4)
    finally:
        done.set()
        r.join(60)
    total.merge(h)
    assert resets > 0
    want = hist_of(np.concatenate([np.concatenate([a, a[:2000]]) for a in arrays]))
    assert total.count == want.count
    assert total.sum == want.sum
    assert total.to_numpy()[0].tolist() == want.to_numpy()[0].tolist()


# --------------------------------------------------------------------------- merge / bytes

in_range = st.floats(0.0, 1e4, allow_nan=False, allow_infinity=False)


@settings(deadline=None, max_examples=150)
@given(st.lists(in_range, max_size=60), st.lists(in_range, max_size=60))
def test_merge_equals_recording_both(a: list[float], b: list[float]) -> None:
    ha, hb = rq.Histogram(), rq.Histogram()
    for v in a:
        ha.record(v)
    for v in b:
        hb.record(v)
    merged = ha.copy()
    merged.merge(hb)
    both = rq.Histogram()
    for v in a + b:
        both.record(v)
    assert state(merged) == state(both)
    # The sources are unchanged, and a copy is independent of its origin.
    assert ha.count == len(a)
    assert hb.count == len(b)


@settings(deadline=None, max_examples=150)
@given(st.lists(in_range, max_size=80))
def test_bytes_round_trip(values: list[float]) -> None:
    h = rq.Histogram()
    for v in values:
        h.record(v)
    back = rq.Histogram.from_bytes(h.to_bytes())
    assert isinstance(back, rq.Histogram)
    assert state(back) == state(h)
    assert back.percentiles(QS) == h.percentiles(QS) or h.count == 0


def test_bytes_round_trip_out_of_range_and_merge_self() -> None:
    h = rq.Histogram()
    for v in [0.0, 1e-9, 5e-7, 1e-6, 0.00123, 1.0, 9999.0, 1e4, 2e4, 1e12]:
        h.record(v)
    back = rq.Histogram.from_bytes(h.to_bytes())
    assert state(back) == state(h)
    assert (back.underflow, back.overflow) == (3, 1)
    before = state(h)
    h.merge(h)  # merging into itself doubles it
    assert h.count == 2 * before[0]
    assert h.to_numpy()[0].tolist() == [2 * c for c in before[6]]


GARBAGE = [
    b"",
    b"nope",
    b"RQH1",
    b"RQH1" + b"\0" * 39,  # header one byte short
    b"RQH2" + b"\0" * 40,  # wrong magic
    b"\0" * 44,
    b"RQH1" + b"\0" * 40 + b"\x05",  # delta without a count
    b"RQH1" + b"\0" * 40 + b"\x05\x80",  # truncated varint
    b"RQH1" + b"\0" * 40 + b"\xa9\x78\x01",  # bucket 15401: out of range
    b"RQH1" + b"\0" * 40 + b"\xff" * 11,  # varint longer than 64 bits
    # Two entries for one bucket whose counts overflow u64.
    b"RQH1" + b"\0" * 40 + b"\x00" + b"\xff" * 9 + b"\x01" + b"\x00\x01",
]


@pytest.mark.parametrize("data", GARBAGE, ids=range(len(GARBAGE)))
def test_from_bytes_garbage_raises_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        rq.Histogram.from_bytes(data)


def test_from_bytes_truncated_real_data() -> None:
    h = hist_of([0.001, 0.5, 3.0])
    b = h.to_bytes()
    with pytest.raises(ValueError):
        rq.Histogram.from_bytes(b[:-1])
    with pytest.raises(ValueError):
        rq.Histogram.from_bytes(b[:20])
    with pytest.raises(TypeError):
        rq.Histogram.from_bytes("RQH1")  # type: ignore[arg-type]


@settings(deadline=None, max_examples=300)
@given(st.one_of(st.binary(max_size=80), st.binary(min_size=40, max_size=80).map(b"RQH1".__add__)))
def test_from_bytes_never_raises_anything_but_value_error(data: bytes) -> None:
    try:
        h = rq.Histogram.from_bytes(data)
    except ValueError:
        return
    assert h.count == sum(h.to_numpy()[0].tolist())


# --------------------------------------------------------------------------- to_numpy


@SLOW
@given(st.integers(0, 2**32 - 1), st.integers(1, 50_000))
def test_to_numpy_consistent(seed: int, n: int) -> None:
    rng = np.random.default_rng(seed)
    # Integer nanoseconds over the whole range, log-uniform, plus exact edges.
    ns = np.unique(np.concatenate([(10.0 ** rng.uniform(0, 13, n)).astype(np.int64), [0, 1]]))
    ns = np.concatenate([ns, ns[:10]])  # some values twice
    x = ns_to_s(ns)
    h = hist_of(x)
    counts, edges = h.to_numpy()
    assert counts.dtype == np.uint64
    assert edges.dtype == np.float64
    assert len(edges) == len(counts) + 1
    assert int(counts.sum()) == h.count == len(x)
    assert np.all(np.diff(edges) > 0)
    assert counts[-1] > 0  # trimmed after the last non-empty bucket
    # Every value falls in its bucket, numpy.histogram's way ([lo, hi)).
    assert np.array_equal(np.histogram(x, bins=edges)[0], counts.astype(np.int64))
    i = np.searchsorted(edges, x, side="right") - 1
    assert np.all((edges[i] <= x) & (x < edges[i + 1]))
    # Buckets are at most 1 % wide from 100 ns on, and exact (1 ns) below 1 us.
    lo, hi = edges[:-1], edges[1:]
    wide = lo >= 100e-9
    assert np.all((hi[wide] - lo[wide]) / lo[wide] <= 0.01 + 1e-9)
    small = hi <= 1001e-9
    assert np.allclose(hi[small] - lo[small], 1e-9, rtol=1e-6)


def test_to_numpy_empty_and_exact_le_edges() -> None:
    counts, edges = rq.Histogram().to_numpy()
    assert counts.tolist() == []
    assert edges.tolist() == [0.0]
    # Three-significant-digit values are bucket tops: (L, H], i.e. [L + 1 ns, H + 1 ns).
    h = hist_of([0.0015])
    counts, edges = h.to_numpy()
    assert counts[-1] == 1
    assert round(edges[-2] * 1e9) == 1_490_001
    assert round(edges[-1] * 1e9) == 1_500_001


# --------------------------------------------------------------------------- count_le


@st.composite
def three_digit_les(draw: Callable[..., Any]) -> list[float]:
    les = {
        draw(st.integers(100, 999)) * 10.0 ** draw(st.integers(-9, 1))
        for _ in range(draw(st.integers(1, 12)))
    }
    return sorted(les)


@SLOW
@given(st.integers(0, 2**32 - 1), three_digit_les())
def test_count_le_exact_on_three_significant_digits(seed: int, les: list[float]) -> None:
    rng = np.random.default_rng(seed)
    ns = (10.0 ** rng.uniform(0, 12, 20_000)).astype(np.int64)
    # Values right at, just under and just over each edge.
    edges = np.array([round(le * 1e9) for le in les], dtype=np.int64)
    ns = np.concatenate([ns, edges, edges - 1, edges + 1])
    ns = ns[ns >= 0]
    h = hist_of(ns_to_s(ns))
    want = [int(np.sum(ns <= e)) for e in edges]
    assert h.cumulative(les) == want
    assert [h.count_le(le) for le in les] == want
    assert h.count_le(math.inf) == h.count
    assert h.cumulative([math.inf]) == [h.count]


def test_count_le_rejects_bad_le() -> None:
    h = hist_of([1.0])
    for bad in [-1.0, math.nan, -math.inf]:
        with pytest.raises(ValueError):
            h.count_le(bad)
        with pytest.raises(ValueError):
            h.cumulative([1.0, bad])


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [-1.0, -1e-12, math.nan, math.inf, -math.inf])
def test_record_rejects_negative_nan_inf(bad: float) -> None:
    h = rq.Histogram()
    h.record(1.0)
    with pytest.raises(ValueError):
        h.record(bad)
    assert h.count == 1
    assert h.sum == 1.0


@settings(deadline=None, max_examples=100)
@given(
    st.lists(st.floats(0.0, 100.0), min_size=0, max_size=200),
    st.sampled_from([-1.0, -1e-300, math.nan, math.inf, -math.inf]),
    st.integers(0, 200),
    st.booleans(),
)
def test_record_many_all_or_nothing(good: list[float], bad: float, pos: int, strided: bool) -> None:
    h = rq.Histogram()
    h.record_many(np.array([0.5, 2.0]))
    before = state(h)
    values = list(good)
    values.insert(min(pos, len(values)), bad)
    arr = np.array(values, dtype=np.float64)
    if strided:
        # A non-contiguous view (the copying path) of the same values.
        wide = np.zeros(2 * len(arr))
        wide[::2] = arr
        arr = wide[::2]
    with pytest.raises(ValueError):
        h.record_many(arr)
    assert state(h) == before


def test_record_many_rejects_wrong_arrays() -> None:
    h = rq.Histogram()
    for bad in [np.array([[1.0]]), np.array([True]), ["1.0"], 1.0, "1"]:
        with pytest.raises(TypeError, match="values"):
            h.record_many(bad)
    assert h.count == 0
    h.record_many(np.array([], dtype=np.float64))
    assert h.count == 0
    x = np.arange(10, dtype=np.float64)
    h.record_many(x[::3])
    assert h.count == 4
    assert h.sum == 18.0


# --------------------------------------------------------------------------- range


def test_underflow_and_overflow_counted() -> None:
    values = [0.0, 1e-9, 999e-9, 1e-6, 1.5e-6, 1.0, 9999.0, 1e4, 2e4, 1e9, 1.2e10]
    a = rq.Histogram()
    for v in values:
        a.record(v)
    b = hist_of(values)
    for h in (a, b):
        assert h.count == len(values)
        assert h.underflow == 3  # 0, 1 ns, 999 ns: strictly below 1 us
        assert h.overflow == 1  # strictly above 10^10 s
        assert h.min == 0.0
        assert h.max == 1.2e10  # exact, not clamped
        ns = 0 + 1 + 999 + 1_000 + 1_500 + NS + 9999 * NS + 10**4 * NS + 2 * 10**4 * NS
        assert h.sum == (ns + 10**9 * NS + 12 * MAX_NS // 10) / 1e9  # exact
        assert h.count_le(MAX_S) == len(values)
        assert h.count_le(UNDERFLOW_S) == 4
        assert h.count_le(999e-9) == 3
        assert h.count_le(2e4) == 9
        assert h.percentile(100) == 9.995e9  # the top bucket (9.99e9, ...], at its midpoint
        assert h.percentile(0) == 0.0
    assert state(a) == state(b)


def test_underflow_values_are_recorded_exactly() -> None:
    h = rq.Histogram()
    for ns in [1, 2, 3, 500, 999]:
        h.record(ns / 1e9)
    assert h.underflow == 5
    assert h.percentiles([0, 50, 100]) == [1e-9, 3e-9, 999e-9]
    assert h.sum == 1505 / 1e9


# --------------------------------------------------------------------------- reset / copy


def test_reset_returns_what_it_held() -> None:
    x = np.array([1e-7, 0.001, 0.0025, 1.0, 42.0, 2e4])
    h = hist_of(x)
    before = state(h)
    held = h.reset()
    assert isinstance(held, rq.Histogram)
    assert state(held) == before
    assert h.count == 0
    assert h.sum == 0.0
    assert math.isnan(h.min)
    assert math.isnan(h.max)
    assert math.isnan(h.mean)
    assert (h.underflow, h.overflow) == (0, 0)
    assert h.to_numpy()[0].tolist() == []
    # Usable again, and independent of what reset returned.
    h.record(0.5)
    assert (h.count, h.min, h.max) == (1, 0.5, 0.5)
    assert state(held) == before
    # Reset of an empty histogram: an empty histogram.
    assert rq.Histogram().reset().count == 0


def test_copy_is_independent() -> None:
    h = hist_of([1.0, 2.0])
    c = h.copy()
    h.record(3.0)
    c.record(100.0)
    assert (h.count, h.max) == (3, 3.0)
    assert (c.count, c.max) == (3, 100.0)
    assert h.mean == 2.0
    assert len(h) == 3


# --------------------------------------------------------------------------- known bugs


def test_overflow_only_record_min_and_percentile() -> None:
    """record(v) beyond the tracked range as the only value: min and max are v, and the
    percentile (read in the top bucket) stays within them."""
    h = rq.Histogram()
    h.record(1.5e10)
    assert h.min == h.max == 1.5e10
    assert h.percentile(50) == 1.5e10


def test_from_bytes_rejects_inconsistent_header() -> None:
    """from_bytes validates the bucket list but not the header: a histogram holding
    values whose min field exceeds its max field is accepted, and percentile() then
    panics (PanicException) instead of from_bytes raising ValueError."""
    b = bytearray(hist_of([1.0]).to_bytes())
    # Layout: magic, then sum, min, max, underflow, overflow as u64 little-endian.
    assert int.from_bytes(b[12:20], "little") == NS  # min = 1 s
    b[20:28] = (0).to_bytes(8, "little")  # max = 0 < min
    try:
        h = rq.Histogram.from_bytes(bytes(b))
    except ValueError:
        return
    h.percentile(50)


def test_sum_is_exact_instead_of_wrapping() -> None:
    """The sum is 128 bits of nanoseconds: past 2^64 ns (~1.8e10 s in total, e.g. 1.9
    million waits of 10^4 s) sum and mean stay exact, and Prometheus' _sum never goes
    backwards."""
    h = rq.Histogram()
    h.record_many(np.full(1_900_000, 1e4))
    assert h.count == 1_900_000
    assert h.sum == 1.9e10
    assert h.mean == 1e4


# --------------------------------------------------------------------------- limiter stats

COUNTERS = (
    "tried_admitted",
    "tried_refused",
    "immediate",
    "queued_grants",
    "refused_full",
    "refused_deadline",
    "timed_out",
    "cancelled",
)


def counters(s: dict[str, Any]) -> dict[str, int]:
    return {k: s[k] for k in COUNTERS}


def waits(s: dict[str, Any]) -> dict[str, tuple[int, float | None, float | None, float]]:
    return {
        k: (h.count, None if h.count == 0 else h.min, None if h.count == 0 else h.max, h.sum)
        for k, h in s["wait"].items()
    }


class Blocked:
    """A thread blocked in acquire(); start() returns once it is queued."""

    def __init__(self, owner: Any, **kw: Any) -> None:
        self.owner = owner
        self.kw = kw
        self.result: Any = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.result = self.owner.acquire(**self.kw)
        except Exception as e:
            self.result = e

    def start(self) -> Blocked:
        n = self.owner.waiting
        self.thread.start()
        deadline = time.monotonic() + 10
        while self.owner.waiting == n:
            assert self.thread.is_alive(), self.result
            assert time.monotonic() < deadline, "the thread never queued"
            time.sleep(0.0005)
        return self

    def join(self) -> Any:
        self.thread.join(10)
        assert not self.thread.is_alive(), "still blocked"
        return self.result


async def until(cond: Callable[[], bool]) -> None:
    """Let the event loop run until cond() holds (bounded)."""
    for _ in range(10_000):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def awaited(acq: Any) -> Any:
    return await acq


@pytest.mark.timeout(60)
def test_limiter_stats_scripted_run() -> None:
    clock = rq.ManualClock()
    lim = rq.Limiter(
        rq.Rate(1, burst=1), clock=clock, classes={"a": 1, "b": 1}, max_queue=3, name="api"
    )
    s = lim.stats()
    assert counters(s) == dict.fromkeys(COUNTERS, 0)
    assert s["waiting"] == 0
    assert s["depths"] == {"a": 0, "b": 0}
    assert waits(s) == {"a": (0, None, None, 0.0), "b": (0, None, None, 0.0)}
    assert s["available"] == {"requests": 1.0}
    assert s["name"] == "api"

    async def script() -> dict[str, Any]:
        out: dict[str, Any] = {}
        # t = 0
        assert lim.try_acquire() is True  # tried_admitted; the bucket is now empty
        assert lim.try_acquire() is False  # tried_refused
        a = Blocked(lim, priority="a").start()  # queued, arrival 0, granted at 1
        assert lim.try_acquire() is False  # refused: nobody overtakes a waiter
        b = Blocked(lim, priority="b").start()  # queued, arrival 0, granted at 2
        with pytest.raises(rq.Overloaded) as e:  # predicted 2 s > 0.5 s
            lim.acquire(priority="a", timeout=0.5)
        assert e.value.retry_after == 1.5
        x = asyncio.create_task(awaited(lim.acquire_async(priority="a")))
        await until(lambda: lim.waiting == 3)
        assert lim.stats()["depths"] == {"a": 2, "b": 1}
        x.cancel()  # cancelled while queued
        with pytest.raises(asyncio.CancelledError):
            await x
        assert lim.waiting == 2
        d = Blocked(lim, priority="b", timeout=2.5).start()  # would be granted at 3
        with pytest.raises(rq.Overloaded):  # 3 waiting = max_queue
            lim.acquire(priority="a")
        out["queued"] = lim.stats()
        assert lim.next_wake() == 1.0

        lim.run_until(1.0)
        out["after_1"] = lim.stats()
        assert a.join().waited == 1.0

        lim.run_until(10.0)  # B granted at 2, D expires at 2.5
        assert b.join().waited == 2.0
        assert isinstance(d.join(), rq.WaitTimeout)
        assert clock.now() == 10.0

        # t = 10: immediate grants through acquire and acquire_async record 0.
        assert lim.acquire(priority="b").waited == 0.0
        lim.run_until(20.0)
        assert (await lim.acquire_async(priority="a")).waited == 0.0
        # t = 20: an asyncio waiter queued, granted at 21.
        y = asyncio.create_task(awaited(lim.acquire_async(priority="b")))
        await until(lambda: lim.waiting == 1)
        lim.run_until(21.5)
        out["y"] = await asyncio.wait_for(y, 10)
        return out

    out = asyncio.run(script())
    assert out["y"].waited == 1.0

    q = out["queued"]
    assert counters(q) == {
        "tried_admitted": 1,
        "tried_refused": 2,
        "immediate": 0,
        "queued_grants": 0,
        "refused_full": 1,
        "refused_deadline": 1,
        "timed_out": 0,
        "cancelled": 1,
    }
    assert q["waiting"] == 3
    assert q["depths"] == {"a": 1, "b": 2}
    assert waits(q) == {"a": (0, None, None, 0.0), "b": (0, None, None, 0.0)}  # tries record none
    assert q["available"] == {"requests": 0.0}

    one = out["after_1"]
    assert counters(one) == {**counters(q), "queued_grants": 1}
    assert one["depths"] == {"a": 0, "b": 2}
    assert waits(one) == {"a": (1, 1.0, 1.0, 1.0), "b": (0, None, None, 0.0)}

    s = lim.stats()
    assert counters(s) == {
        "tried_admitted": 1,
        "tried_refused": 2,
        "immediate": 2,
        "queued_grants": 3,
        "refused_full": 1,
        "refused_deadline": 1,
        "timed_out": 1,
        "cancelled": 1,
    }
    assert s["waiting"] == 0
    assert s["depths"] == {"a": 0, "b": 0}
    # a: A waited 1 s, the immediate acquire_async 0; b: B 2 s, immediate 0, y 1 s.
    assert waits(s) == {"a": (2, 0.0, 1.0, 1.0), "b": (3, 0.0, 2.0, 3.0)}
    # Bucket midpoints clamped to [min, max]: within 0.5 % of 0, 1 and 2 s.
    assert s["wait"]["b"].percentiles([0, 50, 100]) == pytest.approx([0.0, 1.0, 2.0], rel=0.005)
    assert s["available"] == {"requests": 0.5}  # last grant at 21, now 21.5
    assert s["name"] == "api"

    # The live histograms hold the same; the stats copies are independent of them.
    for cls in ("a", "b"):
        assert state(lim.wait_histogram(cls)) == state(s["wait"][cls])
    assert state(lim.wait_histogram()) == state(s["wait"]["a"])  # None: the first class
    assert out["after_1"]["wait"]["a"].count == 1  # a copy, not the live one
    s["wait"]["a"].record(5.0)
    assert lim.wait_histogram("a").count == 2
    # One more grant reaches the live histogram, not the copies taken before.
    live = lim.wait_histogram("b")
    w = Blocked(lim, priority="b").start()  # arrival 21.5, granted at 22
    lim.run_until(23.0)
    assert w.join().waited == 0.5
    assert (live.count, live.max, live.sum) == (4, 2.0, 3.5)
    assert s["wait"]["b"].count == 3
    with pytest.raises(ValueError):
        lim.wait_histogram("c")


@pytest.mark.timeout(60)
def test_limiter_live_histogram_and_threads_on_manual_clock() -> None:
    """Many blocked threads on a 10/s limiter: each waits k * 100 ms exactly."""
    clock = rq.ManualClock(100)
    lim = rq.Limiter(rq.Rate(10, burst=1), clock=clock)
    live = lim.wait_histogram()
    assert lim.acquire().waited == 0.0  # immediate: records 0
    waiters = [Blocked(lim).start() for _ in range(12)]
    assert lim.stats()["depths"] == {"default": 12}
    lim.run_until(100.55)  # grants at 100.1 .. 100.5
    assert lim.waiting == 7
    assert live.count == 6
    lim.run_until(102)
    got = sorted(round(w.join().waited * 1e9) for w in waiters)
    assert got == [k * 100_000_000 for k in range(1, 13)]
    s = lim.stats()
    assert counters(s) == {**dict.fromkeys(COUNTERS, 0), "immediate": 1, "queued_grants": 12}
    assert live.count == 13
    assert live.min == 0.0
    assert live.max == 1.2
    assert live.sum == sum(range(1, 13)) * 100_000_000 / 1e9
    assert live.count_le(0.5) == 6
    assert state(live) == state(s["wait"]["default"])


# --------------------------------------------------------------------------- concurrency


@pytest.mark.timeout(60)
def test_concurrency_stats_scripted_run() -> None:
    clock = rq.ManualClock()
    c = rq.Concurrency(2, clock=clock, classes={"a": 1, "b": 1}, max_queue=2, name="pool")
    s = c.stats()
    assert counters(s) == dict.fromkeys(COUNTERS, 0)
    assert (s["in_use"], s["limit"], s["name"], s["waiting"]) == (0, 2, "pool", 0)
    assert "available" not in s

    async def script() -> dict[str, Any]:
        out: dict[str, Any] = {}
        p1 = c.acquire(priority="a")  # immediate
        p2 = c.acquire(priority="b")  # immediate
        a = Blocked(c, priority="a").start()  # queued at 0
        x = asyncio.create_task(awaited(c.acquire_async(priority="b")))
        await until(lambda: c.waiting == 2)
        assert c.stats()["depths"] == {"a": 1, "b": 1}
        x.cancel()
        with pytest.raises(asyncio.CancelledError):
            await x
        b = Blocked(c, priority="b", timeout=3.0).start()  # queued at 0, deadline 3
        with pytest.raises(rq.Overloaded):
            c.acquire(priority="a")  # 2 waiting = max_queue
        out["queued"] = c.stats()
        clock.advance(1.5)
        p1.release()  # grants A at 1.5
        pa = a.join()
        assert isinstance(pa, rq.Permit)
        clock.advance(2.0)
        c.poll()  # B's deadline (3.0) has passed
        assert isinstance(b.join(), rq.WaitTimeout)
        pa.release()
        py_ = await c.acquire_async(priority="a")  # t = 3.5, immediate
        z = asyncio.create_task(awaited(c.acquire_async(priority="b")))
        await until(lambda: c.waiting == 1)
        out["full"] = c.stats()
        clock.advance(0.5)
        p2.release()  # grants z at 4.0
        pz = await asyncio.wait_for(z, 10)
        out["held"] = c.stats()
        py_.release()
        pz.release()
        assert pz.release() is False  # only once
        return out

    out = asyncio.run(script())
    q = out["queued"]
    assert counters(q) == {
        **dict.fromkeys(COUNTERS, 0),
        "immediate": 2,
        "refused_full": 1,
        "cancelled": 1,
    }
    assert q["depths"] == {"a": 1, "b": 1}
    assert (q["waiting"], q["in_use"]) == (2, 2)
    assert waits(q) == {"a": (1, 0.0, 0.0, 0.0), "b": (1, 0.0, 0.0, 0.0)}
    assert out["full"]["in_use"] == 2
    assert out["full"]["depths"] == {"a": 0, "b": 1}
    assert out["held"]["in_use"] == 2

    s = c.stats()
    assert counters(s) == {
        **dict.fromkeys(COUNTERS, 0),
        "immediate": 3,
        "queued_grants": 2,
        "refused_full": 1,
        "timed_out": 1,
        "cancelled": 1,
    }
    assert (s["waiting"], s["in_use"], s["limit"]) == (0, 0, 2)
    assert s["depths"] == {"a": 0, "b": 0}
    # a: p1 (0), A (queued), immediate async (0); b: p2 (0), z (queued).
    assert s["wait"]["a"].count == 3
    assert s["wait"]["b"].count == 2
    assert s["wait"]["a"].min == 0.0
    assert state(c.wait_histogram("a")) == state(s["wait"]["a"])
    assert state(c.wait_histogram()) == state(s["wait"]["a"])


@pytest.mark.timeout(60)
def test_concurrency_queued_wait_is_measured() -> None:
    """A waiter queued at t=0 and granted by a release at t=1.5 waited 1.5 s; the queue
    takes its grant time as max(arrival, last grant) (Semaphore.ready_at returns the
    time it is given), so Permit.waited and the wait histogram record 0."""
    clock = rq.ManualClock()
    c = rq.Concurrency(1, clock=clock)
    p = c.acquire()
    w = Blocked(c).start()
    clock.advance(1.5)
    p.release()
    got = w.join()
    got.release()
    h = c.wait_histogram()
    assert (h.count, h.max, h.sum) == (2, 1.5, 1.5)
    assert got.waited == 1.5


def test_concurrency_try_acquire_counted_as_try() -> None:
    """Limiter.try_acquire counts tried_admitted / tried_refused and records no wait;
    Concurrency.try_acquire goes through the fast path of acquire: it counts an admission
    as `immediate`, records a 0 wait in the first class, and counts a refusal nowhere."""
    c = rq.Concurrency(1, clock=rq.ManualClock())
    p = c.try_acquire()
    assert p is not None
    assert c.try_acquire() is None
    s = c.stats()
    assert (s["tried_admitted"], s["tried_refused"], s["immediate"]) == (1, 1, 0)
    assert s["wait"]["default"].count == 0
