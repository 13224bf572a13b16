"""Helpers for testing code that uses ratequeue: virtual time and a mock provider.

- :class:`ManualClock`: a clock that moves only when told, for limiters whose timing a
  test decides (``rq.Limiter(..., clock=clock)``; ``clock.advance(1.5)``).
- :class:`MockProvider`: an LLM provider on the loopback interface that enforces its own
  RPM/TPM limit with 429 and ``Retry-After``, in OpenAI, Anthropic or IETF dialect.
"""

from .._ratequeue import ManualClock
from ._mock_provider import COMPLETION_PATHS, MAX_BODY, MockProvider, default_burst

__all__ = ["COMPLETION_PATHS", "MAX_BODY", "ManualClock", "MockProvider", "default_burst"]
