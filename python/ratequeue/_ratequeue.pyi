"""Type stubs of the native module ratequeue._ratequeue."""

from typing import Literal, final

__version__: str

Period = float | int | Literal["second", "seconds", "minute", "minutes", "hour", "hours", "day", "days"]

@final
class ManualClock:
    """A clock that moves only when told to; share it between limiters and tests."""

    def __init__(self, start: float | None = None) -> None: ...
    def now(self) -> float:
        """Seconds shown."""
    def now_ns(self) -> int:
        """Nanoseconds shown."""
    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` (>= 0); returns the new time."""
    def set(self, seconds: float) -> float:
        """Set the time (never earlier than now); returns it."""

@final
class MonotonicClock:
    """The real monotonic clock, the default of every limiter."""

    def __init__(self) -> None: ...
    def now(self) -> float: ...
    def now_ns(self) -> int: ...

Clock = ManualClock | MonotonicClock

@final
class Rate:
    """``amount`` units per ``per``, at most ``burst`` at once (default: ``amount``)."""

    def __init__(
        self,
        amount: float,
        per: Period | None = None,
        burst: int | None = None,
        unit: str = "requests",
    ) -> None: ...
    @property
    def amount(self) -> float: ...
    @property
    def per(self) -> float:
        """The period in seconds."""
    @property
    def burst(self) -> int: ...
    @property
    def unit(self) -> str: ...
    @property
    def per_second(self) -> float: ...

@final
class Reservation:
    """Capacity held for the caller from ``at`` on; proceed after ``delay`` seconds."""

    @property
    def delay(self) -> float: ...
    @property
    def at(self) -> float: ...
    @property
    def cancelled(self) -> bool: ...
    def cancel(self) -> bool:
        """Give the capacity back if still possible (see the README's refund rule)."""

@final
class Limiter:
    """A rate limiter over one or more rates, decided all-or-nothing and lock-free.

    Costs are given per unit as keywords (``tokens=1200``); a unit named ``requests``
    (or the only unit) costs 1 when not named; a positional ``n`` is the cost in the
    first unit.
    """

    def __init__(
        self,
        *rates: Rate,
        clock: Clock | None = None,
        max_wait: float | None = None,
        name: str | None = None,
    ) -> None: ...
    def try_acquire(self, n: int | None = None, /, **costs: int) -> bool:
        """Admit now or return False; never waits."""
    def retry_after(self, n: int | None = None, /, **costs: int) -> float:
        """Seconds until the costs would be admitted (0.0 = now); changes nothing."""
    def reserve(
        self, n: int | None = None, /, *, max_wait: float | None = None, **costs: int
    ) -> Reservation:
        """Reserve in arrival order; raises Overloaded if the wait would exceed max_wait."""
    def available(self, unit: str | None = None) -> float: ...
    def set_rate(
        self,
        amount: float,
        per: Period | None = None,
        *,
        burst: int | None = None,
        which: int | str | None = None,
    ) -> None: ...
    def set_burst(self, burst: int, *, which: int | str | None = None) -> None: ...
    @property
    def rates(self) -> list[Rate]: ...
    @property
    def units(self) -> list[str]: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def max_wait(self) -> float | None: ...
    @property
    def name(self) -> str | None: ...
    def _noop(self) -> None: ...
