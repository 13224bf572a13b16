"""Blocked threads time their own grants (one wake-up each, no driver thread between):
the driver is not needed for them, and a grant that moves earlier wakes its thread."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import ratequeue as rq

pytestmark = pytest.mark.timeout(60)


def wait_until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.0005)


NO_DRIVER_SCRIPT = textwrap.dedent(
    """
    import threading
    from pathlib import Path
    import ratequeue as rq

    lim = rq.Limiter(rq.Rate(1000, per="second", burst=1))
    queued = []

    def work():
        for _ in range(50):
            queued.append(lim.acquire().waited > 0)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    names = [p.read_text().strip() for p in Path("/proc/self/task").glob("*/comm")]
    print(sum(queued), lim.stats()["queued_grants"], "ratequeue-drive" in names)
    """
)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc (Linux)")
def test_blocked_threads_are_granted_without_a_driver_thread() -> None:
    r = subprocess.run(
        [sys.executable, "-c", NO_DRIVER_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    queued, grants, driver = r.stdout.split()
    assert int(queued) >= 150 and int(grants) == int(queued)
    assert driver == "False", "a driver thread was started for blocked threads alone"


def test_a_thread_behind_an_interrupted_waiter_is_woken_for_its_earlier_grant(ctrl_c) -> None:
    # Grants 2 s apart: the main thread is due at 2 s, the thread behind it at 4 s. Ctrl-C
    # takes the main thread out at 0.5 s: the thread's grant moves to 2 s, and it must
    # be woken for it rather than sleep on until the 4 s it was first told.
    limiter = rq.Limiter(rq.Rate(1, per=2, burst=1))
    assert limiter.try_acquire()
    done: dict[str, float] = {}
    behind: list[rq.Permit] = []

    def wait_behind() -> None:
        wait_until(lambda: limiter.waiting == 1)
        behind.append(limiter.acquire())
        done["at"] = time.monotonic()

    t = threading.Thread(target=wait_behind, daemon=True)
    t.start()
    ctrl_c(0.5)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        limiter.acquire()
    t.join(30)
    assert behind, "the thread behind was not granted"
    assert 1.0 <= behind[0].waited <= 2.0
    assert done["at"] - t0 < 3.5, f"woken {done['at'] - t0:.2f} s after, its old slot was 4 s"
    assert limiter.waiting == 0
