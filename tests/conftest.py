"""Shared test settings: hypothesis profiles and a manual clock fixture.

Profiles: "dev" (the default, quick) and "ci" (more examples), chosen by CI=true in the
environment; HYPOTHESIS_PROFILE=<name> overrides both.
"""

from __future__ import annotations

import os

import pytest
import ratequeue as rq
from hypothesis import HealthCheck, settings

settings.register_profile(
    "dev",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    max_examples=600,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
_default = "ci" if os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"} else "dev"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", _default))


@pytest.fixture
def clock() -> rq.ManualClock:
    """A manual clock at 0 s; timing tests never sleep."""
    return rq.ManualClock()
