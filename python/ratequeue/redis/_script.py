"""The Lua script's protocol: its source (``gcra.lua``, package data) and SHA, the ARGV
of each operation, the rates and clock as the script sees them, and its replies."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from importlib.resources import files
from typing import Any, Final

from .._errors import CostTooLarge
from .._ratequeue import ManualClock, Rate
from ._connection import _text


def _script_text() -> str:
    """``gcra.lua`` as sent to Redis: without its comment lines (a third of the file),
    which Redis would otherwise receive, hash and compile at every load."""
    src = files(__package__).joinpath("gcra.lua").read_text(encoding="utf-8")
    return "".join(
        line for line in src.splitlines(keepends=True) if not line.lstrip().startswith("--")
    )


GCRA_LUA: Final = _script_text()
GCRA_SHA: Final = hashlib.sha1(GCRA_LUA.encode()).hexdigest()

_TEST_KEEP_MS: Final = 3_600_000


class _Clock:
    """Where a limiter reads time: real (the server's TIME) or a test ManualClock."""

    __slots__ = ("manual",)

    def __init__(self, clock: ManualClock | None) -> None:
        if clock is not None and not isinstance(clock, ManualClock):
            raise TypeError(
                "clock must be a ratequeue.ManualClock (tests only); "
                "Redis limiters otherwise use the server's TIME"
            )
        self.manual = clock

    def now_arg(self) -> str:
        return "" if self.manual is None else str(self.manual.now_ns() // 1000)

    @property
    def keep_ms(self) -> int:
        return 0 if self.manual is None else _TEST_KEEP_MS

    def monotonic(self) -> float:
        return time.monotonic() if self.manual is None else self.manual.now()

    def sleep_target(self, start_ns: int, wait_us: int) -> None:
        """On a manual clock, waiting moves the clock to the grant time."""
        m = self.manual
        assert m is not None
        target = start_ns + wait_us * 1000
        now = m.now_ns()
        if target > now:
            m.advance((target - now) / 1e9)


class _Bucket:
    """One rate as the script sees it: the interval T and tolerance tau in microseconds."""

    __slots__ = ("burst", "inc1", "interval", "rate", "tau", "unit")

    def __init__(self, rate: Rate) -> None:
        self.rate = rate
        self.unit = rate.unit
        self.burst = rate.burst
        self.interval = rate.per * 1e6 / rate.amount
        self.tau = round(rate.burst * self.interval)
        self.inc1 = max(1, round(self.interval))

    def inc(self, cost: int) -> int:
        """The debit of ``cost`` in whole microseconds: round(cost * T), at least 1 us."""
        if cost == 1:
            return self.inc1
        return max(1, round(cost * self.interval)) if cost else 0

    def check(self, cost: int, where: str = "") -> None:
        if cost > self.burst:
            raise CostTooLarge(
                f"cost {cost} {self.unit} exceeds the burst of {self.burst} {self.unit}"
                f"{where} and can never be admitted"
            )


class _Take:
    """A parsed reply of the take script."""

    __slots__ = ("level", "mask", "ok", "start", "undo", "wait_us")

    def __init__(self, reply: Sequence[Any] | int) -> None:
        if isinstance(reply, int):  # the fast path's one integer: -grant time, or a refusal
            self.ok = reply <= 0
            self.wait_us = 0 if self.ok else reply >> 6
            self.level = 0 if self.ok else reply & 63
            self.mask = 0
            self.start = str(-reply) if self.ok else ""
            self.undo: list[str] = []
            return
        self.ok = int(reply[0]) == 1
        self.wait_us = int(reply[1])
        v = int(reply[2]) if len(reply) > 2 else 0
        self.level = 0 if self.ok else v
        self.mask = v if self.ok else 0
        # With undo: the grant time, then (before, after, generation) per bucket.
        self.start = _text(reply[3]) if len(reply) > 3 else ""
        self.undo = [_text(x) for x in reply[4:]]


def _gen_key(key: bytes) -> bytes:
    """The generation key of a bucket: its name behind a byte no UTF-8 prefix starts with
    (so never another bucket's name), in the same cluster slot (same hash tag)."""
    return b"\xff" + key


def _take_args(
    clock: _Clock,
    buckets: Sequence[_Bucket],
    costs: Sequence[int],
    shadow: Sequence[bool] | None,
    max_wait_us: int,
    undo: bool,
) -> list[Any]:
    """ARGV of a take: the fast 'T' form when possible."""
    if max_wait_us == 0 and not undo and clock.manual is None and not (shadow and any(shadow)):
        args: list[Any] = [b"T"]
        for b, c in zip(buckets, costs, strict=True):
            args.append(b.inc(c))
            args.append(b.tau)
        return args
    args = ["t", clock.now_arg(), clock.keep_ms, max_wait_us, 1 if undo else 0]
    for i, (b, c) in enumerate(zip(buckets, costs, strict=True)):
        args.append(b.inc(c))
        args.append(b.tau)
        args.append("1" if shadow and shadow[i] else "0")
    return args


def _peek_args(clock: _Clock, buckets: Sequence[_Bucket], costs: Sequence[int]) -> list[Any]:
    args: list[Any] = ["p", clock.now_arg(), clock.keep_ms, 0, 0]
    for b, c in zip(buckets, costs, strict=True):
        args.append(b.inc(c))
        args.append(b.tau)
    return args
