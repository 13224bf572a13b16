"""Forked children for the fork tests, and a hang that fails fast with every stack.

Every test in tests/ that forks does it through :func:`fork_child` (or, for a
``multiprocessing`` child, ends it through :func:`join_or_fail`). The parent is the
watchdog: a child that has not exited by its timeout is sent SIGUSR1, on which the
faulthandler it registered right after the fork writes the Python stack of each of its
threads (a signal handler's dump takes no lock); then gdb, when installed, attaches for
the native stack of each thread; then the child is killed, and the failure message holds
both. (A watchdog inside the child cannot do this: ``faulthandler.dump_traceback_later``
deadlocks a forked child, whose copy of the parent's watchdog lock may be held.)
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import select
import shutil
import signal
import subprocess
import time
import traceback
from collections.abc import Callable, Iterable
from multiprocessing.process import BaseProcess

import pytest

#: The exit code :func:`fork_child` reports for a child it killed as hung.
HUNG = -signal.SIGKILL

#: Seconds a hung child has to write its Python stacks after SIGUSR1.
DUMP_SECONDS = 3.0
#: Seconds gdb has to attach and print the native stacks.
GDB_SECONDS = 60.0
#: Past its timeout plus this, a child whose parent stopped watching ends itself.
ORPHAN_SECONDS = 120

_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1)


def _ptrace_restricted() -> bool:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


# Resolved before any fork (a child must not load anything: another thread may have held
# the loader's lock at the fork).
_prctl = ctypes.CDLL(None, use_errno=True).prctl if _ptrace_restricted() else None


def report_stacks_on_sigusr1(fd: int = 2) -> None:
    """In a forked child: SIGUSR1 writes every thread's Python stack to ``fd``, and gdb
    may attach from outside (Yama's ptrace_scope 1 lets only ancestors in otherwise)."""
    faulthandler.register(signal.SIGUSR1, file=fd, all_threads=True)
    if _prctl is not None:
        _prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)


def native_stacks(pid: int) -> str:
    """Every thread's native stack in process ``pid``, from gdb (a note when it cannot)."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(no gdb on PATH: no native stacks)"
    cmd = [gdb, "-nx", "-batch", "-p", str(pid), "-ex", "set pagination off"]
    cmd += ["-ex", "thread apply all bt"]
    try:
        r = subprocess.run(
            cmd, capture_output=True, text=True, timeout=GDB_SECONDS, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return f"(gdb gave no stacks within {GDB_SECONDS} s)"
    lines = (r.stdout + r.stderr).splitlines()
    keep = [ln for ln in lines if ln.startswith(("Thread ", "#", "[Current thread"))]
    return "\n".join(keep) if keep else "\n".join(lines[-40:])


def _read(rfd: int, chunks: list[bytes]) -> bool:
    """Reads what the pipe holds now; False at its end."""
    while True:
        try:
            chunk = os.read(rfd, 65536)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        chunks.append(chunk)


def _stacks_of_hung(pid: int, rfd: int | None, chunks: list[bytes]) -> str:
    """SIGUSR1 (the child's Python stacks: into ``rfd``, else to its stderr), gdb, SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGUSR1)
    if rfd is not None:
        # Until the dump has come and gone quiet (it is written at once, in pieces).
        start, end = len(chunks), time.monotonic() + DUMP_SECONDS
        while time.monotonic() < end:
            ready, _, _ = select.select([rfd], [], [], 0.3)
            if not ready and len(chunks) > start:
                break
            if ready and not _read(rfd, chunks):
                break
    else:
        time.sleep(1.0)
    native = native_stacks(pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return native


def _watch(pid: int, rfd: int, timeout: float) -> tuple[int, str]:
    os.set_blocking(rfd, False)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    open_ = True
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _read(rfd, chunks)
            return os.waitstatus_to_exitcode(status), b"".join(chunks).decode(errors="replace")
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if open_:  # (a sibling forked meanwhile may hold the pipe open past this child)
            ready, _, _ = select.select([rfd], [], [], min(left, 0.01))
            open_ = not ready or _read(rfd, chunks)
        else:
            time.sleep(min(left, 0.01))
    native = _stacks_of_hung(pid, rfd, chunks)
    os.waitpid(pid, 0)
    _read(rfd, chunks)
    report = b"".join(chunks).decode(errors="replace")
    return HUNG, (
        f"child {pid} hung: no exit within {timeout} s (killed by the parent).\n"
        f"--- its Python stacks and report (faulthandler, on SIGUSR1) ---\n{report}\n"
        f"--- its native stacks (gdb) ---\n{native}"
    )


def fork_child(body: Callable[[], object], timeout: float) -> tuple[int, str]:
    """Runs ``body()`` in a forked child (from whichever thread calls this); returns
    (exit code, report: the child's traceback, if any). The child never returns into the
    caller. One not done within ``timeout`` s is killed by the parent, the code then
    :data:`HUNG` and the report its Python and native stacks of every thread."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(rfd)
            report_stacks_on_sigusr1(wfd)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # pytest-timeout's handler
            signal.alarm(int(timeout) + ORPHAN_SECONDS)  # only if the parent is gone
            body()
            code = 0
        except BaseException:
            with contextlib.suppress(OSError):
                os.write(wfd, traceback.format_exc().encode())
        finally:
            os._exit(code)
    os.close(wfd)
    try:
        return _watch(pid, rfd, timeout)
    finally:
        os.close(rfd)


def check_child(result: tuple[int, str], timeout: float) -> None:
    """Fails the test unless the child of :func:`fork_child` exited 0."""
    code, report = result
    if code == HUNG and report.startswith("child "):
        pytest.fail(report, pytrace=False)
    assert code == 0, f"child exited with {code}:\n{report}"


def join_or_fail(procs: Iterable[BaseProcess], timeout: float) -> None:
    """Joins ``multiprocessing`` children (fork context) within ``timeout`` s in all; a
    child still running then is killed and the test fails with its native stacks (its
    Python ones go to its stderr, in the test's captured output: see conftest)."""
    procs = list(procs)
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    stacks = [
        f"--- child {p.pid}: native stacks (gdb) ---\n{_stacks_of_hung(p.pid or 0, None, [])}"
        for p in hung
    ]
    for p in hung:
        p.join(10)
    if hung:
        pytest.fail(
            f"{len(hung)} child process(es) hung: no exit within {timeout} s (killed; their "
            "Python stacks are in the captured stderr)\n" + "\n".join(stacks),
            pytrace=False,
        )
