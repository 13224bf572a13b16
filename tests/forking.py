"""Runs a body in a forked child, for the fork tests (shared by tests/core)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import traceback
from collections.abc import Callable

import pytest


def fork_child(body: Callable[[], object], timeout: int) -> tuple[int, str]:
    """Runs ``body()`` in a forked child (from whichever thread calls this), which a
    watchdog alarm kills after ``timeout`` s; returns (exit code, report). The child never
    returns into the caller; a child that outlives its watchdog is killed by the parent."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(rfd)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # pytest-timeout's handler
            signal.alarm(timeout)
            body()
            code = 0
        except BaseException:
            with contextlib.suppress(OSError):
                os.write(wfd, traceback.format_exc().encode())
        finally:
            os._exit(code)
    os.close(wfd)
    chunks = []
    while chunk := os.read(rfd, 65536):
        chunks.append(chunk)
    os.close(rfd)
    deadline = time.monotonic() + timeout + 5
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -signal.SIGKILL, "child hung (killed by the parent)"
        time.sleep(0.005)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode(errors="replace")


def check_child(result: tuple[int, str], timeout: int) -> None:
    """Fails the test unless the child of ``fork_child`` exited 0."""
    code, report = result
    if code == -signal.SIGALRM:
        pytest.fail(f"child hung (killed by its watchdog after {timeout} s):\n{report}")
    assert code == 0, f"child exited with {code}:\n{report}"
