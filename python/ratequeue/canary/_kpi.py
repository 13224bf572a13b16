"""Per-arm measurements: lock-free histograms and a few counters, bounded in memory."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .._ratequeue import Histogram
from .._threads import fork_safe_lock

__all__ = ["ArmKPIs", "ArmStats"]


class ArmStats:
    """What one arm did: counters plus histograms of latency and tokens per answer.

    Histograms record lock-free; the counters and the exact sums behind the means are
    updated under a short lock per arm. Memory is fixed whatever the traffic.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.latency = Histogram()  # seconds per user request
        self.tokens = Histogram()  # tokens per valid answer
        self._lock = fork_safe_lock(self)
        self.requests = 0
        self.valid = 0
        self.invalid = 0
        self.errors = 0
        self.calls = 0
        self.rate_limited = 0
        self.tokens_total = 0
        self.tokens_valid = 0
        self.tokens_valid_sq = 0.0
        self.calls_sq = 0.0

    def record(
        self,
        *,
        latency: float,
        tokens: int,
        calls: int,
        rate_limited: int,
        error: bool,
        valid: bool,
    ) -> None:
        """Book one finished user request."""
        self.latency.record(max(0.0, latency))
        if valid and not error:
            self.tokens.record(float(tokens))
        with self._lock:
            self.requests += 1
            self.calls += calls
            self.calls_sq += float(calls) * calls
            self.rate_limited += rate_limited
            self.tokens_total += tokens
            if error:
                self.errors += 1
            elif valid:
                self.valid += 1
                self.tokens_valid += tokens
                self.tokens_valid_sq += float(tokens) * tokens
            else:
                self.invalid += 1

    def snapshot(self) -> ArmKPIs:
        """The KPIs now."""
        with self._lock:
            counts = (
                self.requests,
                self.valid,
                self.invalid,
                self.errors,
                self.calls,
                self.rate_limited,
                self.tokens_total,
            )
        requests, valid, invalid, errors, calls, rate_limited, tokens_total = counts
        lat50, lat99 = self.latency.percentiles([50, 99]) if requests else (math.nan, math.nan)
        tok50 = self.tokens.percentile(50) if valid else math.nan
        return ArmKPIs(
            arm=self.name,
            requests=requests,
            valid=valid,
            invalid=invalid,
            errors=errors,
            calls=calls,
            rate_limited_calls=rate_limited,
            tokens=tokens_total,
            rate_limited_share=rate_limited / calls if calls else math.nan,
            error_share=errors / requests if requests else math.nan,
            latency_p50=lat50,
            latency_p99=lat99,
            tokens_per_valid_answer=tok50,
            tokens_per_valid_answer_mean=self.tokens_valid / valid if valid else math.nan,
            quota_per_valid_answer=tokens_total / valid if valid else math.nan,
            calls_per_request=calls / requests if requests else math.nan,
        )


@dataclass(frozen=True)
class ArmKPIs:
    """One arm's KPIs at a moment (NaN where nothing was measured yet).

    ``tokens_per_valid_answer`` is the median tokens of a valid answer (all calls of
    the request), ``..._mean`` its mean; ``quota_per_valid_answer`` is every token the
    arm spent (invalid answers included) over the valid answers.
    """

    arm: str
    requests: int
    valid: int
    invalid: int
    errors: int
    calls: int
    rate_limited_calls: int
    tokens: int
    rate_limited_share: float
    error_share: float
    latency_p50: float
    latency_p99: float
    tokens_per_valid_answer: float
    tokens_per_valid_answer_mean: float
    quota_per_valid_answer: float
    calls_per_request: float

    def to_dict(self) -> dict[str, Any]:
        """As plain values (NaN as None)."""
        return {
            k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in self.__dict__.items()
        }
