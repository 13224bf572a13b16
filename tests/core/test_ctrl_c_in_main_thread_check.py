"""A Ctrl-C whose handler runs while a blocked acquire asks Python which thread
is the main one (`threading.main_thread()` is Python code: a pending SIGINT's handler
runs inside it) must stop the wait, not be swallowed with the failed call (the wait
then went on to its grant or timeout: a child forked from another thread hung on it in
test_fork_safety under load)."""

from __future__ import annotations

import threading
import time

import pytest
import ratequeue as rq

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ctrl_c_in_main_thread_check(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The first `threading.main_thread()` call raises KeyboardInterrupt, as the SIGINT
    handler does when the signal lands during that call."""
    calls: list[int] = []
    real = threading.main_thread

    def main_thread() -> threading.Thread:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real()

    monkeypatch.setattr(threading, "main_thread", main_thread)
    return calls


def test_limiter_acquire_stops_on_a_ctrl_c_during_the_main_thread_check(
    ctrl_c_in_main_thread_check: list[int],
) -> None:
    lim = rq.Limiter(rq.Rate(1, per=3, burst=1))
    assert lim.try_acquire()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        lim.acquire()  # granted 3 s on: only the Ctrl-C ends it sooner
    assert ctrl_c_in_main_thread_check, "the check was not reached"
    assert time.monotonic() - t0 < 2.5
    assert lim.waiting == 0


def test_policy_acquire_stops_on_a_ctrl_c_during_the_main_thread_check(
    ctrl_c_in_main_thread_check: list[int],
) -> None:
    # A Concurrency(1) whose permit is held: the policy's acquire queues there.
    slots = rq.Concurrency(1)
    held = slots.try_acquire()
    assert held is not None
    policy = rq.Policy({"slots": slots, "api": rq.Limiter(rq.Rate(1000, per="second"))})
    threading.Timer(3, held.release).start()  # without the Ctrl-C: granted 3 s on
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        policy.acquire()
    assert ctrl_c_in_main_thread_check, "the check was not reached"
    assert time.monotonic() - t0 < 2.5
    assert slots.waiting == 0
