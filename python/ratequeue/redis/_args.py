"""Caller arguments of the Redis limiters: keys, costs, units, bounds, and their refusals."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import SupportsIndex, TypeAlias

from .._errors import Overloaded
from .._ratequeue import Rate

Key: TypeAlias = str | bytes | int | SupportsIndex


def _key_bytes(k: Key, name: str = "key") -> bytes:
    """A key's identity in Redis key names: its kind and exact value (``s:``, ``b:``, ``i:``)."""
    if isinstance(k, str):
        return b"s:" + k.encode()
    if isinstance(k, bytes):
        return b"b:" + k
    try:
        return b"i:%d" % operator.index(k)
    except TypeError:
        raise TypeError(f"{name} must be a str, bytes or int, got {type(k).__name__}") from None


def _cost(name: str, v: object) -> int:
    if isinstance(v, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        c = operator.index(v)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(v).__name__}") from None
    if c < 0:
        raise ValueError(f"{name}={c} must be >= 0")
    return c


def _units_of(rates: Sequence[Rate]) -> list[str]:
    units: list[str] = []
    for r in rates:
        if r.unit not in units:
            units.append(r.unit)
    return units


def _scaled(rate: Rate, fraction: float) -> Rate:
    return Rate(
        rate.amount * fraction,
        per=rate.per,
        burst=max(1, math.ceil(rate.burst * fraction)),
        unit=rate.unit,
    )


def _max_wait_us(max_wait: float | None) -> int:
    if max_wait is None:
        return -1
    if isinstance(max_wait, bool) or not isinstance(max_wait, (int, float)):
        raise TypeError(f"max_wait={max_wait!r} must be a number of seconds or None")
    if not (max_wait >= 0):
        raise ValueError(f"max_wait={max_wait!r} must be >= 0 seconds")
    if math.isinf(max_wait):
        return -1
    return round(max_wait * 1e6)


def _overloaded(wait_us: int, max_wait_us: int, reason: str = "") -> Overloaded:
    wait = wait_us / 1e6
    mw = max_wait_us / 1e6
    what = reason or f"the wait of {wait:.6f} s exceeds max_wait={mw:.6f} s"
    return Overloaded(f"overloaded: {what}", max(0.0, wait - mw))
