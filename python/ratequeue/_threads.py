"""What belongs to one process: worker threads a forked child makes again, and the objects
a forked child resets (one ``os.register_at_fork`` hook for them all)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import operator
import os
import threading
import time
import weakref
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any

from ._errors import each

__all__ = ["AfterFork", "DaemonThreads", "ProcessThreads", "fork_safe_lock"]


class AfterFork:
    """A weak set of objects whose method ``method`` (or the function ``method`` with each
    object) a forked child calls, set by set in the order the sets were made, in no order
    within a set: threads, locks or state of the parent that the child must not use. An
    object leaves the set when it is discarded or dies; nothing is registered per object,
    so making objects does not grow the process's fork hooks."""

    __slots__ = ("_members", "_method")

    def __init__(self, method: str | Callable[[Any], object]) -> None:
        # A method's name, or a function called with each member.
        self._method = method if callable(method) else operator.methodcaller(method)
        self._members: weakref.WeakSet[Any] = weakref.WeakSet()
        _SETS.append(self)

    def add(self, obj: Any) -> None:
        self._members.add(obj)

    def discard(self, obj: Any) -> None:
        self._members.discard(obj)

    def __len__(self) -> int:
        return len(self._members)

    def _in_child(self) -> None:
        each(list(self._members), self._method)


_SETS: list[AfterFork] = []


def _after_fork_in_child() -> None:
    # Every set, every member, whatever one raises; the first error is reported by the
    # interpreter (the child goes on).
    each(_SETS, AfterFork._in_child)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _free_lock(obj: Any) -> None:
    obj._lock = threading.Lock()


#: Objects whose ``_lock`` a forked child replaces with a free one.
_LOCKS = AfterFork(_free_lock)


def fork_safe_lock(obj: Any) -> threading.Lock:
    """A new ``threading.Lock`` for ``obj._lock``, which a forked child replaces with a
    free one: a thread of the parent (absent in the child) may have held it at the fork,
    and the child's first use would then wait for good. ``obj`` must be weakly
    referenceable; only its ``_lock`` attribute is replaced."""
    _LOCKS.add(obj)
    return threading.Lock()


#: Seconds the interpreter's exit waits in all for the package's threads (each pool's
#: work, the dropped streams' settling thread), counted from the first that waits.
EXIT_WAIT = 5.0
_EXIT_AT: list[float] = []


def exit_time_left() -> float:
    """At interpreter exit: seconds left of its one bounded wait (``EXIT_WAIT`` in all,
    whatever the number and order of the hooks that wait)."""
    if not _EXIT_AT:
        _EXIT_AT.append(time.monotonic() + EXIT_WAIT)
    return max(0.0, _EXIT_AT[0] - time.monotonic())


_log = logging.getLogger("ratequeue")


class DaemonThreads(concurrent.futures.Executor):
    """Up to ``max_workers`` daemon threads, started as work comes, running what is
    submitted in order. Unlike ``ThreadPoolExecutor``, whose threads the interpreter's
    exit joins however long their work takes, the exit waits at most ``EXIT_WAIT`` s for
    the work submitted (a ledger that never answers cannot hang it), then refuses more
    (``RuntimeError``, as a pool shut down) and logs what is left undone."""

    def __init__(self, name: str, max_workers: int) -> None:
        self._name = name
        self._max = max_workers
        self._queue: SimpleQueue[Any] = SimpleQueue()
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._threads = 0
        self._idle = 0  # threads waiting for work no submit has counted on yet
        self._pending = 0  # submitted, not done
        self._closed = False
        self._pid = os.getpid()
        with contextlib.suppress(RuntimeError):  # made at exit already: nothing to wait
            threading._register_atexit(self._at_exit)  # type: ignore[attr-defined]

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        item = (future, fn, args, kwargs)
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            start = not self._idle and self._threads < self._max
            if start:
                self._threads += 1
                name = f"{self._name}-{self._threads}"
            else:
                self._idle = max(0, self._idle - 1)
                self._put(item)
                return future
        try:
            threading.Thread(target=self._work, name=name, daemon=True).start()
        except RuntimeError:  # not started (a pids limit; shutting down)
            with self._lock:
                self._threads -= 1
                if not self._threads:
                    raise  # none to run it: not queued
                self._put(item)  # for the threads there are
            return future
        except BaseException:  # a Ctrl-C while the thread started: it runs
            with self._lock:
                self._put(item)
            raise
        with self._lock:
            self._put(item)
        return future

    def _put(self, item: Any) -> None:
        """Queue ``item`` (under the lock)."""
        self._pending += 1
        self._queue.put(item)

    def _work(self) -> None:
        queue = self._queue
        while True:
            item = queue.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            del item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:  # the caller's to see, as ThreadPoolExecutor
                    future.set_exception(e)
                    del e
                else:
                    future.set_result(result)
                    del result
            del future, fn, args, kwargs
            with self._lock:
                self._idle += 1
                self._pending -= 1
                self._done.notify_all()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            threads = self._threads
        for _ in range(threads):
            self._queue.put(None)
        if wait:
            self._wait(None)

    def _wait(self, timeout: float | None) -> bool:
        with self._lock:
            return self._done.wait_for(lambda: not self._pending, timeout)

    def _at_exit(self) -> None:
        if os.getpid() != self._pid:
            return  # the parent's pool, copied by a fork: the child's is another
        done = self._wait(exit_time_left())
        with self._lock:
            self._closed = True
            left = self._pending
        if not done:
            _log.warning("%s: %d calls not done at exit (left running)", self._name, left)


class ProcessThreads:
    """A pool of daemon threads (:class:`DaemonThreads`) made on first use and made
    again in a forked child (the parent's threads do not exist there, and its pool's
    lock may have been held at the fork)."""

    def __init__(self, name: str, max_workers: int) -> None:
        self._name = name
        self._max = max_workers
        self._pool: tuple[int, DaemonThreads] | None = None
        self._lock = threading.Lock()
        _PROCESS_THREADS.add(self)

    def get(self) -> DaemonThreads:
        """This process's pool."""
        with self._lock:
            if self._pool is None or self._pool[0] != os.getpid():
                self._pool = (os.getpid(), DaemonThreads(self._name, self._max))
            return self._pool[1]

    def _after_fork_in_child(self) -> None:
        self._pool, self._lock = None, threading.Lock()


_PROCESS_THREADS = AfterFork("_after_fork_in_child")
