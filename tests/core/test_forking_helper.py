"""The fork tests' helper (tests/forking.py): a child that hangs fails its test fast with
the Python and native stack of every thread, a hang holding the GIL included."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import shutil
import threading
import time

import pytest
from forking import HUNG, check_child, fork_child, join_or_fail

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)"),
    pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning"),
]

HAS_GDB = shutil.which("gdb") is not None


def _stuck_in_a_helper_thread() -> None:
    threading.Event().wait()


def _stuck_holding_the_gil() -> None:
    # libc's pause() through PyDLL keeps the GIL: no Python code runs in any thread
    # (a signal ends one pause: the next begins).
    threading.Thread(target=_stuck_in_a_helper_thread, name="helper", daemon=True).start()
    time.sleep(0.2)
    pause = ctypes.PyDLL(None).pause
    while True:
        pause()


def _stuck_on_a_lock() -> None:
    threading.Thread(target=_stuck_in_a_helper_thread, name="helper", daemon=True).start()
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()


@pytest.mark.parametrize("body", [_stuck_on_a_lock, _stuck_holding_the_gil])
def test_a_hung_child_is_killed_with_every_threads_stacks(body):
    t0 = time.monotonic()
    code, report = fork_child(body, 1)
    assert code == HUNG
    assert time.monotonic() - t0 < 1 + 70  # its timeout, the dump and gdb
    # Python: both threads, each at its own line (faulthandler's format).
    assert report.count("hread 0x") >= 2, report
    assert f"in {body.__name__}" in report, report
    assert "in _stuck_in_a_helper_thread" in report, report
    if HAS_GDB:
        assert "#0 " in report, report
    with pytest.raises(pytest.fail.Exception, match="hung"):
        check_child((code, report), 1)


def test_a_child_that_ends_reports_its_code_and_traceback():
    assert fork_child(lambda: None, 5) == (0, "")
    code, report = fork_child(lambda: 1 / 0, 5)
    assert code == 1 and "ZeroDivisionError" in report


def test_a_hung_multiprocessing_child_fails_its_test_with_its_stacks():
    p = multiprocessing.get_context("fork").Process(target=_stuck_on_a_lock)
    p.start()
    with pytest.raises(pytest.fail.Exception, match="hung") as e:
        join_or_fail([p], 1)
    assert not p.is_alive()
    if HAS_GDB:
        assert "#0 " in str(e.value)
