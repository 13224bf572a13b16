"""The worker threads of the ledgers (``ratequeue._threads.DaemonThreads``): work runs in
order on at most ``max_workers`` daemon threads; the interpreter's exit waits a bounded
time for it (a call that never returns cannot hang the exit), then refuses more."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
from ratequeue import _threads
from ratequeue._threads import DaemonThreads


def test_results_errors_and_asyncio() -> None:
    pool = DaemonThreads("t", 2)
    assert pool.submit(lambda a, b=0: a + b, 1, b=2).result(5) == 3
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(5)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, threading.get_ident)

    assert asyncio.run(main()) != threading.get_ident()
    pool.shutdown()


def test_at_most_max_workers_all_daemons() -> None:
    pool = DaemonThreads("t", 2)
    gate, seen = threading.Event(), set()
    lock = threading.Lock()

    def work() -> None:
        with lock:
            seen.add(threading.current_thread())
        gate.wait(10)

    futures = [pool.submit(work) for _ in range(6)]
    time.sleep(0.2)
    assert len(seen) == 2 and all(t.daemon for t in seen)
    gate.set()
    for f in futures:
        f.result(10)
    assert len(seen) == 2
    pool.shutdown()


def test_the_exit_waits_a_bounded_time_then_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_threads, "EXIT_WAIT", 0.2)
    monkeypatch.setattr(_threads, "_EXIT_AT", [])  # this test's exit, not the process's
    pool = DaemonThreads("t", 1)
    release = threading.Event()
    stuck = pool.submit(release.wait, 30)
    t0 = time.monotonic()
    pool._at_exit()  # what the interpreter's exit runs
    assert time.monotonic() - t0 < 5 and not stuck.done()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(print)
    release.set()
    assert stuck.result(5) is True


def test_the_exit_of_a_forked_child_does_not_wait_for_the_parents_work() -> None:
    from forking import check_child, fork_child

    pool = DaemonThreads("t", 1)
    release = threading.Event()
    pool.submit(release.wait, 30)

    def child() -> None:
        t0 = time.monotonic()
        pool._at_exit()
        assert time.monotonic() - t0 < 1

    try:
        if hasattr(os, "fork"):
            check_child(fork_child(child, 20), 20)
    finally:
        release.set()
        pool.shutdown()


def _fail_starts(monkeypatch: pytest.MonkeyPatch, exc: type[BaseException]) -> None:
    """The pool's next thread start raises ``exc`` (a pids limit: RuntimeError)."""
    real, left = threading.Thread.start, [1]

    def start(self: threading.Thread) -> None:
        if left and self.name.startswith("t-"):
            left.pop()
            raise exc("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)


def test_a_failed_first_start_queues_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (stop 41): the work of a first thread that could not start stayed
    counted: ``shutdown(wait=True)`` hung, the exit waited its whole bound, and the next
    thread, counted idle while it ran, let work wait behind a blocked call."""
    pool = DaemonThreads("t", 4)
    _fail_starts(monkeypatch, RuntimeError)
    with pytest.raises(RuntimeError):
        pool.submit(print)
    monkeypatch.undo()
    assert pool._pending == 0
    release = threading.Event()
    blocked = pool.submit(release.wait, 30)  # a ledger that does not answer
    time.sleep(0.2)
    try:
        assert pool.submit(lambda: 42).result(5) == 42  # a second thread runs it
    finally:
        release.set()
    assert blocked.result(5) is True
    pool.shutdown()


def test_a_ctrl_c_while_a_thread_starts_is_raised_and_the_work_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review (stop 41): it was swallowed whenever another thread of the pool
    lived."""
    pool = DaemonThreads("t", 4)
    release = threading.Event()
    first = pool.submit(release.wait, 30)
    time.sleep(0.1)
    _fail_starts(monkeypatch, KeyboardInterrupt)
    ran = threading.Event()
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.submit(ran.set)
    finally:
        monkeypatch.undo()
        release.set()
    assert first.result(5) is True and ran.wait(5)
    pool.shutdown()


def test_the_exit_waits_once_in_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (stop 41): each pool, and the dropped streams' thread after them,
    waited its own bound: a ledger that never answered held the exit twice as long."""
    monkeypatch.setattr(_threads, "EXIT_WAIT", 0.3)
    monkeypatch.setattr(_threads, "_EXIT_AT", [])
    release = threading.Event()
    pools = [DaemonThreads("t", 1), DaemonThreads("u", 1)]
    for pool in pools:
        pool.submit(release.wait, 30)
    t0 = time.monotonic()
    for pool in pools:
        pool._at_exit()
    took = time.monotonic() - t0
    release.set()
    assert 0.25 < took < 0.6
