"""Deprecated: moved to :mod:`ratequeue.cli.loadtest` (this path goes in the next release)."""

from ._moved import forward as _forward

__all__ = ["LevelReport", "LoadTestConfig", "format_results", "main", "run_loadtest"]  # noqa: F822 (served by __getattr__)
__getattr__ = _forward(__name__, "ratequeue.cli.loadtest")
