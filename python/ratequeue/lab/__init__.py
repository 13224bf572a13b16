"""The queueing lab: open-loop load against rate limits, in virtual time.

Arrival processes (:mod:`.arrivals`), service-time distributions (:mod:`.service`),
client strategies (:mod:`.strategies`) and scenarios (:mod:`.scenario`) run on one
:class:`~ratequeue.ManualClock` through the real limiter, queue and pool code, thousands
of simulated seconds per real second; :mod:`.theory` gives M/M/1 and M/D/1 beside the
measurements; :mod:`.report` prints tables and writes JSON, CSV and a plot.
:mod:`.cluster` is a virtual inference cluster (dynamic batching, KV cache, scale-out)
and :mod:`.launch` the launch-day scenario run against it with adaptive limits;
:mod:`.canary` a canary rollout of a verbose model, rolled back by its KPI gates.

::

    from ratequeue import lab

    report = lab.run_scenario(lab.Scenario(requests=5_000))
    print(lab.format_report(report))
    lab.plot(report, "lab-out/knee.png")      # needs ratequeue[lab] (matplotlib)
"""

from __future__ import annotations

from . import arrivals, canary, launch, service, theory
from .arrivals import Arrivals, Batches, Burst, OnOff, Poisson, Replay, parse_arrivals
from .cluster import ClusterSpec, InferenceCluster, ReplicaSpec
from .engine import Outage, SimProvider, VirtualTime
from .launch import LaunchReport, LaunchScenario, format_launch, plot_launch, run_launch
from .progress import Progress
from .report import format_level, format_report, plot, write_csv, write_json
from .results import Request, Row, StrategyRun, Workload
from .scenario import (
    DEFAULT_RHOS,
    LabReport,
    LevelResult,
    Scenario,
    make_workload,
    run_burst,
    run_level,
    run_scenario,
    theory_at,
)
from .service import Exponential, LogNormal, ServiceTime, parse_service
from .strategies import (
    NaiveRetry,
    PoolStrategy,
    Priority,
    ProviderLimit,
    Queue,
    Strategy,
    default_strategies,
)

__all__ = [
    "DEFAULT_RHOS",
    "Arrivals",
    "Batches",
    "Burst",
    "ClusterSpec",
    "Exponential",
    "InferenceCluster",
    "LabReport",
    "LaunchReport",
    "LaunchScenario",
    "LevelResult",
    "LogNormal",
    "NaiveRetry",
    "OnOff",
    "Outage",
    "Poisson",
    "PoolStrategy",
    "Priority",
    "Progress",
    "ProviderLimit",
    "Queue",
    "Replay",
    "ReplicaSpec",
    "Request",
    "Row",
    "Scenario",
    "ServiceTime",
    "SimProvider",
    "Strategy",
    "StrategyRun",
    "VirtualTime",
    "Workload",
    "arrivals",
    "canary",
    "default_strategies",
    "format_launch",
    "format_level",
    "format_report",
    "launch",
    "make_workload",
    "parse_arrivals",
    "parse_service",
    "plot",
    "plot_launch",
    "run_burst",
    "run_launch",
    "run_level",
    "run_scenario",
    "service",
    "theory",
    "theory_at",
    "write_csv",
    "write_json",
]
