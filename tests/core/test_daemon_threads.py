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
