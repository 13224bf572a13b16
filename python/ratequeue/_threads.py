"""What belongs to one process: worker threads a forked child makes again, and the objects
a forked child resets (one ``os.register_at_fork`` hook for them all)."""

from __future__ import annotations

import concurrent.futures
import operator
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ._errors import each

__all__ = ["AfterFork", "ProcessThreads", "fork_safe_lock"]


class AfterFork:
    """A weak set of objects whose method ``method`` (or the function ``method`` with each
    object) a forked child calls (in the order the
    sets were made, then in no set order): threads, locks or state of the parent that the
    child must not use. An object leaves the set when it is discarded or dies; nothing is
    registered per object, so making objects does not grow the process's fork hooks."""

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


class ProcessThreads:
    """A thread pool made on first use and made again in a forked child (the parent's
    threads do not exist there, and its pool's lock may have been held at the fork)."""

    def __init__(self, name: str, max_workers: int) -> None:
        self._name = name
        self._max = max_workers
        self._pool: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
        self._lock = threading.Lock()
        _PROCESS_THREADS.add(self)

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


_PROCESS_THREADS = AfterFork("_after_fork_in_child")
