"""pytest settings for the benches in this folder (bench_*.py, run with --benchmark-only).

The test suite never collects this folder (pyproject's testpaths is ``tests``; bench files
are named ``bench_*.py``, not ``test_*.py``): benches run only when named explicitly.

pytest-benchmark calibrates each bench from its very first timed calls. On a shared
2-core VM one slow first call (a page fault, a preemption) can make it settle on one
iteration per round, whose figure is then mostly the timer's own overhead. Unless the
command line says otherwise, turn its warm-up on: calibration then keeps the fastest of
repeated tries at each size, and rounds start warm.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    given = config.invocation_params.args
    explicit = any(str(a).startswith("--benchmark-warmup") for a in given)
    if not explicit and hasattr(config.option, "benchmark_warmup"):
        config.option.benchmark_warmup = True
