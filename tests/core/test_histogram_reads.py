"""Histogram reads (count, min/max, percentiles, cumulative) agree with the full bucket
copy, and stay consistent while threads record."""

from __future__ import annotations

import math
import threading

import numpy as np
import ratequeue as rq


def _from_buckets(h: rq.Histogram, qs: list[float]) -> list[float]:
    """Nearest-rank percentiles computed from ``to_numpy`` (bucket midpoints)."""
    counts, edges = h.to_numpy()
    cum = np.cumsum(counts.astype(np.int64))
    n = int(cum[-1])
    out = []
    for q in qs:
        r = max(1, math.ceil(round(q * n, 6) / 100))
        i = int(np.searchsorted(cum, r))
        lo_ns, hi_ns = round(edges[i] * 1e9), round(edges[i + 1] * 1e9)
        mid = lo_ns if hi_ns - lo_ns <= 1 else (lo_ns + hi_ns - 1) / 2
        out.append(min(max(mid / 1e9, h.min), h.max))
    return out


def test_reads_agree_with_the_buckets() -> None:
    rng = np.random.default_rng(7)
    h = rq.Histogram()
    h.record_many(rng.lognormal(np.log(5e-3), 1.5, 50_000))
    counts, _ = h.to_numpy()
    assert h.count == int(counts.sum()) == 50_000
    qs = [0.0, 1.0, 7.0, 50.0, 90.0, 99.0, 99.9, 100.0]
    assert h.percentiles(qs) == _from_buckets(h, qs)
    assert [h.percentile(q) for q in qs] == h.percentiles(qs)
    les = [0.001, 0.005, 0.1, 1.0, math.inf]
    assert h.cumulative(les) == [h.count_le(le) for le in les]
    assert h.cumulative([math.inf]) == [h.count]
    copy = h.copy()
    assert (copy.count, copy.min, copy.max, copy.percentiles(qs)) == (
        h.count,
        h.min,
        h.max,
        h.percentiles(qs),
    )


def test_reads_while_threads_record_stay_consistent() -> None:
    h = rq.Histogram()
    per = 20_000

    def writer(seed: int) -> None:
        values = np.random.default_rng(seed).lognormal(np.log(1e-3), 2.0, per).tolist()
        for v in values:
            h.record(v)

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    last = 0
    reads = 0
    while any(t.is_alive() for t in threads) or reads == 0:
        n = h.count
        assert last <= n <= 3 * per
        last = n
        lo, p50, hi = h.percentiles([0, 50, 100])
        if math.isnan(lo):
            continue
        assert lo <= p50 <= hi
        mn, mx = h.min, h.max
        assert mn <= mx
        assert h.cumulative([1e-3, math.inf])[0] <= h.count
        reads += 1
    for t in threads:
        t.join()
    assert h.count == 3 * per
    assert h.percentiles([50.0, 99.0]) == _from_buckets(h, [50.0, 99.0])
