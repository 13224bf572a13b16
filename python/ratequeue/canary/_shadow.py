"""Run shadow copies off the caller's path: a few daemon threads and a bounded queue."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from .._threads import AfterFork

__all__ = ["ShadowRunner"]

#: Every runner: a forked child starts with no threads and an empty queue.
_RUNNERS = AfterFork("_reset")


class ShadowRunner:
    """Runs jobs on up to ``workers`` daemon threads; ``submit`` never blocks.

    At most ``limit`` jobs wait or run at once; a job beyond is refused (``submit``
    returns False), so a hanging candidate costs a bounded number of threads and never
    memory without bound. Daemon threads never hold up interpreter exit; a forked child
    starts with no threads and an empty queue.
    """

    def __init__(self, workers: int, limit: int) -> None:
        self._workers = workers
        self._limit = limit
        self._reset()
        _RUNNERS.add(self)

    def _reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._threads = 0
        self._idle = 0
        self._pending = 0  # queued + running

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        return self._pending

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue ``job``; False (and nothing queued) when ``limit`` jobs are pending."""
        with self._cond:
            if self._pending >= self._limit:
                return False
            self._pending += 1
            self._jobs.append(job)
            if self._idle:
                self._cond.notify()
            elif self._threads < self._workers:
                self._threads += 1
                threading.Thread(target=self._work, name="ratequeue-shadow", daemon=True).start()
        return True

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._idle += 1
                    self._cond.wait()
                    self._idle -= 1
                job = self._jobs.popleft()
            try:
                job()
            except Exception:
                logging.getLogger("ratequeue.canary").exception("shadow job failed")
            finally:
                with self._cond:
                    self._pending -= 1
