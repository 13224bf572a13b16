"""Type stubs of the native module ratequeue._ratequeue."""

from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, SupportsIndex, TypeAlias, final

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

__version__: str

def _use_errors(
    overloaded: type[Exception], wait_timeout: type[Exception], cost_too_large: type[Exception]
) -> None: ...
def _use_aio(
    policy_wait: Callable[[PolicyAcquiring], Awaitable[PolicyPermit]],
    running_waiters: Callable[[], tuple[Any, _LoopWaiters]],
) -> None: ...
def _hold_locks_for_test(obj: Limiter | KeyedLimiter | PolicyAcquiring, seconds: float) -> None: ...
def _skip_fork_handlers_for_test(obj: Limiter) -> None: ...
def _driver_fault_for_test(kind: Literal["fail_spawn", "panic_wake", "exit"], n: int) -> None: ...

# The LLM transport's body readers (ratequeue.httpx): False defers to the Python reader.
def _read_usage(body: bytes) -> tuple[int, int] | Literal[False] | None: ...
def _read_request(
    body: bytes, chars_per_token: int, default_output_tokens: int
) -> tuple[str | None, bool, int, int] | Literal[False] | None: ...
def _scan_response(headers: list[tuple[bytes, bytes, bytes]]) -> tuple[bytes, bool] | None: ...
def _read_response(
    headers: list[tuple[bytes, bytes, bytes]], body: bytes | None = None
) -> tuple[bytes, bool, tuple[int, int] | Literal[False] | None] | None: ...
def _settle_response(
    call: object,
    once: list[None],
    permit: object,
    charged: dict[str, int],
    plan: tuple[tuple[str, int], ...],
    headers: list[tuple[bytes, bytes, bytes]] | None,
    body: bytes | None,
    max_body: int,
    histogram: Histogram,
    http_seconds: float,
    usage_type: type,
    transport: object | None = None,
    read_ahead: bool = False,
) -> tuple[bytes, bool, Literal[False]] | Literal[False] | _BodyReader | int | None: ...
def _read_call_headers(
    headers: list[tuple[bytes, bytes, bytes]],
) -> tuple[str | None, str | None, str | None, str | None, bytes | None] | None: ...
def _cap_output(
    body: bytes, limit: int, add: int
) -> tuple[bytes, int, int | None, int] | str | Literal[False] | None: ...
def _emits_no_tokens(path: str) -> bool: ...
def _spends_no_tokens(path: str) -> bool: ...

_OUTPUT_BOUNDS: tuple[tuple[str, str], ...]
_CHOICES: tuple[str, ...]
_NESTED_CHOICES: tuple[tuple[str, str], ...]
_CONTAINERS: tuple[tuple[str, int], ...]
_NO_TOKEN_ROUTES: tuple[str, ...]
_MODEL_CALLS: tuple[str, ...]
_NO_TEXT_ROUTES: tuple[str, ...]
_MANAGEMENT: tuple[str, ...]
_MANAGEMENT_ACTIONS: tuple[str, ...]
_FREE_CALLS: tuple[str, ...]

@final
class _SSEFrames:
    """A stream's Server-Sent Events framed natively (ratequeue.httpx only)."""

    def __new__(cls, max_event: int) -> _SSEFrames: ...
    def feed(self, chunk: bytes) -> list[bytes] | None: ...
    @property
    def events(self) -> int: ...
    @property
    def buffered(self) -> int: ...

def _next_id(prefix: str) -> str: ...

@final
class _BodyReader:
    """A streamed response body read as it passes (ratequeue.httpx only)."""

    def feed(self, chunk: bytes) -> None: ...
    def finish(self) -> None: ...
    def iterate(self, inner: Iterable[bytes], owner: object) -> _BodyIter: ...
    @property
    def finished(self) -> bool: ...
    @property
    def call(self) -> Any: ...
    @property
    def transport(self) -> Any: ...

@final
class _BodyIter:
    """The chunks of a stream fed to its reader (ratequeue.httpx only)."""

    def __iter__(self) -> _BodyIter: ...
    def __next__(self) -> bytes: ...

@final
class _RequestReader:
    """The transport's request read in one call (ratequeue.httpx only)."""

    def __new__(
        cls,
        plan: tuple[tuple[str, int, int | None], ...],
        unit_costs: dict[str, int],
        triples: set[type],
        token_estimator: type,
        chars_estimate: object,
        chars: object,
        estimate: type,
        *,
        needs_body: bool,
        stream_usage: bool,
        caps: bool,
        max_body: int,
        replace_body: Any = None,
        call: tuple[type, Any, Any, Any, Any, tuple[str, str, str], tuple[tuple[str, Any], ...]]
        | None = None,
        limiter: Limiter | None = None,
    ) -> _RequestReader: ...
    def read(
        self, request: Any, path: str, want_estimate: bool, estimator: object
    ) -> (
        tuple[
            str | None,
            str | None,
            str | None,
            str | None,
            str | None,
            Any,
            dict[str, int],
            tuple[str, ...],
            Any,
            None,
            bool,
            bool,
        ]
        | None
    ): ...
    def prepare(
        self,
        request: Any,
        estimator: object,
        is_async: bool,
        priority: str | None,
        timeout: float | None,
        account: object,
        wait: object,
    ) -> Any | None: ...

# The asyncio bridge's calls for a policy's queued wait (ratequeue.aio only).
def _wait_policy(acq: PolicyAcquiring) -> Awaitable[PolicyPermit]: ...
def _wait_left(acq: PolicyAcquiring) -> float: ...

# Hooks that drive a limiter's acquire on a channel by hand (tests).
def _wait_submit(acq: Acquiring, channel: Channel) -> Permit | int: ...
def _wait_granted(acq: Acquiring, waited_ns: int, token: int | None = None) -> Permit: ...
def _wait_give_back(acq: Acquiring, token: int | None = None) -> None: ...
def _wait_cancel(acq: Acquiring | PolicyAcquiring, ticket: int) -> bool: ...

# The LLM transport's grant at once, on its own (the history checker).
def _grant_now(
    limiter: Limiter, costs: dict[str, int], priority: str | None, timeout: float | None
) -> Permit | None: ...

@final
class _PolicyKeywords:
    def __new__(cls, levels: Sequence[tuple[str, bool, Sequence[str]]]) -> _PolicyKeywords: ...
    def parse(
        self, kw: Mapping[str, object] | None = None
    ) -> tuple[tuple[object, ...], dict[str, int]]: ...

@final
class _Floor:
    """The benchmarks' floor: ``noop()`` does nothing, called as any method of the extension."""

    def __new__(cls) -> _Floor: ...
    def noop(self) -> None: ...

@final
class _LimiterKeywords:
    def __new__(cls, units: Sequence[str]) -> _LimiterKeywords: ...
    def parse(self, n: object = None, kw: Mapping[str, object] | None = None) -> list[int]: ...

Period: TypeAlias = (
    float | int | Literal["second", "seconds", "minute", "minutes", "hour", "hours", "day", "days"]
)

@final
class ManualClock:
    """A clock that moves only when told to; share it between limiters and tests.

    It may start anywhere (a Unix timestamp for replays works like 0); it shows at most
    2**63 ns (about 292 years): moving it beyond raises ValueError.
    """

    def __new__(cls, start: float | None = None) -> ManualClock: ...
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

    def __new__(cls) -> MonotonicClock: ...
    def now(self) -> float: ...
    def now_ns(self) -> int: ...

Clock: TypeAlias = ManualClock | MonotonicClock

@final
class Rate:
    """``amount`` units per ``per``, at most ``burst`` at once (default: ``amount``)."""

    def __new__(
        cls,
        amount: float,
        per: Period | None = None,
        burst: int | None = None,
        unit: str = "requests",
    ) -> Rate: ...
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
        """Give the capacity back by the one undo rule (README: "Undo and refunds")."""

@final
class Histogram:
    """Durations in seconds: lock-free recording, <= 1 % relative error from 1 us to centuries.

    Bucket edges have three significant digits in nanoseconds, so Prometheus ``le``
    boundaries such as 0.0025 or 300 are read off exactly. Read while other threads
    record, count, min, max and percentiles agree (min <= max, each within the bucket
    of a value counted); counts stick at 2**64 - 1 rather than wrap.
    """

    buckets: int
    def __new__(cls) -> Histogram: ...
    def record(self, seconds: float) -> None: ...
    def record_many(
        self, values: npt.NDArray[np.floating[Any] | np.integer[Any]] | Sequence[float]
    ) -> None:
        """Record a 1-D array (int or float) or sequence of seconds; all or nothing."""
    @property
    def count(self) -> int: ...
    def __len__(self) -> int: ...
    @property
    def sum(self) -> float: ...
    @property
    def min(self) -> float: ...
    @property
    def max(self) -> float: ...
    @property
    def mean(self) -> float: ...
    @property
    def underflow(self) -> int: ...
    @property
    def overflow(self) -> int: ...
    def __copy__(self) -> Histogram: ...
    def __deepcopy__(self, _memo: Any = None) -> Histogram: ...
    def percentile(self, q: float) -> float:
        """The value of nearest rank ceil(q/100 * count), q read as the decimal it prints as."""
    def percentiles(self, qs: Sequence[float]) -> list[float]: ...
    def count_le(self, le: float) -> int: ...
    def cumulative(self, les: Sequence[float]) -> list[int]: ...
    def to_numpy(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float64]]:
        """(counts, edges) like numpy.histogram; edges in seconds."""
    def to_bytes(self) -> bytes: ...
    @classmethod
    def from_bytes(cls, data: bytes) -> Histogram: ...
    def merge(self, other: Histogram) -> None: ...
    def copy(self) -> Histogram: ...
    def reset(self) -> Histogram:
        """Empty it; returns what it held."""

@final
class Permit:
    """A grant. A context manager; a Concurrency permit is returned on exit, or when it
    is dropped unreleased."""

    @property
    def waited(self) -> float:
        """Seconds spent in the queue (arrival to grant, in schedule time)."""
    @property
    def granted_at_ns(self) -> int:
        """The grant's schedule time in nanoseconds of the limiter's clock (``now_ns()``)."""
    @property
    def released(self) -> bool: ...
    def release(self) -> bool:
        """Return a Concurrency permit now; True if this call released it."""
    def settle(self, **costs: int) -> None:
        """Correct estimated costs to actual ones: refund the difference or charge it."""
    @property
    def costs(self) -> dict[str, int]: ...
    def __enter__(self) -> Permit: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool: ...

@final
class Acquiring:
    """What acquire_async returns: await it for a Permit, or use ``async with``."""

    def __await__(self) -> Generator[Any, None, Permit]: ...
    def __iter__(self) -> Acquiring: ...
    def __next__(self) -> Any: ...
    def send(self, value: Any, /) -> Any:
        """Coroutine protocol, so ``asyncio.create_task`` accepts it."""
    def throw(self, typ: Any, val: Any = None, tb: Any = None, /) -> Any: ...
    def close(self) -> None: ...
    async def __aenter__(self) -> Permit: ...
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool: ...

@final
class Channel:
    """Where a queue delivers the outcomes of ``submit(channel, ...)``: for an event loop
    other than asyncio (watch ``fileno()``, then drain) or for virtual time."""

    def __new__(cls, *, wakeup: bool = False) -> Channel: ...
    def fileno(self) -> int: ...
    def drain(self) -> list[tuple[int, bool, int]]: ...
    def drain_tokens(self) -> list[tuple[int, bool, int, int]]: ...
    def close(self) -> list[tuple[int, bool, int, int]]: ...
    @property
    def closed(self) -> bool: ...
    @property
    def pending(self) -> int: ...

@final
class _LoopWaiters:
    """The futures an event loop's tasks wait on, resolved natively (internal)."""

    def __new__(cls, channel: Channel) -> _LoopWaiters: ...
    def _resolve(self) -> list[tuple[int, bool, int, int]]: ...

@final
class Concurrency:
    """At most ``limit`` holders at once; waiters queue by class, FIFO, bounded."""

    def __new__(
        cls,
        limit: int,
        *,
        classes: dict[str, float] | None = None,
        max_wait: float | None = None,
        max_queue: int | None = None,
        clock: Clock | None = None,
        name: str | None = None,
    ) -> Concurrency: ...
    def try_acquire(self, n: int | None = None) -> Permit | None: ...
    def acquire(
        self, n: int | None = None, *, priority: str | None = None, timeout: float | None = None
    ) -> Permit: ...
    def acquire_async(
        self, n: int | None = None, *, priority: str | None = None, timeout: float | None = None
    ) -> Acquiring: ...
    def submit(
        self,
        channel: Channel,
        n: int | None = None,
        *,
        priority: str | None = None,
        timeout: float | None = None,
    ) -> Permit | int: ...
    def give_back(self, n: int | None = None) -> None: ...
    @property
    def in_use(self) -> int: ...
    @property
    def limit(self) -> int: ...
    def set_limit(self, limit: int) -> None: ...
    @property
    def waiting(self) -> int: ...
    def poll(self) -> float | None: ...
    def stats(self) -> dict[str, Any]: ...
    def wait_histogram(self, priority: str | None = None) -> Histogram: ...
    @property
    def classes(self) -> list[str]: ...
    @property
    def name(self) -> str | None: ...

@final
class Limiter:
    """A rate limiter over one or more rates, decided all-or-nothing and lock-free.

    Costs are given per unit as keywords (``tokens=1200``); a unit named ``requests``
    (or the only unit) costs 1 when not named; a positional ``n`` is the cost in the
    first unit.
    """

    def __new__(
        cls,
        *rates: Rate,
        clock: Clock | None = None,
        max_wait: float | None = None,
        max_queue: int | None = None,
        classes: dict[str, float] | None = None,
        name: str | None = None,
    ) -> Limiter: ...
    def acquire(
        self,
        n: int | None = None,
        /,
        *,
        priority: str | None = None,
        timeout: float | None = None,
        **costs: int,
    ) -> Permit:
        """Wait in the queue until granted (GIL released)."""
    def acquire_async(
        self,
        n: int | None = None,
        /,
        *,
        priority: str | None = None,
        timeout: float | None = None,
        **costs: int,
    ) -> Acquiring:
        """Awaitable and async context manager version of acquire."""
    def submit(
        self,
        channel: Channel,
        n: int | None = None,
        /,
        *,
        priority: str | None = None,
        timeout: float | None = None,
        **costs: int,
    ) -> Permit | int:
        """Without blocking: a Permit if granted at once, else a ticket drained from channel."""
    def predicted_wait(
        self, n: int | None = None, /, *, priority: str | None = None, **costs: int
    ) -> float:
        """Seconds a request of class ``priority`` would wait if it arrived now: behind the
        waiters the fair queue serves first (exact while nothing else arrives)."""
    def poll(self) -> float | None:
        """Grant and expire what is due now; the next due time or None."""
    def next_wake(self) -> float | None: ...
    def run_until(self, until: float) -> int:
        """On a ManualClock: advance through every due time up to ``until``.

        ValueError if ``until`` is beyond the clock's range (nothing moves), or if a
        waiter stays due without being granted or expired (instead of spinning).
        """
    @property
    def waiting(self) -> int: ...
    def stats(self) -> dict[str, Any]:
        """Counters, depths, wait histograms and available capacity, in one snapshot."""
    def wait_histogram(self, priority: str | None = None) -> Histogram:
        """The live histogram of queue waits (seconds) of a class."""
    @property
    def classes(self) -> list[str]: ...
    def try_acquire(self, n: int | None = None, /, **costs: int) -> bool:
        """Admit now or return False; never waits."""
    def retry_after(self, n: int | None = None, /, **costs: int) -> float:
        """Seconds after which try_acquire is admitted, everyone queued served first."""
    def reserve(
        self, n: int | None = None, /, *, max_wait: float | None = None, **costs: int
    ) -> Reservation:
        """Reserve in arrival order, behind any waiters; Overloaded when the queue is full
        or the wait would exceed max_wait."""
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
    def pause(self, seconds: float, *, unit: str | None = None) -> bool:
        """Admit nothing in ``unit`` (default: every unit) for ``seconds``, then one unit:
        its buckets go into a debt the clock repays by then; a longer debt is kept.
        True when a bucket moved."""

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

# A str, bytes or integer (int, bool, numpy integer); one key per kind and value.
Key: TypeAlias = str | bytes | int | SupportsIndex

@final
class KeyedLimiter:
    """One bucket per key (user, API key, tenant) in a bounded map.

    Keys are kept as 64-bit keyed hashes of their kind and exact value (``-1`` and
    ``2**64 - 1`` are two keys, ``1`` and ``"1"`` too); ``max_keys`` bounds memory (full
    buckets are dropped first, which changes no decision; then the bucket nearest to full)
    and the keys waiting at once (a waiter on one more key is refused with Overloaded).
    """

    def __new__(
        cls,
        rate: Rate,
        *,
        max_keys: int | None = None,
        clock: Clock | None = None,
        max_wait: float | None = None,
        max_queue: int | None = None,
        name: str | None = None,
    ) -> KeyedLimiter: ...
    def try_acquire(self, key: Key, cost: int = 1) -> bool: ...
    def try_acquire_many(
        self,
        keys: npt.NDArray[np.uint64] | npt.NDArray[np.int64] | Sequence[Key],
        costs: npt.NDArray[np.uint64] | Sequence[int] | None = None,
    ) -> npt.NDArray[np.bool_]:
        """Decide every key in order, as the loop of try_acquire would."""
    def acquire(self, key: Key, cost: int = 1, *, timeout: float | None = None) -> Permit: ...
    def acquire_async(
        self, key: Key, cost: int = 1, *, timeout: float | None = None
    ) -> Acquiring: ...
    def available(self, key: Key) -> float: ...
    def retry_after(self, key: Key, cost: int = 1) -> float: ...
    def sweep(self) -> int: ...
    def run_until(self, until: float) -> int:
        """On a ManualClock: advance through every due time of the keys' queues."""
    def poll(self) -> float | None: ...
    def __len__(self) -> int: ...
    @property
    def rate(self) -> Rate: ...
    @property
    def max_keys(self) -> int: ...
    @property
    def name(self) -> str | None: ...
    def stats(self) -> dict[str, Any]: ...
    def wait_histogram(self) -> Histogram: ...

@final
class KeyedConcurrency:
    """At most ``limit`` holders per key; keys holding nothing cost nothing.

    At most 2**20 keys wait at once: a waiter on one more key is refused with Overloaded.
    """

    def __new__(
        cls,
        limit: int,
        *,
        clock: Clock | None = None,
        max_wait: float | None = None,
        max_queue: int | None = None,
        name: str | None = None,
    ) -> KeyedConcurrency: ...
    def try_acquire(self, key: Key, n: int = 1) -> Permit | None: ...
    def acquire(self, key: Key, n: int = 1, *, timeout: float | None = None) -> Permit: ...
    def acquire_async(self, key: Key, n: int = 1, *, timeout: float | None = None) -> Acquiring: ...
    def in_use(self, key: Key) -> int: ...
    def run_until(self, until: float) -> int: ...
    def poll(self) -> float | None: ...
    @property
    def limit(self) -> int: ...
    @property
    def name(self) -> str | None: ...
    def __len__(self) -> int: ...
    def stats(self) -> dict[str, Any]: ...

Level: TypeAlias = Limiter | KeyedLimiter | Concurrency | KeyedConcurrency

@final
class PolicyPermit:
    """What a Policy granted; returns concurrency permits on exit, or when it is dropped
    unreleased."""

    @property
    def delay(self) -> float:
        """Seconds from the call to the time every level holds it (0.0: at once)."""
    @property
    def granted_at_ns(self) -> int:
        """The time every level holds it, in nanoseconds of the policy's clock."""
    @property
    def released(self) -> bool: ...
    def release(self) -> bool: ...
    def cancel(self) -> None: ...
    def settle(self, **costs: int) -> None: ...
    def __enter__(self) -> PolicyPermit: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool: ...

@final
class PolicyAcquiring:
    """What ``Policy.acquire_async`` returns: await it for a PolicyPermit, or use
    ``async with`` (the concurrency permits are released on exit)."""

    def __await__(self) -> Generator[Any, None, PolicyPermit]: ...
    async def __aenter__(self) -> PolicyPermit: ...
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool: ...

@disjoint_base
class Policy:
    """Several limits at once (user -> tenant -> cluster), all or nothing.

    Keyed levels take their key from the keyword named like the level; costs are
    keywords per unit; ``shadow`` levels are evaluated and counted, never enforced.
    ``ratequeue.Policy`` is this class's Python subclass, whose levels may also hold one
    ``ratequeue.ledger.QuotaLevel`` (a ``ratequeue.ledger.LedgerPolicy``).
    """

    def __new__(
        cls, levels: dict[str, Level], *, shadow: Sequence[str] | None = None
    ) -> Policy: ...
    def try_acquire(self, **kw: Any) -> PolicyPermit | None: ...
    def reserve(self, *, max_wait: float | None = None, **kw: Any) -> PolicyPermit: ...
    def acquire(self, *, timeout: float | None = None, **kw: Any) -> PolicyPermit: ...
    def acquire_async(self, *, timeout: float | None = None, **kw: Any) -> PolicyAcquiring: ...
    @property
    def levels(self) -> list[str]: ...
    def stats(self) -> dict[str, Any]: ...
