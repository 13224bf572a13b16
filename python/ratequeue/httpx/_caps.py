"""Output caps per task type: the most output tokens a route, model or task may ask for.

A rule matches a call by route (the URL path, or its end: ``"/chat/completions"``), by
model (exact, or a glob such as ``"gpt-4o*"``) and by task tag (``x-ratequeue-task``
header or :func:`ratequeue.httpx.using`); the smallest matching cap applies. It is
applied by rewriting the body: a larger ``max_tokens`` / ``max_completion_tokens`` /
``max_output_tokens`` is lowered, a missing one is added (the field the route's API
uses), a smaller one is never raised.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._estimate import OUTPUT_FIELDS

__all__ = ["Cap", "Capped", "apply_caps", "output_field"]


@dataclass(frozen=True, slots=True)
class Cap:
    """At most ``max_tokens`` output tokens for calls matching every given criterion."""

    max_tokens: int
    route: str | None = None
    model: str | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise TypeError(f"max_tokens={self.max_tokens!r} must be an int")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be >= 1")
        for name in ("route", "model", "task"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise TypeError(f"{name}={v!r} must be a string or None")

    def matches(self, path: str, model: str | None, task: str | None) -> bool:
        """True when the call's path, model and task fit every criterion given."""
        if self.route is not None and not (path == self.route or path.endswith(self.route)):
            return False
        if self.model is not None:
            if model is None:
                return False
            if model != self.model and not fnmatch.fnmatchcase(model, self.model):
                return False
        return self.task is None or task == self.task


@dataclass(frozen=True, slots=True)
class Capped:
    """A cap applied to a call: the field rewritten, what was asked (None: nothing) and
    what was sent."""

    field: str
    requested: int | None
    sent: int


def output_field(path: str) -> str:
    """The body field that bounds output on this route's API."""
    if path.endswith("/responses"):
        return "max_output_tokens"
    if path.endswith("/chat/completions"):
        return "max_completion_tokens"
    return "max_tokens"


def cap_limit(caps: Sequence[Cap], path: str, model: str | None, task: str | None) -> int | None:
    """The smallest cap matching a call (None: none matches)."""
    return min((c.max_tokens for c in caps if c.matches(path, model, task)), default=None)


def apply_limit(body: dict[str, Any], path: str, limit: int | None) -> Capped | None:
    """Lower (or add) the body's output bound to ``limit``, in place; what was done, or
    None when nothing was."""
    if limit is None:
        return None
    present = [f for f in OUTPUT_FIELDS if f in body]
    if not present:
        f = output_field(path)
        body[f] = limit
        return Capped(f, None, limit)
    done: Capped | None = None
    for f in present:
        v = body[f]
        if isinstance(v, bool) or not isinstance(v, int) or v > limit:
            body[f] = limit
            done = Capped(f, v if isinstance(v, int) and not isinstance(v, bool) else None, limit)
    return done


def apply_caps(
    caps: Sequence[Cap], body: dict[str, Any], path: str, task: str | None
) -> Capped | None:
    """Lower (or add) the body's output bound to the smallest matching cap, in place;
    what was done, or None when no cap applied."""
    model = body.get("model")
    model = model if isinstance(model, str) else None
    return apply_limit(body, path, cap_limit(caps, path, model, task))


class CapTable:
    """The caps of one transport, with the limit of each (route, model, task) seen kept
    (at most ``size`` of them: they come from callers)."""

    __slots__ = ("caps", "limits", "size")

    def __init__(self, caps: Sequence[Cap], size: int = 1024) -> None:
        self.caps = tuple(caps)
        self.limits: dict[tuple[str, str | None, str | None], int | None] = {}
        self.size = size

    def limit(self, path: str, model: str | None, task: str | None) -> int | None:
        """``cap_limit`` with this table's caps."""
        key = (path, model, task)
        try:
            return self.limits[key]
        except KeyError:
            limit = cap_limit(self.caps, *key)
            if len(self.limits) < self.size:
                self.limits[key] = limit
            return limit

    def apply(self, body: dict[str, Any], path: str, task: str | None) -> Capped | None:
        """``apply_caps`` with this table's caps."""
        model = body.get("model")
        return apply_limit(
            body, path, self.limit(path, model if type(model) is str else None, task)
        )
