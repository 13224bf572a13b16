"""The circuit breaker that spares a dead or slow Redis a call per decision."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from .._threads import fork_safe_lock

log = logging.getLogger("ratequeue.redis")


class CircuitBreaker:
    """Stops calling Redis after a failure, for ``retry_interval`` seconds.

    States: ``closed`` (calls go to Redis), ``open`` (calls take the failure path at
    once) and ``half-open`` (one call probes Redis; the others still take the failure
    path). A success closes it, a failure opens it again. Share one breaker between
    limiters that use the same server so that they learn of an outage together.
    """

    def __init__(self, retry_interval: float = 1.0) -> None:
        if not (retry_interval >= 0 and math.isfinite(retry_interval)):
            raise ValueError(f"retry_interval={retry_interval!r} must be >= 0 seconds")
        self.retry_interval = float(retry_interval)
        self._lock = fork_safe_lock(self)
        self._open_until: float | None = None
        self._probing = False
        self.failures = 0
        self.opened = 0
        self.last_error: BaseException | None = None

    @property
    def state(self) -> str:
        """``closed``, ``open`` or ``half-open``."""
        if self._open_until is None:
            return "closed"
        return "half-open" if self._probing else "open"

    def retry_after(self) -> float:
        """Seconds until a call may probe Redis again (0.0 when closed)."""
        until = self._open_until
        return 0.0 if until is None else max(0.0, until - time.monotonic())

    def _allow(self) -> bool:
        """True when this call may use Redis (when open: true for one probe per interval)."""
        if self._open_until is None:
            return True
        now = time.monotonic()
        with self._lock:
            until = self._open_until
            if until is None:
                return True
            if now >= until and not self._probing:
                self._probing = True
                return True
            return False

    def _success(self) -> None:
        if self._open_until is None:
            return
        with self._lock:
            if self._open_until is not None:
                self._open_until = None
                self._probing = False
                log.warning("ratequeue: Redis is reachable again; circuit closed")

    def _failure(self, exc: BaseException) -> None:
        with self._lock:
            self.failures += 1
            self.last_error = exc
            if self._open_until is None:
                self.opened += 1
                log.warning(
                    "ratequeue: Redis failed (%s: %s); circuit open, next try in %.3g s",
                    type(exc).__name__,
                    exc,
                    self.retry_interval,
                )
            self._open_until = time.monotonic() + self.retry_interval
            self._probing = False

    def _abandon(self) -> None:
        """A probe ended without an answer (cancelled): let another call probe."""
        with self._lock:
            self._probing = False

    def stats(self) -> dict[str, Any]:
        """State, failures seen and times opened."""
        return {"state": self.state, "failures": self.failures, "opened": self.opened}
