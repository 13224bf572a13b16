"""Shared test settings: hypothesis profiles and a manual clock fixture.

Profiles: "dev" (the default, quick) and "ci" (more examples), chosen by CI=true in the
environment; HYPOTHESIS_PROFILE=<name> overrides both.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator

import pytest
import ratequeue as rq
from forking import report_stacks_on_sigusr1
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


#: Seconds after which a test that has not ended kills the run with every thread's stack.
#: pytest-timeout (thread method, pyproject) fires first; this is the backstop for a hang
#: that holds the GIL (its timer thread then cannot run): faulthandler's watchdog is a C
#: thread that needs no GIL, so a deadlock fails CI in minutes, never runs out its clock.
HANG_SECONDS = float(os.environ.get("RATEQUEUE_HANG_SECONDS", "240"))


_real_stderr: object = None


def _stacks_on_sigusr1_in_a_child() -> None:
    """Every forked child of the test process (``multiprocessing`` ones included) writes
    each thread's Python stack to its stderr (the test's captured output) on SIGUSR1: what
    a parent's watchdog sends a child it finds hung (tests/forking.py)."""
    report_stacks_on_sigusr1(2)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_stacks_on_sigusr1_in_a_child)


@pytest.fixture
def ctrl_c() -> Iterator[Callable[[float], threading.Timer]]:
    """``ctrl_c(delay)`` sends SIGINT to this process after ``delay`` seconds, as Ctrl-C
    would. The handler raises KeyboardInterrupt only while the test runs: a signal that
    lands late (a loaded machine) is swallowed at teardown instead of interrupting a later
    test or pytest itself."""
    armed = True
    timers: list[threading.Timer] = []

    def handler(signum: int, frame: object) -> None:
        if armed:
            raise KeyboardInterrupt

    def soon(delay: float) -> threading.Timer:
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
        timers.append(timer)
        timer.start()
        return timer

    old = signal.signal(signal.SIGINT, handler)
    try:
        yield soon
    finally:
        armed = False
        for timer in timers:
            timer.cancel()
            timer.join()
        signal.signal(signal.SIGINT, old)  # runs a pending handler first: disarmed


_IN_CI = os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """In CI (CI=true) a skip is a failure: CI installs every package and service the
    tests need (and runs on Linux, where the fork and /proc skips never apply), so a
    skip there means something is missing."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if _IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI (CI=true), which must not happen: {report.longrepr}"


def pytest_configure(config: pytest.Config) -> None:
    """Keeps a handle on the process's real stderr (pytest captures fd 2 during tests):
    the stacks of a hang must reach CI's log, not a capture file that dies with it."""
    global _real_stderr
    import sys

    capman = config.pluginmanager.getplugin("capturemanager")
    fd = getattr(
        getattr(getattr(capman, "_global_capturing", None), "err", None), "targetfd_save", None
    )
    _real_stderr = os.fdopen(os.dup(fd), "w") if isinstance(fd, int) else sys.__stderr__


def pytest_unconfigure(config: pytest.Config) -> None:
    """Closes the duplicate of stderr that :func:`pytest_configure` opened."""
    import io
    import sys

    if isinstance(_real_stderr, io.TextIOWrapper) and _real_stderr is not sys.__stderr__:
        _real_stderr.close()


@pytest.fixture(autouse=True)
def _fail_fast_on_a_hang(request: pytest.FixtureRequest) -> object:
    import faulthandler

    marker = request.node.get_closest_marker("timeout")
    limit = HANG_SECONDS
    if marker is not None and marker.args:
        limit = max(limit, float(marker.args[0]) + 60.0)
    given = request.config.getoption("timeout", default=None)  # pytest --timeout N
    if given:
        limit = max(limit, float(given) + 60.0)
    faulthandler.dump_traceback_later(limit, exit=True, file=_real_stderr)
    yield
    faulthandler.cancel_dump_traceback_later()
