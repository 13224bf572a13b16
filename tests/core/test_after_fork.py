"""The package's one fork hook (``ratequeue._threads.AfterFork``): the members of each
set are reset in a forked child, whatever one of them raises; a member discarded or dead
is not; making objects registers nothing per object."""

from __future__ import annotations

import gc
import os

import pytest
from forking import check_child, fork_child
from ratequeue._threads import _SETS, AfterFork

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)"),
    pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning"),
]


class Thing:
    def __init__(self, fail: bool = False) -> None:
        self.reset = 0
        self.fail = fail

    def again(self) -> None:
        self.reset += 1
        if self.fail:
            raise RuntimeError("reset failed")


def test_members_reset_in_the_child_only() -> None:
    hook = AfterFork("again")
    kept, failing, dropped, dead = Thing(), Thing(fail=True), Thing(), Thing()
    for thing in (kept, failing, dropped, dead):
        hook.add(thing)
    del thing
    hook.discard(dropped)
    del dead
    gc.collect()
    assert len(hook) == 2

    def child() -> None:
        # The failing member was told, and did not stop the other one.
        assert (kept.reset, failing.reset, dropped.reset) == (1, 1, 0)

    check_child(fork_child(child, 30), 30)
    assert (kept.reset, failing.reset, dropped.reset) == (0, 0, 0)  # the parent's untouched


def test_objects_register_no_hook_of_their_own() -> None:
    # ShadowRunner once registered a closure with os.register_at_fork per runner: a
    # process making canaries grew its fork hooks without bound.
    from ratequeue.canary._shadow import ShadowRunner

    before = len(_SETS)
    runners = [ShadowRunner(1, 4) for _ in range(100)]
    assert len(_SETS) == before
    from ratequeue.canary._shadow import _RUNNERS

    assert len(_RUNNERS) >= 100
    del runners
    gc.collect()
    assert len(_RUNNERS) < 100
