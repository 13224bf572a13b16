"""Open-loop arrival processes: when requests arrive, whatever happens to earlier ones.

Each process is given a mean rate (requests per second) and a duration and returns the
arrival times, sorted, from a seeded :class:`random.Random`; the same seed gives the
same times. Arrivals never depend on completions (an open loop, like users or an
upstream service), which is what makes queues grow under overload.
"""

from __future__ import annotations

import csv
import datetime as _dt
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "Arrivals",
    "Batches",
    "Burst",
    "Constant",
    "OnOff",
    "Poisson",
    "Replay",
    "parse_arrivals",
]


def _check(rate: float, duration: float) -> None:
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be finite and > 0, got {rate!r}")
    if not (math.isfinite(duration) and duration >= 0):
        raise ValueError(f"duration must be finite and >= 0, got {duration!r}")


class Arrivals(ABC):
    """An arrival process with a mean rate chosen at generation time."""

    @abstractmethod
    def times(self, rate: float, duration: float, rng: random.Random) -> list[float]:
        """Arrival times in [0, duration), sorted, at a mean ``rate`` per second."""

    @property
    @abstractmethod
    def label(self) -> str:
        """A short description for tables."""


@dataclass(frozen=True)
class Poisson(Arrivals):
    """Independent arrivals: exponential gaps of mean 1/rate (the M in M/D/1)."""

    def times(self, rate: float, duration: float, rng: random.Random) -> list[float]:
        _check(rate, duration)
        out: list[float] = []
        t = rng.expovariate(rate)
        while t < duration:
            out.append(t)
            t += rng.expovariate(rate)
        return out

    @property
    def label(self) -> str:
        return "Poisson"


@dataclass(frozen=True)
class Constant(Arrivals):
    """Evenly spaced arrivals, 1/rate apart, the first at ``phase``/rate."""

    phase: float = 0.0

    def times(self, rate: float, duration: float, rng: random.Random) -> list[float]:
        _check(rate, duration)
        n = max(0, math.ceil(duration * rate - self.phase))
        return [t for t in ((i + self.phase) / rate for i in range(n)) if t < duration]

    @property
    def label(self) -> str:
        return "constant"


@dataclass(frozen=True)
class Batches(Arrivals):
    """Batches of ``size`` requests at once; batches arrive as a Poisson process
    (or evenly, with ``regular=True``) so that the mean rate is kept."""

    size: int = 10
    regular: bool = False

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size!r}")

    def times(self, rate: float, duration: float, rng: random.Random) -> list[float]:
        _check(rate, duration)
        batch_rate = rate / self.size
        starts = (Constant() if self.regular else Poisson()).times(batch_rate, duration, rng)
        return [t for t in starts for _ in range(self.size)]

    @property
    def label(self) -> str:
        return f"batches of {self.size}"


@dataclass(frozen=True)
class OnOff(Arrivals):
    """Bursts: Poisson arrivals during ``on`` seconds, silence for ``off`` seconds, and
    so on; the rate during the on-periods is raised so that the mean rate is kept."""

    on: float = 60.0
    off: float = 60.0

    def __post_init__(self) -> None:
        if not (self.on > 0 and self.off >= 0):
            raise ValueError(f"need on > 0 and off >= 0, got on={self.on!r}, off={self.off!r}")

    def times(self, rate: float, duration: float, rng: random.Random) -> list[float]:
        _check(rate, duration)
        cycle = self.on + self.off
        peak = rate * cycle / self.on
        out: list[float] = []
        start = 0.0
        while start < duration:
            end = min(start + self.on, duration)
            t = start + rng.expovariate(peak)
            while t < end:
                out.append(t)
                t += rng.expovariate(peak)
            start += cycle
        return out

    @property
    def label(self) -> str:
        return f"on-off {self.on:g}/{self.off:g} s"


@dataclass(frozen=True)
class Burst(Arrivals):
    """``n`` requests at the same instant ``at`` (rate and duration are ignored)."""

    n: int = 500
    at: float = 0.0

    def times(self, rate: float, duration: float, rng: random.Random) -> list[float]:
        return [self.at] * self.n

    @property
    def label(self) -> str:
        return f"burst of {self.n}"


def _parse_time(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        when = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
        if when.tzinfo is None:
            when = when.replace(tzinfo=_dt.timezone.utc)
        return when.timestamp()


@dataclass(frozen=True)
class Replay(Arrivals):
    """Arrival times recorded elsewhere, replayed from their first one.

    With ``scale=True`` (the default) the trace is stretched or squeezed in time so that
    its mean rate is the rate asked for (its shape, bursts included, is kept); with
    ``scale=False`` it is replayed as recorded and the rate is ignored. Times past the
    duration are dropped; a trace shorter than the duration is not repeated.
    """

    stamps: tuple[float, ...] = field(default=())
    scale: bool = True
    source: str = "trace"

    @classmethod
    def from_file(cls, path: str | Path, *, scale: bool = True) -> Replay:
        """Read one timestamp per line (the first CSV column): seconds as numbers, or
        ISO 8601 date-times. Blank lines, ``#`` comments and a header are skipped."""
        p = Path(path)
        stamps: list[float] = []
        with p.open(newline="") as f:
            for row in csv.reader(f):
                if not row or not row[0].strip() or row[0].lstrip().startswith("#"):
                    continue
                try:
                    stamps.append(_parse_time(row[0].strip()))
                except ValueError:
                    if stamps:
                        raise ValueError(f"{p}: unreadable timestamp {row[0]!r}") from None
                    continue  # a header line
        return cls.of(stamps, scale=scale, source=p.name)

    @classmethod
    def of(cls, stamps: Iterable[float], *, scale: bool = True, source: str = "trace") -> Replay:
        ordered = sorted(float(s) for s in stamps)
        if not ordered:
            raise ValueError("a replay needs at least one timestamp")
        if not all(math.isfinite(s) for s in ordered):
            raise ValueError("timestamps must be finite")
        t0 = ordered[0]
        return cls(tuple(s - t0 for s in ordered), scale=scale, source=source)

    @property
    def natural_rate(self) -> float:
        """The trace's own mean rate (requests per second; inf for a single instant)."""
        span = self.stamps[-1] if self.stamps else 0.0
        return math.inf if span <= 0 else (len(self.stamps) - 1) / span

    def times(self, rate: float, duration: float, rng: random.Random) -> list[float]:
        _check(rate, duration)
        factor = 1.0
        if self.scale and math.isfinite(self.natural_rate):
            factor = self.natural_rate / rate
        return [t for t in (s * factor for s in self.stamps) if t < duration]

    @property
    def label(self) -> str:
        return f"replay of {self.source}"


def _spec_number(spec: str, text: str, kind: type[int] | type[float], zero: bool = False) -> float:
    try:
        v = kind(text)
    except ValueError:
        raise ValueError(f"arrivals {spec!r}: {text!r} is not a {kind.__name__}") from None
    if not (math.isfinite(v) and (v > 0 or (zero and v == 0))):
        raise ValueError(f"arrivals {spec!r}: {text!r} must be {'>=' if zero else '>'} 0")
    return v


def parse_arrivals(spec: str) -> Arrivals:
    """``poisson``, ``constant``, ``batches[:SIZE]``, ``onoff[:ON:OFF]``, ``burst[:N]``
    or ``replay:PATH`` (``replay-raw:PATH`` to keep the trace's own rate). Anything else,
    extra or missing parameters and non-positive numbers are a ValueError."""
    if not isinstance(spec, str):
        raise TypeError(f"spec={spec!r} must be a string")
    kind, sep, rest = spec.partition(":")
    kind = kind.strip().lower()
    if kind in ("replay", "replay-raw"):
        if not rest.strip():
            raise ValueError(f"arrivals {spec!r}: replay needs a file: {kind}:PATH")
        return Replay.from_file(rest, scale=kind == "replay")
    args: Sequence[str] = rest.split(":") if sep else []
    takes = {"poisson": (0,), "constant": (0,), "batches": (0, 1), "burst": (0, 1)}
    takes["onoff"] = takes["on-off"] = (0, 2)
    if kind not in takes:
        raise ValueError(
            f"unknown arrival process {spec!r} "
            "(poisson, constant, batches:SIZE, onoff:ON:OFF, burst:N, replay:PATH, replay-raw:PATH)"
        )
    if len(args) not in takes[kind]:
        want = " or ".join(str(n) for n in takes[kind])
        raise ValueError(f"arrivals {spec!r}: {kind} takes {want} parameters, got {len(args)}")
    if kind == "poisson":
        return Poisson()
    if kind == "constant":
        return Constant()
    if kind == "batches":
        return Batches(int(_spec_number(spec, args[0], int))) if args else Batches()
    if kind == "burst":
        return Burst(int(_spec_number(spec, args[0], int))) if args else Burst()
    if not args:
        return OnOff()
    return OnOff(_spec_number(spec, args[0], float), _spec_number(spec, args[1], float, zero=True))
