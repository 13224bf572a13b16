"""The key-identity examples that tests/keyed/test_keys.py and
tests/redis/test_redis_keys.py share."""

from __future__ import annotations

import numpy as np
import ratequeue as rq

# Pairs a 64-bit two's complement view (or a text/bytes view) would merge.
DISTINCT = [
    (-1, 2**64 - 1),
    (-(2**63), 2**63),
    (-2, 2**64 - 2),
    (1, "1"),
    ("a", b"a"),
    (1, b"1"),
    (2**64, "18446744073709551616"),
    (-(2**64), 0),
    (2**100, 2**100 + 2**64),
]
# Spellings of one key.
SAME = [
    (1, np.int64(1)),
    (1, np.uint64(1)),
    (1, True),
    (0, False),
    (-1, np.int64(-1)),
    (2**64 - 1, np.uint64(2**64 - 1)),
    (-5, np.int8(-5)),
    (2**100, 2**100),
    ("é", "é"),
    (b"\xff", b"\xff"),
]
NOT_KEYS = [1.0, None, (1,), 1.5, np.float64(1), [1]]


def one_per_hour() -> rq.Rate:
    return rq.Rate(1, per=3600, burst=1)


def local_same(a: object, b: object) -> bool:
    k = rq.KeyedLimiter(one_per_hour(), clock=rq.ManualClock())
    assert k.try_acquire(a)
    return not k.try_acquire(b)
