"""The workload of keys17's instruction counts: first-time (or hot) uint64 keys.

A fresh ``KeyedLimiter(max_keys=2**21)`` decides N keys ``i * golden`` in slices of
65,536 (``new``), or N decisions over 1,000 keys held (``hot``); run it under callgrind
and divide the binding's inclusive cost by N::

    valgrind --tool=callgrind .venv/bin/python benches/keyed_new_keys.py 1000000 new
    callgrind_annotate --inclusive=yes callgrind.out.* | grep try_acquire_many
"""

from __future__ import annotations

import sys

import numpy as np
import ratequeue as rq

GOLDEN = 0x9E3779B97F4A7C15
CHUNK = 65_536


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    phase = sys.argv[2] if len(sys.argv) > 2 else "new"
    kl = rq.KeyedLimiter(rq.Rate(10**9, per="second", burst=10**9), max_keys=2**21)
    keys = np.arange(n, dtype=np.uint64) * np.uint64(GOLDEN)
    arr = keys if phase == "new" else np.tile(keys[:1000], n // 1000)
    if phase == "hot":
        kl.try_acquire_many(keys[:1000])
    for i in range(0, len(arr), CHUNK):
        kl.try_acquire_many(arr[i : i + CHUNK])
    print(len(kl))


if __name__ == "__main__":
    main()
