"""Service ("generation") time distributions: how long the provider takes to answer.

The provider serves requests in parallel (an LLM API generates many answers at once),
so the service time adds to each request's latency but does not hold the queue: the
queue is the rate limit's. Samples come from a seeded :class:`random.Random`.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass

__all__ = ["Constant", "Exponential", "LogNormal", "ServiceTime", "parse_service"]


class ServiceTime(ABC):
    """A distribution of service times in seconds."""

    @abstractmethod
    def sample(self, rng: random.Random) -> float: ...

    @property
    @abstractmethod
    def mean(self) -> float: ...

    @property
    @abstractmethod
    def label(self) -> str: ...


def _positive(name: str, v: float) -> None:
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {v!r}")


@dataclass(frozen=True)
class Constant(ServiceTime):
    """Always ``seconds``."""

    seconds: float = 1.0

    def __post_init__(self) -> None:
        _positive("seconds", self.seconds)

    def sample(self, rng: random.Random) -> float:
        return self.seconds

    @property
    def mean(self) -> float:
        return self.seconds

    @property
    def label(self) -> str:
        return f"constant {self.seconds:g} s"


@dataclass(frozen=True)
class Exponential(ServiceTime):
    """Exponential with the given mean (seconds)."""

    mean_seconds: float = 1.0

    def __post_init__(self) -> None:
        _positive("mean_seconds", self.mean_seconds)

    def sample(self, rng: random.Random) -> float:
        return rng.expovariate(1.0 / self.mean_seconds) if self.mean_seconds > 0 else 0.0

    @property
    def mean(self) -> float:
        return self.mean_seconds

    @property
    def label(self) -> str:
        return f"exponential, mean {self.mean_seconds:g} s"


@dataclass(frozen=True)
class LogNormal(ServiceTime):
    """Log-normal with the given mean (seconds) and ``sigma`` (of the logarithm): the
    usual shape of LLM generation times, a long right tail."""

    mean_seconds: float = 2.0
    sigma: float = 0.5

    def __post_init__(self) -> None:
        _positive("mean_seconds", self.mean_seconds)
        _positive("sigma", self.sigma)

    def sample(self, rng: random.Random) -> float:
        if self.mean_seconds <= 0:
            return 0.0
        mu = math.log(self.mean_seconds) - self.sigma**2 / 2.0
        return rng.lognormvariate(mu, self.sigma)

    @property
    def mean(self) -> float:
        return self.mean_seconds

    @property
    def label(self) -> str:
        return f"log-normal, mean {self.mean_seconds:g} s, sigma {self.sigma:g}"


def parse_service(spec: str) -> ServiceTime:
    """``constant:S``, ``exponential:MEAN`` (or ``exp``), ``lognormal:MEAN[:SIGMA]``."""
    if not isinstance(spec, str):
        raise TypeError(f"spec={spec!r} must be a string")
    kind, _, rest = spec.partition(":")
    kind = kind.strip().lower()
    args = [float(a) for a in rest.split(":") if a] if rest else []
    if kind in ("constant", "const"):
        return Constant(*args[:1])
    if kind in ("exponential", "exp"):
        return Exponential(*args[:1])
    if kind in ("lognormal", "lognorm"):
        return LogNormal(*args[:2])
    raise ValueError(f"unknown service time distribution {spec!r}")
