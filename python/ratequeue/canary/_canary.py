"""The Canary: routes user requests to a stable and a candidate arm, gates the rollout."""

from __future__ import annotations

import asyncio
import collections
import contextvars
import hashlib
import inspect
import logging
import math
import numbers
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

from .._cancel import within
from .._errors import Overloaded, WaitTimeout
from .._ratequeue import MonotonicClock
from .._threads import fork_safe_lock
from ._gates import DEFAULT_GATES, Gate, GateResult
from ._kpi import ArmKPIs, ArmStats
from ._shadow import ShadowRunner

__all__ = [
    "MAX_COUNT",
    "Arm",
    "Canary",
    "CanaryRequest",
    "Decision",
    "Reply",
    "State",
    "current_request",
]

log = logging.getLogger("ratequeue.canary")
log.addHandler(logging.NullHandler())

Arm = Literal["stable", "candidate"]
State = Literal["running", "rolled_back", "complete"]
Action = Literal["advance", "complete", "rollback", "hold"]

_CURRENT: contextvars.ContextVar[CanaryRequest | None] = contextvars.ContextVar(
    "ratequeue_canary_request", default=None
)

# Local refusals of a limiter or pool: the request was rate limited, not broken.
_RATE_LIMITED = (Overloaded, WaitTimeout)


#: The largest token or call count booked (2**53: exact as a float in the histograms).
MAX_COUNT = 1 << 53


def _count(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}={v!r} must be an int")
    if not 0 <= v <= MAX_COUNT:
        raise ValueError(f"{name}={v!r} must be >= 0 and <= 2**53")
    return v


@dataclass(frozen=True)
class Reply:
    """What an arm may return: the answer plus what it cost (tokens, upstream calls).

    ``status`` is the upstream HTTP status when there is one (429 counts as rate
    limited, 5xx as an error), ``retry_after`` its ``Retry-After``.
    :meth:`Canary.call` returns ``value`` to the caller.
    """

    value: Any
    tokens: int = 0
    calls: int = 1
    status: int | None = None
    retry_after: float | str | None = None

    def __post_init__(self) -> None:
        _count("tokens", self.tokens)
        _count("calls", self.calls)


def _default_usage(result: Any) -> int:
    """Total tokens from an OpenAI/Anthropic-style ``usage`` (mapping or attribute)."""
    usage = result.get("usage") if isinstance(result, Mapping) else getattr(result, "usage", None)
    if usage is None:
        return 0
    if isinstance(usage, Mapping):
        get = usage.get
    else:

        def get(k: str, default: Any = None) -> Any:
            return getattr(usage, k, default)

    total = get("total_tokens")
    if total is None:
        parts = [get(k) for k in ("input_tokens", "output_tokens", "prompt_tokens")]
        parts.append(get("completion_tokens"))
        total = sum(
            p for p in parts if isinstance(p, int) and not isinstance(p, bool) and p <= MAX_COUNT
        )
    if isinstance(total, bool) or not isinstance(total, int) or not 0 <= total <= MAX_COUNT:
        return 0  # an answer's claim we cannot book: no tokens rather than an error
    return total


@dataclass(frozen=True)
class Decision:
    """One decision of the rollout with its evidence (every gate's verdict)."""

    at: float
    action: Action
    stage: int
    fraction_before: float
    fraction_after: float
    reason: str
    evidence: tuple[GateResult, ...] = ()
    kpis: dict[str, ArmKPIs] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """As plain values (for logs and JSON)."""
        return {
            "at": self.at,
            "action": self.action,
            "stage": self.stage,
            "fraction_before": self.fraction_before,
            "fraction_after": self.fraction_after,
            "reason": self.reason,
            "evidence": [g.to_dict() for g in self.evidence],
            "kpis": {k: v.to_dict() for k, v in self.kpis.items()},
        }


class CanaryRequest:
    """One user request on one arm: book its upstream calls, then finish it once.

    A context manager: inside, transports and pool arms that see it (a context
    variable) book their calls onto it; on exit it is finished, as an error if an
    exception escaped (a limiter's refusal counts as rate limited, not as an error).
    """

    __slots__ = (
        "_canary",
        "_once",
        "_token",
        "arm",
        "calls",
        "error",
        "key",
        "rate_limited",
        "shadow",
        "started",
        "tokens",
        "valid",
    )

    def __init__(self, canary: Canary, key: object, arm: Arm, shadow: bool = False) -> None:
        self._canary = canary
        self.key = key
        self.arm: Arm = arm
        self.shadow = shadow
        self.started = canary.clock.now()
        self.tokens = 0
        self.calls = 0
        self.rate_limited = 0
        self.error = False
        self.valid: bool | None = None
        self._once = threading.Lock()  # held once finished: finishing is atomic
        self._token: contextvars.Token[CanaryRequest | None] | None = None

    @property
    def canary(self) -> Canary:
        return self._canary

    def call(
        self, tokens: int = 0, *, status: int | None = None, rate_limited: bool = False
    ) -> None:
        """Book one upstream call: its tokens; a 429 (or ``rate_limited``) counts as rate
        limited, a 5xx marks the request as an error."""
        self.tokens += _count("tokens", tokens)
        self.calls += 1
        if rate_limited or status == 429:
            self.rate_limited += 1
        elif status is not None and status >= 500:
            self.error = True

    def finish(self, *, valid: bool | None = None, error: bool = False) -> bool:
        """Book the request on its arm (once; False if it was already finished)."""
        if not self._once.acquire(blocking=False):
            return False
        if error:
            self.error = True
        if valid is not None:
            self.valid = valid
        self._canary._finish(self)
        return True

    def __enter__(self) -> CanaryRequest:
        self._token = _CURRENT.set(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is not None:
            _CURRENT.reset(self._token)
            self._token = None
        if exc is None:
            self.finish()
        elif isinstance(exc, _RATE_LIMITED):
            if self.rate_limited == 0:
                self.call(rate_limited=True)
            self.finish(valid=False)
        elif isinstance(exc, Exception):
            self.finish(error=True)
        # KeyboardInterrupt, CancelledError: the request was abandoned, not measured.

    def __repr__(self) -> str:
        return f"CanaryRequest(arm={self.arm!r}, shadow={self.shadow}, calls={self.calls})"


def current_request() -> CanaryRequest | None:
    """The :class:`CanaryRequest` whose ``with`` block the caller is in, if any."""
    return _CURRENT.get()


Hook = Callable[[Decision], object]


class Canary:
    """A staged rollout of ``candidate`` beside ``stable``, rolled back when a gate trips.

    A user (``key``) is routed to the candidate when the stable hash of its key falls
    below the stage's fraction: a user stays on one arm within a stage, and one on the
    candidate stays there as the stages grow. With ``shadow=True`` every answer comes
    from stable and the routed users' requests are also copied to the candidate, off
    the caller's path; the copy's answer is dropped and its usage booked on the
    candidate arm only. The gates are checked at most every ``check_every`` seconds of
    ``clock`` as requests finish (or on :meth:`evaluate`): any ``rollback`` verdict
    routes everyone back to stable at once; after ``min_stage_time`` in a stage with
    every gate passing, the rollout advances. Arms are callables (sync or async) taking
    the request; they may return a :class:`Reply` to state tokens and calls.

    ``valid(answer)`` says whether an answer counts (default: every answer that did not
    raise); ``usage(answer)`` gives its tokens when it is not a :class:`Reply` (default:
    an OpenAI/Anthropic ``usage``). ``salt`` seeds the user hash (same salt, same
    routing in every process). Shadow copies run on at most ``shadow_workers`` threads
    (or as tasks in an event loop), at most ``max_shadow`` at once (more are dropped and
    counted in ``shadow_dropped``); one slower than ``shadow_timeout`` is booked as an
    error (cancelled, in an event loop). ``max_log`` bounds the decision log (all
    decisions are counted in ``decision_counts``); ``name`` labels logs and metrics.
    """

    def __init__(
        self,
        stable: Callable[[Any], Any],
        candidate: Callable[[Any], Any],
        *,
        stages: Iterable[float] = (0.01, 0.05, 0.2, 0.5, 1.0),
        min_stage_time: float = 1800.0,
        shadow: bool = False,
        gates: Iterable[Gate] | None = None,
        valid: Callable[[Any], bool] | None = None,
        usage: Callable[[Any], int] | None = None,
        clock: Any = None,
        check_every: float = 1.0,
        on_advance: Hook | None = None,
        on_rollback: Hook | None = None,
        salt: str = "ratequeue-canary",
        name: str = "canary",
        max_log: int = 1000,
        shadow_workers: int = 4,
        max_shadow: int = 64,
        shadow_timeout: float | None = None,
    ) -> None:
        if not callable(stable) or not callable(candidate):
            raise TypeError("stable and candidate must be callables taking the request")
        fractions = tuple(stages)
        if not fractions:
            raise ValueError("stages: give at least one fraction")
        prev = 0.0
        for f in fractions:
            if isinstance(f, bool) or not isinstance(f, numbers.Real):
                raise TypeError(f"stages must be numbers, got {f!r}")
            if not (prev < f <= 1.0):
                raise ValueError(f"stages must increase within (0, 1], got {fractions}")
            prev = float(f)
        for label, v in (("min_stage_time", min_stage_time), ("check_every", check_every)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"{label}={v!r} must be a number of seconds")
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{label}={v!r} must be finite and >= 0")
        if shadow_timeout is not None and not (
            isinstance(shadow_timeout, numbers.Real) and shadow_timeout > 0
        ):
            raise ValueError(f"shadow_timeout={shadow_timeout!r} must be > 0 seconds or None")
        for label, n in (
            ("max_log", max_log),
            ("shadow_workers", shadow_workers),
            ("max_shadow", max_shadow),
        ):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{label}={n!r} must be an integer >= 1")
        if not isinstance(salt, str):
            raise TypeError(f"salt={salt!r} must be a str")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r} must be a non-empty str")
        self.name = name
        self.gates: tuple[Gate, ...] = DEFAULT_GATES if gates is None else tuple(gates)
        for g in self.gates:
            if not isinstance(g, Gate):
                raise TypeError(f"gates must be Gate objects, got {g!r}")
        self._stable = stable
        self._candidate = candidate
        self.stages: tuple[float, ...] = tuple(float(f) for f in fractions)
        self.min_stage_time = float(min_stage_time)
        self.check_every = float(check_every)
        self.shadow = bool(shadow)
        self.shadow_timeout = None if shadow_timeout is None else float(shadow_timeout)
        self._valid = valid
        self._usage = usage or _default_usage
        self.clock = MonotonicClock() if clock is None else clock
        self._on_advance = on_advance
        self._on_rollback = on_rollback
        self._hasher = hashlib.blake2b(salt.encode() + b"\x00", digest_size=8)
        self._arms = {"stable": ArmStats("stable"), "candidate": ArmStats("candidate")}
        self._lock = fork_safe_lock(self)  # the rollout state; never held while calling out
        self._stage = 0
        self._state: State = "running"
        self._fraction = self.stages[0]
        self._stage_started = self.clock.now()
        self._last_check = -math.inf
        self._last_hold = ""
        self._log: collections.deque[Decision] = collections.deque(maxlen=max_log)
        self._runner = ShadowRunner(shadow_workers, max_shadow)
        self._max_shadow = max_shadow
        self._tasks: set[asyncio.Task[None]] = set()
        self.shadow_dropped = 0
        self.decision_counts: collections.Counter[str] = collections.Counter()

    # -- routing -------------------------------------------------------------------------

    def bucket(self, key: object) -> float:
        """The user's place in [0, 1): a stable hash of its key (str, bytes or int)."""
        if isinstance(key, str):
            data = key.encode()
        elif isinstance(key, (bytes, bytearray, memoryview)):
            data = bytes(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            data = b"\x01" + str(key).encode()
        else:
            raise TypeError(f"a user key must be str, bytes or int, got {type(key).__name__}")
        h = self._hasher.copy()
        h.update(data)
        return int.from_bytes(h.digest(), "big") / 18446744073709551616.0

    def arm_for(self, key: object) -> Arm:
        """The arm whose answer this user gets now."""
        if self.shadow:
            self.bucket(key)
            return "stable"
        return "candidate" if self.bucket(key) < self._fraction else "stable"

    def shadowed(self, key: object) -> bool:
        """True when this user's requests are copied to the candidate now (shadow mode)."""
        return self.shadow and self._state == "running" and self.bucket(key) < self._fraction

    def _route(self, key: object) -> tuple[Arm, bool]:
        """(the arm answering, whether a copy goes to the candidate), hashing once."""
        inside = self.bucket(key) < self._fraction
        if self.shadow:
            return "stable", inside and self._state == "running"
        return ("candidate" if inside else "stable"), False

    def request(self, key: object, *, arm: Arm | None = None) -> CanaryRequest:
        """A :class:`CanaryRequest` for this user on its arm (or on ``arm``)."""
        if arm is None:
            arm = self.arm_for(key)
        elif arm not in ("stable", "candidate"):
            raise ValueError(f"arm={arm!r} must be 'stable' or 'candidate'")
        return CanaryRequest(self, key, arm)

    # -- calling the arms ----------------------------------------------------------------

    def _book(self, req: CanaryRequest, result: Any, calls_before: int) -> Any:
        if isinstance(result, Reply):
            value = result.value
            req.tokens += result.tokens
            req.calls += result.calls
            if result.status == 429:
                req.rate_limited += 1
            elif result.status is not None and result.status >= 500:
                req.error = True
        else:
            value = result
            if req.calls == calls_before:  # nothing booked by a transport inside
                req.call(self._usage(result))
        if req.valid is None:
            req.valid = bool(self._valid(value)) if self._valid is not None else True
        return value

    def call(self, key: object, request: Any) -> Any:
        """Send ``request`` for user ``key`` to its arm and return the answer.

        In shadow mode the candidate gets a copy on a background thread; neither its
        answer nor its errors nor its time ever reach the caller.
        """
        arm, copy = self._route(key)
        req = CanaryRequest(self, key, arm)
        if copy:
            self._shadow_sync(key, request)
        fn = self._stable if req.arm == "stable" else self._candidate
        with req:
            result = fn(request)
            if inspect.isawaitable(result):
                close = getattr(result, "close", None)
                if close is not None:
                    close()
                raise TypeError("this arm is async: use await canary.call_async(...)")
            return self._book(req, result, 0)

    async def call_async(self, key: object, request: Any) -> Any:
        """The asyncio form of :meth:`call` (a shadow copy runs as its own task)."""
        arm, copy = self._route(key)
        req = CanaryRequest(self, key, arm)
        if copy:
            self._shadow_async(key, request)
        fn = self._stable if req.arm == "stable" else self._candidate
        with req:
            result = fn(request)
            if inspect.isawaitable(result):
                result = await result
            return self._book(req, result, 0)

    # -- shadow --------------------------------------------------------------------------

    def _drop_shadow(self) -> None:
        with self._lock:
            self.shadow_dropped += 1

    def _run_shadow(self, key: object, request: Any) -> None:
        req = CanaryRequest(self, key, "candidate", shadow=True)
        try:
            with req:
                result = self._candidate(request)
                if inspect.isawaitable(result):
                    result = asyncio.run(_awaited(result, self.shadow_timeout))
                self._book(req, result, 0)
                if self.shadow_timeout is not None and (
                    self.clock.now() - req.started > self.shadow_timeout
                ):
                    req.error = True
        except Exception:
            pass  # booked as an error on the candidate arm; never the caller's concern

    def _shadow_sync(self, key: object, request: Any) -> None:
        if not self._runner.submit(lambda: self._run_shadow(key, request)):
            self._drop_shadow()

    def _shadow_async(self, key: object, request: Any) -> None:
        if not _is_async(self._candidate):
            self._shadow_sync(key, request)  # a sync candidate never runs on the loop
            return
        if len(self._tasks) >= self._max_shadow:
            self._drop_shadow()
            return
        task = asyncio.get_running_loop().create_task(self._run_shadow_async(key, request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_shadow_async(self, key: object, request: Any) -> None:
        req = CanaryRequest(self, key, "candidate", shadow=True)
        try:
            with req:
                result = await _awaited(self._candidate(request), self.shadow_timeout)
                self._book(req, result, 0)
        except Exception:
            pass  # booked as an error on the candidate arm

    # -- measuring and deciding ----------------------------------------------------------

    def _finish(self, req: CanaryRequest) -> None:
        now = self.clock.now()
        valid = bool(req.valid) if req.valid is not None else not req.error
        if req.calls and req.rate_limited >= req.calls:
            valid = False  # every call was refused: no answer
        self._arms[req.arm].record(
            latency=now - req.started,
            tokens=req.tokens,
            calls=req.calls,
            rate_limited=req.rate_limited,
            error=req.error,
            valid=valid,
        )
        if now - self._last_check >= self.check_every:
            self._evaluate(now, blocking=False)

    def kpis(self) -> dict[str, ArmKPIs]:
        """Both arms' KPIs now (in shadow mode the candidate's are the shadow copies')."""
        return {name: s.snapshot() for name, s in self._arms.items()}

    def check(self) -> tuple[GateResult, ...]:
        """Every gate's verdict now, without acting on it."""
        s, c = self._arms["stable"], self._arms["candidate"]
        return tuple(g.check(s, c) for g in self.gates)

    def evaluate(self) -> Decision | None:
        """Check the gates now and act: roll back, advance, or hold (None: nothing to do)."""
        return self._evaluate(self.clock.now(), blocking=True)

    def _evaluate(self, now: float, *, blocking: bool) -> Decision | None:
        if not self._lock.acquire(blocking=blocking):
            return None  # another thread is deciding
        try:
            self._last_check = now
            if self._state != "running":
                return None
            evidence = self.check()
            before = self._fraction
            bad = [g for g in evidence if g.verdict == "rollback"]
            action: Action
            if bad:
                action = "rollback"
                reason = "; ".join(f"{g.kpi}: {g.reason}" for g in bad)
                self._state = "rolled_back"
                self._fraction = 0.0
            elif now - self._stage_started < self.min_stage_time:
                return None
            elif all(g.verdict == "pass" for g in evidence):
                if self._stage + 1 < len(self.stages):
                    action = "advance"
                    self._stage += 1
                    self._fraction = self.stages[self._stage]
                    self._stage_started = now
                    reason = f"every gate passed at {before:.4g} for >= {self.min_stage_time:g} s"
                else:
                    action = "complete"
                    self._state = "complete"
                    reason = f"every gate passed at the last stage ({before:.4g})"
            else:
                action = "hold"
                waiting = [g for g in evidence if g.verdict != "pass"]
                reason = "; ".join(f"{g.kpi}: {g.reason}" for g in waiting)
                # Log a hold when what it waits for changes, not at every check.
                why = ",".join(f"{g.kpi}:{g.reason.split()[0]}" for g in waiting)
                if why == self._last_hold:
                    return None
                self._last_hold = why
            decision = Decision(
                at=now,
                action=action,
                stage=self._stage,
                fraction_before=before,
                fraction_after=self._fraction,
                reason=reason,
                evidence=evidence,
                kpis=self.kpis(),
            )
            self._log.append(decision)
            self.decision_counts[action] += 1
        finally:
            self._lock.release()
        self._announce(decision)
        return decision

    def _announce(self, d: Decision) -> None:
        if d.action == "rollback":
            log.warning("canary rolled back at %.4g: %s", d.fraction_before, d.reason)
            hook = self._on_rollback
        elif d.action == "hold":
            log.info("canary holds at %.4g: %s", d.fraction_before, d.reason)
            return
        else:
            log.info(
                "canary %s %.4g -> %.4g: %s",
                d.action,
                d.fraction_before,
                d.fraction_after,
                d.reason,
            )
            hook = self._on_advance
        if hook is not None:
            try:
                hook(d)
            except Exception:
                log.exception("canary %s hook failed", d.action)

    def rollback(self, reason: str = "manual") -> Decision | None:
        """Route everyone to stable now (None if the rollout already ended)."""
        now = self.clock.now()
        with self._lock:
            if self._state != "running":
                return None
            before = self._fraction
            self._state = "rolled_back"
            self._fraction = 0.0
            d = Decision(
                now, "rollback", self._stage, before, 0.0, reason, self.check(), self.kpis()
            )
            self._log.append(d)
            self.decision_counts["rollback"] += 1
        self._announce(d)
        return d

    # -- state ---------------------------------------------------------------------------

    @property
    def state(self) -> State:
        """``running``, ``rolled_back`` or ``complete``."""
        return self._state

    @property
    def stage(self) -> int:
        """Index of the current stage in :attr:`stages`."""
        return self._stage

    @property
    def fraction(self) -> float:
        """The share of users on (or shadowed to) the candidate now."""
        return self._fraction

    @property
    def decisions(self) -> list[Decision]:
        """The decision log, oldest first (the last ``max_log``)."""
        with self._lock:
            return list(self._log)

    def __repr__(self) -> str:
        mode = ", shadow" if self.shadow else ""
        return (
            f"Canary({self.name!r}, {self._state}, stage {self._stage} "
            f"at {self._fraction:.4g}{mode})"
        )


def _is_async(fn: Callable[..., Any]) -> bool:
    """True for an async function, an object with an async ``__call__`` or one that says
    ``is_async`` (a :class:`PoolArm` over an async ``send``)."""
    return bool(
        inspect.iscoroutinefunction(fn)
        or inspect.iscoroutinefunction(getattr(type(fn), "__call__", None))  # noqa: B004
        or getattr(fn, "is_async", False)
    )


async def _awaited(aw: Awaitable[Any], timeout: float | None) -> Any:
    return await within(aw, timeout)
