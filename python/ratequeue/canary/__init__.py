"""Canary rollouts: a candidate beside stable, staged by user, rolled back by KPI gates.

:class:`Canary` routes each user request to the stable or the candidate arm by a
stable hash of the user key (or, in shadow mode, copies it to the candidate), measures
per arm the rate-limited share, error share, latency p50/p99, tokens per valid answer
and calls per request, and advances through the stages or rolls back by the
:class:`Gate` verdicts. :class:`PoolArm` makes an arm of a :class:`~ratequeue.Pool`;
:mod:`ratequeue.canary.transport` routes httpx requests (needs httpx);
:mod:`ratequeue.canary.metrics` exports to Prometheus (needs prometheus_client).
"""

from __future__ import annotations

from ._canary import Arm, Canary, CanaryRequest, Decision, Reply, State, current_request
from ._gates import DEFAULT_GATES, KPIS, Gate, GateResult
from ._kpi import ArmKPIs
from ._pool import PoolArm
from ._stats import Estimate

__all__ = [
    "DEFAULT_GATES",
    "KPIS",
    "Arm",
    "ArmKPIs",
    "Canary",
    "CanaryRequest",
    "Decision",
    "Estimate",
    "Gate",
    "GateResult",
    "PoolArm",
    "Reply",
    "State",
    "current_request",
]
