"""Adaptive limits: a Limiter's rate or a Concurrency's limit driven by backend load.

``Adaptive(level, controller=...)`` steps once per interval: latency samples, drops and
backend gauges (pushed, or scraped from a Prometheus endpoint) go to a controller --
:class:`AIMD`, :class:`Vegas`, :class:`Gradient2` or the :class:`QueueDepth` policy
(scale out at 50 %, queue at 80 %, shed the lowest class only after) -- and the limit
it returns is applied at run time. The Prometheus collector is in
:mod:`ratequeue.adaptive.metrics` (optional ``prometheus_client``).
"""

from __future__ import annotations

from ._adaptive import Adaptive, Change
from ._window import Window
from .controllers import AIMD, Controller, Decision, Gradient2, QueueDepth, ScaleOut, Vegas
from .signals import PrometheusGauges, PrometheusText, Sample, parse_prometheus_text

__all__ = [
    "AIMD",
    "Adaptive",
    "Change",
    "Controller",
    "Decision",
    "Gradient2",
    "PrometheusGauges",
    "PrometheusText",
    "QueueDepth",
    "Sample",
    "ScaleOut",
    "Vegas",
    "Window",
    "parse_prometheus_text",
]
