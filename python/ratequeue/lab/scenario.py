"""Scenarios: one provider limit, a list of load levels, strategies side by side.

For each load level rho the same arrivals (rate ``rho * rpm/60``, open loop) and the
same service times are fed to every strategy, each in its own virtual-time run through
the real limiter, queue and pool code. Optionally a burst of N requests at once is run
through every strategy too. Everything is deterministic for a seed.
"""

from __future__ import annotations

import math
import numbers
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any

from .arrivals import Arrivals, Burst, Poisson, Replay
from .progress import Progress
from .results import Request, Row, Workload
from .service import LogNormal, ServiceTime
from .strategies import ProviderLimit, Strategy, default_strategies
from .theory import md1_mean_wait, md1_wait_quantile, mm1_mean_wait, mm1_wait_quantile

__all__ = [
    "DEFAULT_RHOS",
    "LabReport",
    "LevelResult",
    "Scenario",
    "make_workload",
    "replays_as_recorded",
    "run_burst",
    "run_level",
    "run_recorded",
    "run_scenario",
    "theory_at",
]

DEFAULT_RHOS: tuple[float, ...] = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98)


@dataclass(frozen=True)
class Scenario:
    """What to simulate. ``requests`` is the expected number of arrivals per load level
    (the level lasts ``requests / rate`` simulated seconds); the first ``warmup`` share
    of each level is simulated but not measured."""

    name: str = "demo"
    limit: ProviderLimit = field(default_factory=ProviderLimit)
    rhos: tuple[float, ...] = DEFAULT_RHOS
    requests: int = 20_000
    arrivals: Arrivals = field(default_factory=Poisson)
    service: ServiceTime = field(default_factory=LogNormal)
    interactive_share: float = 0.2
    strategies: tuple[Strategy, ...] = field(default_factory=default_strategies)
    burst: int = 500
    warmup: float = 0.05
    seed: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.rhos, (str, bytes)) or not isinstance(self.rhos, Sequence):
            raise TypeError(f"rhos={self.rhos!r} must be a sequence of load levels")
        for rho in self.rhos:
            if isinstance(rho, bool) or not isinstance(rho, numbers.Real) or not math.isfinite(rho):
                raise ValueError(f"rhos: load levels must be finite numbers > 0, got {rho!r}")
        for name in ("requests", "burst"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"{name}={v!r} must be an integer")
        for name in ("warmup", "interactive_share"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"{name}={v!r} must be a number")
        if self.burst < 0:
            raise ValueError(f"burst={self.burst!r} must be >= 0 (0: no burst run)")
        if not self.rhos and not self.burst:
            raise ValueError("nothing to run: give load levels (rhos) or a burst")
        for rho in self.rhos:
            if not rho > 0.0:
                raise ValueError(f"load levels must be > 0, got {rho!r}")
        if self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests!r}")
        if not (0.0 <= self.warmup < 1.0):
            raise ValueError(f"warmup must be in [0, 1), got {self.warmup!r}")
        if not (0.0 <= self.interactive_share <= 1.0):
            raise ValueError(f"interactive_share must be in [0, 1], got {self.interactive_share!r}")
        if not self.strategies:
            raise ValueError("give at least one strategy")

    def describe(self) -> dict[str, Any]:
        """The scenario as plain data (for JSON output)."""

        def plain(x: object) -> Any:
            if is_dataclass(x) and not isinstance(x, type):
                d = {k: plain(v) for k, v in asdict(x).items()}
                d["type"] = type(x).__name__
                return d
            if isinstance(x, (list, tuple)):
                return [plain(v) for v in x]
            return x

        return {
            "name": self.name,
            "rpm": self.limit.rpm,
            "burst_capacity": self.limit.burst,
            "rhos": list(self.rhos),
            "requests_per_level": self.requests,
            "arrivals": self.arrivals.label,
            "service": self.service.label,
            "interactive_share": self.interactive_share,
            "strategies": [{"key": s.key, "label": s.label, **plain(s)} for s in self.strategies],
            "burst_requests": self.burst,
            "warmup": self.warmup,
            "seed": self.seed,
        }


def make_workload(
    scenario: Scenario, arrivals: Arrivals, rate: float, duration: float, tag: str
) -> Workload:
    """The arrivals, service times and classes of one run (seeded by scenario and tag)."""
    times = arrivals.times(rate, duration, random.Random(f"{scenario.seed}/{tag}/arrivals"))
    svc_rng = random.Random(f"{scenario.seed}/{tag}/service")
    cls_rng = random.Random(f"{scenario.seed}/{tag}/class")
    share = scenario.interactive_share
    requests = tuple(
        Request(
            i,
            t,
            scenario.service.sample(svc_rng),
            "interactive" if cls_rng.random() < share else "batch",
        )
        for i, t in enumerate(times)
    )
    # The span actually covered: a replayed trace may end long before ``duration``.
    span = times[-1] if times else 0.0
    return Workload(requests, rate, span, warmup_until=span * scenario.warmup)


def theory_at(rho: float, limit: ProviderLimit) -> dict[str, float]:
    """Queue-wait predictions (seconds) at utilisation ``rho``, for Poisson arrivals.

    ``mm1_*``: the textbook M/M/1; ``md1_*``: M/D/1 (a bucket of burst 1);
    ``bucket_*``: exact for the limit's bucket, M/D/1 shifted down by ``(burst-1)/mu``
    (the same as ``md1_*`` when the burst is 1; see :mod:`.theory`). Keys end in
    ``_p50``, ``_p95``, ``_p99`` and ``_mean``. NaN at rho >= 1 (no steady state).
    """
    mu = limit.mu
    models = ("mm1", "md1", "bucket")
    out: dict[str, float] = {}
    if rho >= 1.0:
        return {f"{m}_{k}": float("nan") for m in models for k in ("p50", "p95", "p99", "mean")}
    for q in (50, 95, 99):
        out[f"mm1_p{q}"] = mm1_wait_quantile(rho, mu, q / 100.0)
    out["mm1_mean"] = mm1_mean_wait(rho, mu)
    for q in (50, 95, 99):
        out[f"md1_p{q}"] = md1_wait_quantile(rho, mu, q / 100.0)
    out["md1_mean"] = md1_mean_wait(rho, mu)
    for q in (50, 95, 99):
        out[f"bucket_p{q}"] = (
            out[f"md1_p{q}"]
            if limit.burst == 1
            else md1_wait_quantile(rho, mu, q / 100.0, burst=limit.burst)
        )
    out["bucket_mean"] = (
        out["md1_mean"] if limit.burst == 1 else md1_mean_wait(rho, mu, burst=limit.burst)
    )
    return out


@dataclass
class LevelResult:
    """All strategies at one load level (``rho`` None for the burst run)."""

    title: str
    rho: float | None
    rate: float
    duration: float
    arrivals: int
    measured_from: float
    rows: list[Row]
    info: dict[str, dict[str, Any]]
    theory: dict[str, float]
    elapsed: float
    simulated: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "rho": self.rho,
            "rate_per_s": self.rate,
            "duration_s": self.duration,
            "arrivals": self.arrivals,
            "measured_from_s": self.measured_from,
            "rows": [r.summary() for r in self.rows],
            "theory": self.theory,
            "info": {k: _jsonable(v) for k, v in self.info.items()},
            "elapsed_s": self.elapsed,
            "simulated_s": self.simulated,
        }


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items() if k not in ("calls", "cooldowns")}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and x != x:
        return None
    return x


def _run_strategies(
    scenario: Scenario,
    workload: Workload,
    tag: str,
    progress: Progress | None,
    strategies: Sequence[Strategy],
) -> tuple[list[Row], dict[str, dict[str, Any]], float]:
    rows: list[Row] = []
    info: dict[str, dict[str, Any]] = {}
    simulated = 0.0
    for s in strategies:
        if progress is not None:
            progress.set_label(f"{tag}: {s.label}")
        rng = random.Random(f"{scenario.seed}/{tag}/{s.key}")
        result = s.run(workload, scenario.limit, rng)
        rows.extend(result.rows)
        info[s.key] = result.info
        simulated += workload.duration
        if progress is not None:
            progress.advance(len(workload.requests))
    return rows, info, simulated


def run_level(scenario: Scenario, rho: float, progress: Progress | None = None) -> LevelResult:
    """Every strategy at utilisation ``rho`` (arrival rate ``rho * rpm / 60`` per second)."""
    rate = rho * scenario.limit.mu
    duration = scenario.requests / rate
    tag = f"rho={rho:g}"
    workload = make_workload(scenario, scenario.arrivals, rate, duration, tag)
    start = time.perf_counter()
    rows, info, simulated = _run_strategies(scenario, workload, tag, progress, scenario.strategies)
    return LevelResult(
        title=f"rho = {rho:g}",
        rho=rho,
        rate=rate,
        duration=workload.duration,
        arrivals=len(workload.requests),
        measured_from=workload.warmup_until,
        rows=rows,
        info=info,
        # Queueing theory here assumes Poisson arrivals: shown only where it applies.
        theory=theory_at(rho, scenario.limit) if isinstance(scenario.arrivals, Poisson) else {},
        elapsed=time.perf_counter() - start,
        simulated=simulated,
    )


def replays_as_recorded(scenario: Scenario) -> bool:
    """True when the scenario replays a trace at its own rate (``replay-raw:``): its load
    is the trace's, not a list of levels."""
    return isinstance(scenario.arrivals, Replay) and not scenario.arrivals.scale


def run_recorded(scenario: Scenario, progress: Progress | None = None) -> LevelResult:
    """The first ``scenario.requests`` arrivals of a trace, at the times recorded; the
    level's rate and rho are the trace's own, measured over what was replayed."""
    trace = scenario.arrivals
    assert isinstance(trace, Replay)
    n = min(scenario.requests, len(trace.stamps))
    until = math.nextafter(trace.stamps[n - 1], math.inf)
    workload = make_workload(scenario, trace, 1.0, until, "replay")
    span = workload.duration
    rate = (len(workload.requests) - 1) / span if span > 0 else math.inf
    rho = rate / scenario.limit.mu
    start = time.perf_counter()
    rows, info, simulated = _run_strategies(
        scenario, workload, "replay", progress, scenario.strategies
    )
    return LevelResult(
        title=f"{trace.label} as recorded",
        rho=rho if math.isfinite(rho) else None,
        rate=rate if math.isfinite(rate) else 0.0,
        duration=span,
        arrivals=len(workload.requests),
        measured_from=workload.warmup_until,
        rows=rows,
        info=info,
        theory={},
        elapsed=time.perf_counter() - start,
        simulated=simulated,
    )


def run_burst(scenario: Scenario, progress: Progress | None = None) -> LevelResult:
    """``scenario.burst`` requests at t = 0 through every strategy."""
    n = scenario.burst
    workload = make_workload(scenario, Burst(n), 1.0, 0.0, "burst")
    start = time.perf_counter()
    rows, info, simulated = _run_strategies(
        scenario, workload, "burst", progress, scenario.strategies
    )
    return LevelResult(
        title=f"burst of {n} at once",
        rho=None,
        rate=0.0,
        duration=0.0,
        arrivals=n,
        measured_from=0.0,
        rows=rows,
        info=info,
        theory={},
        elapsed=time.perf_counter() - start,
        simulated=simulated,
    )


@dataclass
class LabReport:
    """The results of a scenario: one :class:`LevelResult` per load level, and the burst."""

    scenario: Scenario
    levels: list[LevelResult]
    burst: LevelResult | None
    elapsed: float

    @property
    def simulated(self) -> float:
        """Simulated seconds, summed over every strategy's runs (the burst's not counted)."""
        return sum(lv.simulated for lv in self.levels)

    def to_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario.describe(),
            "levels": [lv.to_dict() for lv in self.levels],
            "burst": None if self.burst is None else self.burst.to_dict(),
            "elapsed_s": self.elapsed,
            "simulated_s": self.simulated,
        }


def run_scenario(
    scenario: Scenario,
    *,
    progress: bool | None = None,
    on_level: Callable[[LevelResult], None] | None = None,
) -> LabReport:
    """Run every load level and the burst. ``progress``: a bar on stderr (None: only
    when stderr is a terminal). ``on_level`` is called with each level as it ends."""
    per_level = scenario.requests * len(scenario.strategies)
    recorded = replays_as_recorded(scenario)
    n_levels = 1 if recorded else len(scenario.rhos)
    total = per_level * n_levels + scenario.burst * len(scenario.strategies)
    start = time.perf_counter()
    levels: list[LevelResult] = []
    burst: LevelResult | None = None
    with Progress(total, scenario.name, enabled=progress) as bar:
        for rho in [None] if recorded else scenario.rhos:
            level = run_recorded(scenario, bar) if rho is None else run_level(scenario, rho, bar)
            levels.append(level)
            if on_level is not None:
                on_level(level)
        if scenario.burst:
            burst = run_burst(scenario, bar)
            if on_level is not None:
                on_level(burst)
        bar.done = bar.total
    return LabReport(scenario, levels, burst, time.perf_counter() - start)
