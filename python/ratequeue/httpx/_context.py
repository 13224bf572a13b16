"""Per-call options carried by the context: priority, task tag, account and policy keys."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["CallOptions", "current_options", "using"]


@dataclass(frozen=True, slots=True)
class CallOptions:
    """What :func:`using` set for the calls of this context (None: not set)."""

    priority: str | None = None
    task: str | None = None
    account: str | None = None
    keys: Mapping[str, Any] = field(default_factory=dict)


_EMPTY = CallOptions()
_OPTIONS: contextvars.ContextVar[CallOptions] = contextvars.ContextVar(
    "ratequeue_call_options", default=_EMPTY
)


def current_options() -> CallOptions:
    """The options of this context (empty outside :func:`using`)."""
    return _OPTIONS.get()


@contextlib.contextmanager
def using(
    *,
    priority: str | None = None,
    task: str | None = None,
    account: str | None = None,
    keys: Mapping[str, Any] | None = None,
) -> Iterator[CallOptions]:
    """Calls made inside (tasks and context copies too) use this priority class, task tag
    (for output caps), ledger account and policy keys; nested blocks override what they
    set and keep the rest."""
    for name, v in (("priority", priority), ("task", task), ("account", account)):
        if v is not None and not isinstance(v, str):
            raise TypeError(f"{name}={v!r} must be a string or None")
    cur = _OPTIONS.get()
    new = replace(
        cur,
        priority=priority if priority is not None else cur.priority,
        task=task if task is not None else cur.task,
        account=account if account is not None else cur.account,
        keys={**cur.keys, **keys} if keys else cur.keys,
    )
    token = _OPTIONS.set(new)
    try:
        yield new
    finally:
        _OPTIONS.reset(token)
