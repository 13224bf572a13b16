"""Output caps per task type: the most output tokens a route, model or task may ask for.

A rule matches a call by route (the URL path, or its end: ``"/chat/completions"``), by
model (exact, or a glob such as ``"gpt-4o*"``) and by task tag (``x-ratequeue-task``
header or :func:`ratequeue.httpx.using`); the smallest matching cap applies. It is
applied by rewriting the body: a larger ``max_tokens`` / ``max_completion_tokens`` /
``max_output_tokens`` is lowered, a missing one is added (the field the route's API
uses), a smaller one is never raised; one that is no count (a negative int, not an int)
is replaced, and so is every occurrence of a key the body repeats when any is above the
cap or no count.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import RateQueueError
from ._estimate import OUTPUT_FIELDS

__all__ = ["Cap", "CapNotApplied", "Capped", "apply_caps", "output_field"]


class CapNotApplied(RateQueueError, ValueError):
    """An output cap matches the call but its body could not be capped: not read (over
    the transport's ``max_body``, or a stream) or not one JSON object. Refused before
    anything was acquired, charged or sent (``retry_after`` is ``inf``: the same call is
    refused again). A transport built with ``uncapped="send"`` sends such calls as they
    are instead."""

    def __init__(self, message: str) -> None:
        super().__init__(message, float("inf"))


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
        """True when the call's path, model and task fit every criterion given (the
        route as servers route it: any case, trailing or doubled slashes ignored)."""
        if self.route is not None and not _on_route(path, self.route):
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


def route_of(path: str) -> str:
    """``path`` as a server routing leniently sees it: lower case, doubled and trailing
    slashes dropped (Express and ASP.NET route case-insensitively and ignore a trailing
    slash; a cap must match every spelling a server may serve as its route)."""
    p = path.lower()
    if "//" in p:
        p = re.sub("/{2,}", "/", p)
    return p.rstrip("/") or "/"


def _on_route(path: str, route: str) -> bool:
    p, r = route_of(path), route_of(route)
    return p == r or p.endswith(r)


def output_field(path: str) -> str:
    """The body field that bounds output on this route's API."""
    path = route_of(path)
    if path.endswith("/responses"):
        return "max_output_tokens"
    if path.endswith("/chat/completions"):
        return "max_completion_tokens"
    return "max_tokens"


def cap_limit(caps: Sequence[Cap], path: str, model: str | None, task: str | None) -> int | None:
    """The smallest cap matching a call (None: none matches)."""
    return min((c.max_tokens for c in caps if c.matches(path, model, task)), default=None)


def _over(v: Any, limit: int) -> bool:
    """True when the cap replaces this bound: no count (not an int, or negative), or
    above the cap."""
    return isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > limit


def cap_fields(
    body: dict[str, Any],
    path: str,
    limit: int,
    repeated: Mapping[str, Sequence[Any]] | None = None,
) -> tuple[Capped | None, dict[str, int]]:
    """Lower (or add) the body's output bound to ``limit``, in place: what was done
    (None: nothing) and the fields written. ``repeated``: every value of a bound the
    body's bytes repeat (``body`` holds the last); any one the cap replaces writes them
    all, so a parser keeping the first of a repeated key sees the cap too."""
    present = [f for f in OUTPUT_FIELDS if f in body]
    if not present:
        f = output_field(path)
        body[f] = limit
        return Capped(f, None, limit), {f: limit}
    done: Capped | None = None
    fields: dict[str, int] = {}
    for f in present:
        values = repeated.get(f) if repeated else None
        over = [v for v in (values or (body[f],)) if _over(v, limit)]
        if over:
            v = over[-1]
            body[f] = fields[f] = limit
            done = Capped(
                f, v if not isinstance(v, bool) and isinstance(v, int) and v >= 0 else None, limit
            )
    return done, fields


def apply_limit(body: dict[str, Any], path: str, limit: int | None) -> Capped | None:
    """Lower (or add) the body's output bound to ``limit``, in place; what was done, or
    None when nothing was."""
    if limit is None:
        return None
    return cap_fields(body, path, limit)[0]


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

    __slots__ = ("by_model", "caps", "limits", "size")

    def __init__(self, caps: Sequence[Cap], size: int = 1024) -> None:
        self.caps = tuple(caps)
        self.by_model = any(c.model is not None for c in self.caps)
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

    def may_match(self, path: str, task: str | None) -> bool:
        """True when some cap matches a call on ``path`` with ``task`` whose model is not
        known (a cap on a model may be the one)."""
        return any(
            (c.route is None or _on_route(path, c.route)) and (c.task is None or task == c.task)
            for c in self.caps
        )

    def limit_any(self, path: str, models: Sequence[Any], task: str | None) -> int | None:
        """The smallest limit over every model a repeated ``model`` key names (a parser
        keeping the first sees another model than one keeping the last)."""
        limits = [self.limit(path, m if type(m) is str else None, task) for m in models]
        return min((v for v in limits if v is not None), default=None)

    def apply(self, body: dict[str, Any], path: str, task: str | None) -> Capped | None:
        """``apply_caps`` with this table's caps."""
        return self.apply_fields(body, path, task)[0]

    def apply_fields(
        self,
        body: dict[str, Any],
        path: str,
        task: str | None,
        repeated: Mapping[str, Sequence[Any]] | None = None,
    ) -> tuple[Capped | None, dict[str, int]]:
        """``cap_fields`` with this table's limit for the call (nothing when none)."""
        model = body.get("model")
        models = repeated.get("model") if repeated else None
        if models:
            limit = self.limit_any(path, models, task)
        else:
            limit = self.limit(path, model if type(model) is str else None, task)
        if limit is None:
            return None, {}
        return cap_fields(body, path, limit, repeated)
