"""Deprecated: moved to :mod:`ratequeue.cli.demo` (this path goes in the next release)."""

from ._moved import forward as _forward

__all__ = ["BurstResult", "burst", "lab_demo", "run"]  # noqa: F822 (served by __getattr__)
__getattr__ = _forward(__name__, "ratequeue.cli.demo")
