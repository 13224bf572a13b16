"""A pool of providers: each behind its own limiter, requests go where the wait is shortest.

A *provider* is one upstream that enforces its own limits: an API key, a region, a
vendor. Each gets its own :class:`~ratequeue.Limiter` (requests per minute and, if
given, tokens per minute), a weight and a health state. A request goes to the provider
with the shortest predicted queue wait (``Limiter.predicted_wait``), skipping providers
in cooldown; ties (waits within ``tie`` seconds) are shared by weight (smooth weighted
round robin). A provider whose wait would exceed ``max_wait`` is passed over for the
next one; when none can serve in time the pool refuses at once with
:class:`PoolOverloaded` (an :class:`~ratequeue.Overloaded`), whose ``retry_after`` is
the smallest of the providers' waits.

After each call, tell the pool how it went with :meth:`Pool.report`: a 429 or a failure
puts the provider in cooldown for its ``Retry-After`` (or an exponential default), and
no request is sent to it until the cooldown ends. A grant that a provider hands out
while in cooldown (the request was already queued there) is not used: the request is
routed again with what is left of its deadline.

::

    pool = rq.Pool(
        [rq.Provider("a", rpm=500, tpm=90_000, weight=2), rq.Provider("b", rpm=300)],
        max_wait=5.0,
    )
    provider, permit = pool.acquire(tokens=1_200)
    status, headers = call(provider.name)
    pool.report(provider, status=status, retry_after=headers.get("retry-after"))
"""

from __future__ import annotations

import datetime as _dt
import email.utils
import logging
import math
import numbers
from collections.abc import Callable, Coroutine, Generator, Iterable, Iterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ._errors import CostTooLarge, Overloaded, WaitTimeout
from ._ratequeue import Channel, Limiter, Permit, Rate
from ._threads import fork_safe_lock

if TYPE_CHECKING:
    from ._ratequeue import Clock

__all__ = ["Pool", "PoolAcquiring", "PoolOverloaded", "Provider", "parse_retry_after"]

# On the real clock Limiter.predicted_wait can report a few nanoseconds (up to a few
# hundred) for a request that would be admitted now: it reads the clock twice. Waits
# below this are read as 0 so that "no wait" compares equal across providers and
# passes max_wait=0.
_CLOCK_NOISE = 1e-6


def _real(name: str, v: object) -> None:
    """A TypeError naming ``name`` unless ``v`` is a real number (bool is not)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name}={v!r} must be a number")


def _rate(name: str, amount: float, burst_name: str, burst: int | None, **kw: str) -> Rate:
    """``Rate(amount, per="minute", burst=burst)``; an error names the Provider argument."""
    try:
        return Rate(amount, per="minute", burst=burst, **kw)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}={amount!r}, {burst_name}={burst!r}: {e}") from None


def _bound(name: str, v: float | None) -> float | None:
    """A wait bound in seconds: a number >= 0; ``None`` or ``inf`` mean no bound."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name}={v!r} must be a number of seconds or None")
    if not v >= 0:
        raise ValueError(f"{name}={v!r} must be >= 0 seconds (None: no bound)")
    return None if math.isinf(v) else float(v)


def parse_retry_after(value: float | int | str | None) -> float | None:
    """Seconds from a ``Retry-After`` value: a number of seconds or an HTTP date.

    Returns None when the value is missing or unreadable; negative values and dates in
    the past give 0.0.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError("retry_after must be seconds or an HTTP date, not a bool")
    if isinstance(value, numbers.Real):
        seconds = float(value)
    elif not isinstance(value, str):
        raise TypeError(f"retry_after must be seconds or an HTTP date, got {value!r}")
    else:
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            try:
                when = email.utils.parsedate_to_datetime(text)
            except (TypeError, ValueError, IndexError):
                return None
            if when.tzinfo is None:
                when = when.replace(tzinfo=_dt.timezone.utc)
            seconds = (when - _dt.datetime.now(_dt.timezone.utc)).total_seconds()
    if math.isnan(seconds):
        return None
    return max(0.0, seconds)


class Provider:
    """One upstream with its own limiter, weight and health.

    Either give its limits (``rpm`` requests per minute, ``tpm`` tokens per minute, with
    optional bursts) or a ready ``limiter``. Health (cooldown, counters) is kept by the
    :class:`Pool` that holds it; a provider belongs to one pool.
    """

    name: str
    weight: float
    limiter: Limiter
    units: frozenset[str]

    def __init__(
        self,
        name: str,
        rpm: float | None = None,
        tpm: float | None = None,
        *,
        weight: float = 1.0,
        burst: int | None = None,
        token_burst: int | None = None,
        limiter: Limiter | None = None,
        clock: Clock | None = None,
        classes: dict[str, float] | None = None,
        max_queue: int | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        _real("weight", weight)
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be finite and > 0, got {weight!r}")
        if limiter is None:
            rates: list[Rate] = []
            if rpm is not None:
                rates.append(_rate("rpm", rpm, "burst", burst))
            if tpm is not None:
                rates.append(_rate("tpm", tpm, "token_burst", token_burst, unit="tokens"))
            if not rates:
                raise ValueError(f"provider {name!r}: give rpm and/or tpm, or a limiter")
            limiter = Limiter(*rates, clock=clock, classes=classes, max_queue=max_queue, name=name)
        elif rpm is not None or tpm is not None or clock is not None:
            raise ValueError(f"provider {name!r}: give either a limiter or rpm/tpm/clock, not both")
        self.name = name
        self.weight = float(weight)
        self.limiter = limiter
        self.units = frozenset(limiter.units)
        # Health and counters, guarded by the owning pool's lock.
        self._cooldown_until = -math.inf
        self._failures = 0
        self._current = 0.0  # smooth weighted round robin state
        self._routed = 0
        self._sent = 0
        self._rerouted = 0
        self._ok = 0
        self._rate_limited = 0
        self._failed = 0
        self._client_errors = 0
        self._cooldowns = 0

    def costs_for(self, costs: Mapping[str, int]) -> dict[str, int]:
        """The part of ``costs`` in the units this provider's limiter counts."""
        return {u: c for u, c in costs.items() if u in self.units}

    def __repr__(self) -> str:
        return f"Provider({self.name!r}, weight={self.weight:g}, limiter={self.limiter!r})"


class PoolOverloaded(Overloaded):
    """No provider of the pool can serve the request within its deadline.

    ``retry_after`` is the smallest wait among the providers; ``waits`` maps each
    provider to its wait in seconds (the cooldown left or the predicted queue wait,
    whichever is longer; ``inf`` when the cost can never fit it).
    """

    waits: dict[str, float]

    def __init__(self, message: str, retry_after: float, waits: dict[str, float]) -> None:
        super().__init__(message, retry_after)
        self.waits = waits


class Pool:
    """Providers behind one acquire: shortest predicted wait first, cooldown on 429.

    ``max_wait`` bounds the queue wait of a request (``timeout=`` per call overrides
    it); ``None`` waits as long as needed. ``cooldown`` is the pause after a 429 or a
    failure reported without ``Retry-After``; it doubles with each consecutive failure
    of the provider, up to ``max_cooldown``. ``tie`` (seconds) is how close two waits
    must be to count as equal, in which case weight decides. ``clock`` (default: the
    first provider's limiter clock) measures cooldowns; share it with the limiters.
    """

    def __init__(
        self,
        providers: Iterable[Provider],
        *,
        max_wait: float | None = None,
        cooldown: float = 1.0,
        max_cooldown: float = 300.0,
        tie: float = 1e-3,
        clock: Clock | None = None,
    ) -> None:
        if isinstance(providers, (str, bytes)) or not isinstance(providers, Iterable):
            raise TypeError(f"providers must be a sequence of Provider objects, got {providers!r}")
        self._providers: tuple[Provider, ...] = tuple(providers)
        if not self._providers:
            raise ValueError("providers: a pool needs at least one Provider")
        for p in self._providers:
            if not isinstance(p, Provider):
                raise TypeError(f"providers must be Provider objects, got {p!r}")
        names = [p.name for p in self._providers]
        if len(set(names)) != len(names):
            raise ValueError(f"provider names must be unique, got {names}")
        for label, v in (("cooldown", cooldown), ("max_cooldown", max_cooldown), ("tie", tie)):
            _real(label, v)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{label} must be finite and >= 0, got {v!r}")
        max_wait = _bound("max_wait", max_wait)
        self._by_name = {p.name: p for p in self._providers}
        self._units = frozenset().union(*(p.units for p in self._providers))
        self.max_wait = max_wait
        self.cooldown = float(cooldown)
        self.max_cooldown = float(max_cooldown)
        self.tie = float(tie)
        self._clock: Clock = clock if clock is not None else self._providers[0].limiter.clock
        self._lock = fork_safe_lock(self)
        self._listeners: tuple[Callable[[str, int | None, bool], object], ...] = ()

    # -- the providers ------------------------------------------------------------------

    @property
    def providers(self) -> tuple[Provider, ...]:
        return self._providers

    @property
    def clock(self) -> Clock:
        return self._clock

    def __len__(self) -> int:
        return len(self._providers)

    def __iter__(self) -> Iterator[Provider]:
        return iter(self._providers)

    def __getitem__(self, name: str) -> Provider:
        return self._by_name[name]

    def _get(self, provider: Provider | str) -> Provider:
        if isinstance(provider, Provider):
            if self._by_name.get(provider.name) is not provider:
                raise ValueError(f"{provider!r} is not in this pool")
            return provider
        if not isinstance(provider, str):
            raise TypeError(f"provider must be a Provider or its name, got {provider!r}")
        try:
            return self._by_name[provider]
        except KeyError:
            raise ValueError(f"no provider named {provider!r} in this pool") from None

    def cooldown_remaining(self, provider: Provider | str) -> float:
        """Seconds until the provider may be used again (0.0 when it may now)."""
        p = self._get(provider)
        return max(0.0, p._cooldown_until - self._clock.now())

    def in_cooldown(self, provider: Provider | str) -> bool:
        return self.cooldown_remaining(provider) > 0.0

    # -- routing ------------------------------------------------------------------------

    def _check_units(self, costs: Mapping[str, int]) -> None:
        unknown = set(costs) - self._units
        if unknown:
            raise TypeError(
                f"unexpected cost unit(s) {sorted(unknown)}: this pool counts {sorted(self._units)}"
            )

    def waits(self, *, priority: str | None = None, **costs: int) -> dict[str, float]:
        """Per provider, the seconds a request of class ``priority`` would wait if it
        arrived now.

        That is the longer of the cooldown left and the predicted queue wait; ``inf``
        when the cost exceeds the provider's burst.
        """
        self._check_units(costs)
        now = self._clock.now()
        out: dict[str, float] = {}
        for p in self._providers:
            try:
                w = p.limiter.predicted_wait(priority=priority, **p.costs_for(costs))
            except CostTooLarge:
                w = math.inf
            out[p.name] = max(0.0 if w < _CLOCK_NOISE else w, p._cooldown_until - now)
        return out

    def choose(
        self,
        *,
        max_wait: float | None = None,
        exclude: Iterable[str] = (),
        priority: str | None = None,
        **costs: int,
    ) -> tuple[Provider, float]:
        """The provider a request of class ``priority`` would go to now, and its
        predicted wait.

        Skips providers in cooldown, those named in ``exclude`` and those whose wait
        exceeds ``max_wait``. Raises :class:`PoolOverloaded` when none is left, or
        :class:`~ratequeue.CostTooLarge` when the cost fits no provider at all.
        """
        self._check_units(costs)
        skip = set(exclude)
        now = self._clock.now()
        candidates: list[tuple[Provider, float]] = []
        waits: dict[str, float] = {}
        never = 0  # providers whose limits the cost can never fit
        for p in self._providers:
            try:
                w = p.limiter.predicted_wait(priority=priority, **p.costs_for(costs))
            except CostTooLarge:
                w = math.inf
            if w < _CLOCK_NOISE:
                w = 0.0  # see _CLOCK_NOISE
            if math.isinf(w):
                never += 1
                waits[p.name] = math.inf
                continue
            cool = p._cooldown_until - now
            waits[p.name] = max(w, cool)
            if p.name in skip or cool > 0.0:
                continue
            if max_wait is not None and w > max_wait:
                continue
            candidates.append((p, w))
        if not candidates:
            if never == len(self._providers):
                raise CostTooLarge(
                    f"the cost {dict(costs)} exceeds a burst of every provider of the pool"
                )
            smallest = min(waits.values())
            detail = ", ".join(
                f"{name} {'cooling down ' if self._by_name[name]._cooldown_until > now else ''}"
                f"{w:.3g} s"
                for name, w in waits.items()
            )
            bound = "" if max_wait is None else f" within max_wait={max_wait:g} s"
            raise PoolOverloaded(
                f"no provider can serve this request{bound} (waits: {detail})",
                smallest if math.isfinite(smallest) else math.inf,
                waits,
            )
        best = min(w for _, w in candidates)
        tied = [(p, w) for p, w in candidates if w <= best + self.tie]
        if len(tied) == 1:
            return tied[0]
        # Smooth weighted round robin among the tied providers.
        with self._lock:
            total = 0.0
            for p, _ in tied:
                p._current += p.weight
                total += p.weight
            chosen = max(tied, key=lambda pw: pw[0]._current)
            chosen[0]._current -= total
        return chosen

    def _budget(self, timeout: float | None) -> float | None:
        return self.max_wait if timeout is None else _bound("timeout", timeout)

    def _max_rounds(self) -> int:
        return 4 * len(self._providers) + 4

    def _remaining(self, deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - self._clock.now())

    def _give_up(
        self, deadline: float | None, costs: Mapping[str, int], priority: str | None = None
    ) -> PoolOverloaded:
        waits = self.waits(priority=priority, **costs)
        smallest = min(waits.values())
        return PoolOverloaded(
            f"no provider could serve this request before its deadline (waits: {waits})",
            smallest,
            waits,
        )

    def on_grant(self, provider: Provider | str) -> bool:
        """Account a grant; False if its provider is in cooldown (route it again).

        :meth:`acquire` and :meth:`acquire_async` call this themselves; a driver of its
        own (the lab's virtual time) calls it when a queued request is granted.
        """
        p = self._get(provider)
        cooling = p._cooldown_until > self._clock.now()
        with self._lock:
            if cooling:
                p._rerouted += 1
            else:
                p._sent += 1
        return not cooling

    def acquire(
        self, *, priority: str | None = None, timeout: float | None = None, **costs: int
    ) -> tuple[Provider, Permit]:
        """Wait (blocking, GIL released) for a permit from the best provider.

        Returns ``(provider, permit)``; send the request to ``provider`` and then
        :meth:`report` the outcome. Raises :class:`PoolOverloaded` when no provider can
        serve within ``timeout`` (default: the pool's ``max_wait``).
        """
        budget = self._budget(timeout)
        deadline = None if budget is None else self._clock.now() + budget
        excluded: set[str] = set()
        for _ in range(self._max_rounds()):
            remaining = self._remaining(deadline)
            p, _ = self.choose(max_wait=remaining, exclude=excluded, priority=priority, **costs)
            with self._lock:
                p._routed += 1
            try:
                permit = p.limiter.acquire(
                    priority=priority, timeout=remaining, **p.costs_for(costs)
                )
            except (Overloaded, WaitTimeout):
                excluded.add(p.name)  # its queue grew since the prediction: fall back
                continue
            if self.on_grant(p):
                return p, permit
        raise self._give_up(deadline, costs, priority)

    def acquire_async(
        self, *, priority: str | None = None, timeout: float | None = None, **costs: int
    ) -> PoolAcquiring:
        """The asyncio form of :meth:`acquire` (one wake-up per grant, no polling): await
        it for ``(provider, permit)``, or ``async with`` it to release the permit at exit."""
        return PoolAcquiring(self, priority, timeout, costs)

    def _submit(
        self,
        channel: Channel,
        priority: str | None,
        timeout: float | None,
        costs: dict[str, int],
    ) -> tuple[Provider, Permit | int]:
        budget = self._budget(timeout)
        excluded: set[str] = set()
        for _ in range(self._max_rounds()):
            p, _ = self.choose(max_wait=budget, exclude=excluded, priority=priority, **costs)
            with self._lock:
                p._routed += 1
            try:
                r = p.limiter.submit(
                    channel, priority=priority, timeout=budget, **p.costs_for(costs)
                )
            except Overloaded:
                excluded.add(p.name)
                continue
            if isinstance(r, Permit):
                with self._lock:
                    p._sent += 1
            return p, r
        raise self._give_up(None, costs, priority)

    # -- outcomes -----------------------------------------------------------------------

    def subscribe(self, listener: Callable[[str, int | None, bool], object]) -> None:
        """Call ``listener(provider_name, status, failed)`` after every :meth:`report`
        (``failed``: a 429, a 5xx or ``ok=False``), outside the pool's lock, in the
        reporting thread; an exception it raises is logged, never raised to the
        reporter. ``rq.Adaptive.follow(pool)`` uses it."""
        if not callable(listener):
            raise TypeError(f"listener must be callable, got {listener!r}")
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def unsubscribe(self, listener: Callable[[str, int | None, bool], object]) -> None:
        """Stop calling ``listener`` (a no-op if it was not subscribed)."""
        with self._lock:
            self._listeners = tuple(x for x in self._listeners if x is not listener)

    def report(
        self,
        provider: Provider | str,
        status: int | None = None,
        *,
        ok: bool | None = None,
        retry_after: float | str | None = None,
    ) -> float:
        """Record how a call to ``provider`` went; returns the cooldown started (s).

        ``status=429`` (rate limited) or a failure (``ok=False``, or a 5xx status)
        puts the provider in cooldown for ``retry_after`` (seconds or an HTTP date, as
        in the ``Retry-After`` header, at most ``max_cooldown``) or, without it, for
        ``cooldown`` doubled per consecutive failure up to ``max_cooldown``. A success
        (``ok=True``, or a 2xx/3xx status) ends the run of failures. Other 4xx statuses
        are the caller's fault and change nothing but a counter.
        """
        p = self._get(provider)
        if status is not None and (isinstance(status, bool) or not isinstance(status, int)):
            raise TypeError(f"status must be an int HTTP status, got {status!r}")
        if status is not None and not 100 <= status <= 599:
            raise ValueError(f"status={status!r} is not an HTTP status (100..599)")
        seconds = parse_retry_after(retry_after)
        if seconds is not None:
            # A provider's Retry-After never disables it for longer than max_cooldown.
            seconds = min(seconds, self.max_cooldown)
        seconds, failed = self._record(p, status, ok, seconds)
        for listener in self._listeners:
            try:
                listener(p.name, status, failed)
            except Exception:
                logging.getLogger("ratequeue.pool").exception(
                    "pool listener %r failed on a report of %s", listener, p.name
                )
        return seconds

    def _record(
        self, p: Provider, status: int | None, ok: bool | None, seconds: float | None
    ) -> tuple[float, bool]:
        now = self._clock.now()
        with self._lock:
            if status == 429:
                p._rate_limited += 1
                failed = True
            elif ok is False or (status is not None and status >= 500):
                p._failed += 1
                failed = True
            elif status is not None and 400 <= status < 500:
                p._client_errors += 1
                return 0.0, False
            else:
                p._ok += 1
                p._failures = 0
                return 0.0, False
            p._failures += 1
            if seconds is None:
                seconds = min(self.max_cooldown, self.cooldown * 2.0 ** (p._failures - 1))
            if failed and seconds > 0.0:
                p._cooldown_until = max(p._cooldown_until, now + seconds)
                p._cooldowns += 1
            return seconds, failed

    def stats(self) -> dict[str, dict[str, float | int]]:
        """Per provider: counters, the cooldown left and the predicted wait now."""
        now = self._clock.now()
        out: dict[str, dict[str, float | int]] = {}
        with self._lock:
            for p in self._providers:
                out[p.name] = {
                    "weight": p.weight,
                    "routed": p._routed,
                    "sent": p._sent,
                    "rerouted": p._rerouted,
                    "ok": p._ok,
                    "rate_limited": p._rate_limited,
                    "failed": p._failed,
                    "client_errors": p._client_errors,
                    "cooldowns": p._cooldowns,
                    "cooldown_remaining": max(0.0, p._cooldown_until - now),
                    "waiting": p.limiter.waiting,
                }
        return out

    def __repr__(self) -> str:
        names = ", ".join(p.name for p in self._providers)
        return f"Pool([{names}], max_wait={self.max_wait!r})"


class PoolAcquiring(Coroutine[Any, Any, "tuple[Provider, Permit]"]):
    """What :meth:`Pool.acquire_async` returns: await it for ``(provider, permit)``, or
    ``async with`` it to release the permit at exit; a coroutine for ``create_task``.

    Nothing is routed or queued until it is first awaited (or sent to).
    """

    __slots__ = ("_costs", "_got", "_pool", "_priority", "_run", "_timeout")

    def __init__(
        self, pool: Pool, priority: str | None, timeout: float | None, costs: dict[str, int]
    ) -> None:
        self._pool = pool
        self._priority = priority
        self._timeout = timeout
        self._costs = costs
        self._got: tuple[Provider, Permit] | None = None
        self._run: Generator[Any, None, tuple[Provider, Permit]] | None = None

    def __await__(self) -> Generator[Any, None, tuple[Provider, Permit]]:
        run = self._run
        if run is None:
            run = self._run = self._wait()
        elif getattr(run, "gi_frame", None) is None:
            raise RuntimeError("cannot reuse an already awaited PoolAcquiring")
        return run

    def _wait(self) -> Generator[Any, None, tuple[Provider, Permit]]:
        """The wait itself (a generator, no coroutine object in between): route, then
        await the chosen provider's limiter; the next provider when one refuses."""
        pool, priority, costs = self._pool, self._priority, self._costs
        budget = pool._budget(self._timeout)
        deadline = None if budget is None else pool._clock.now() + budget
        excluded: set[str] = set()
        for _ in range(pool._max_rounds()):
            remaining = pool._remaining(deadline)
            p, _ = pool.choose(max_wait=remaining, exclude=excluded, priority=priority, **costs)
            with pool._lock:
                p._routed += 1
            try:
                permit: Permit = yield from p.limiter.acquire_async(
                    priority=priority, timeout=remaining, **p.costs_for(costs)
                )
            except (Overloaded, WaitTimeout):
                excluded.add(p.name)
                continue
            if pool.on_grant(p):
                return p, permit
        raise pool._give_up(deadline, costs, priority)

    def _steps(self) -> Generator[Any, None, tuple[Provider, Permit]]:
        run = self._run
        if run is None:
            run = self._run = self._wait()
        return run

    def send(self, value: Any, /) -> Any:
        """Coroutine protocol, so ``asyncio.create_task`` accepts it."""
        return self._steps().send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None, /) -> Any:
        """Coroutine protocol: raise ``typ`` (or ``val``) at the wait."""
        if val is None and tb is None:
            return self._steps().throw(typ)
        return self._steps().throw(typ, val, tb)

    def close(self) -> None:
        """Coroutine protocol: end a wait that was started (nothing to do otherwise)."""
        if self._run is not None:
            self._run.close()

    async def __aenter__(self) -> tuple[Provider, Permit]:
        self._got = await self
        return self._got

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if self._got is not None:
            self._got[1].release()
        return False

    def _submit(self, channel: Channel) -> tuple[Provider, Permit | int]:
        """Without waiting, for a driver of its own (the lab's virtual time): the
        provider and a Permit if granted at once, else the ticket whose outcome comes
        through ``channel``; on a grant, :meth:`Pool.on_grant` says whether to use it."""
        return self._pool._submit(channel, self._priority, self._timeout, self._costs)
