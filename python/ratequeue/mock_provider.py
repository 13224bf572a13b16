"""Deprecated: moved to :mod:`ratequeue.testing` (this path goes in the next release)."""

from ._moved import forward as _forward

__all__ = ["COMPLETION_PATHS", "MockProvider", "default_burst", "serve"]  # noqa: F822 (served by __getattr__)
__getattr__ = _forward(
    __name__,
    "ratequeue.testing",
    "ratequeue.testing._mock_provider",
    {"serve": "python -m ratequeue mock-provider"},
)
