"""Worker threads that belong to one process: a forked child makes its own."""

from __future__ import annotations

import concurrent.futures
import os
import threading


class ProcessThreads:
    """A thread pool made on first use and made again in a forked child (the parent's
    threads do not exist there, and its pool's lock may have been held at the fork)."""

    def __init__(self, name: str, max_workers: int) -> None:
        self._name = name
        self._max = max_workers
        self._pool: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._after_fork_in_child)

    def get(self) -> concurrent.futures.ThreadPoolExecutor:
        """This process's pool."""
        with self._lock:
            if self._pool is None or self._pool[0] != os.getpid():
                pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self._max, thread_name_prefix=self._name
                )
                self._pool = (os.getpid(), pool)
            return self._pool[1]

    def _after_fork_in_child(self) -> None:
        self._pool, self._lock = None, threading.Lock()
