"""Output caps per task type: the most output tokens a route, model or task may ask for.

A rule matches a call by route (the URL path, or its end: ``"/chat/completions"``), by
model (exact, or a glob such as ``"gpt-4o*"``) and by task tag (``x-ratequeue-task``
header or :func:`ratequeue.httpx.using`); the smallest matching cap applies, model
globs in any case. It bounds the call's whole output: a body asking for several choices
(``n``, ``best_of``, Gemini's ``generationConfig.candidateCount``) gets the cap divided
among them. It is applied by rewriting the body at every place of
:data:`~ratequeue.httpx._estimate.OUTPUT_BOUNDS` (top-level ``max_tokens`` /
``max_completion_tokens`` / ``max_output_tokens`` / ``max_gen_len``, Gemini's
``generationConfig.maxOutputTokens``, Bedrock Converse's ``inferenceConfig.maxTokens``,
Nova's older ``inferenceConfig.max_new_tokens``, Titan's
``textGenerationConfig.maxTokenCount``):
a larger bound is lowered, a smaller
one is never raised; one that is no count (a negative int, not an int) is replaced, and so
is every occurrence of a key the body repeats when any is above the cap or no count; a
container without a bound gets one, and a body with neither a bound nor a container gets
the field the route's API (or Bedrock model) uses; none on an API that produces no text
(embeddings, images, audio, moderations, token counts).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import RateQueueError
from .._ratequeue import _NO_TEXT_ROUTES, _spends_no_tokens
from ._estimate import CHOICES, CONTAINERS, NESTED_CHOICES, OUTPUT_BOUNDS, OUTPUT_FIELDS

__all__ = ["Cap", "CapNotApplied", "Capped", "apply_caps", "output_field"]


class CapNotApplied(RateQueueError, ValueError):
    """An output cap matches the call but its body could not be capped: not read (over
    the transport's ``max_body``, or a stream), not one JSON object, or a multipart body
    with a form field naming a bound; or its choices cannot share the cap (``n`` /
    ``best_of`` not a positive int, or more of them than the cap has tokens), or it
    names a container of bounds twice. Refused before anything was acquired, charged or
    sent (``retry_after`` is ``inf``: the same call is refused again). A transport built
    with ``uncapped="send"`` sends the bodies it could not read (or that name a bound in a
    form field) as they are instead; the other refusals stand."""

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
            # Providers read model ids in any case: so does the cap.
            m, want = model.lower(), self.model.lower()
            if m != want and not fnmatch.fnmatchcase(m, want):
                return False
        return self.task is None or task == self.task


@dataclass(frozen=True, slots=True)
class Capped:
    """A cap applied to a call: the field rewritten (``container.name`` for a nested
    one), what was asked (None: nothing) and what was sent (the cap divided among the
    choices the body asks for)."""

    field: str
    requested: int | None
    sent: int


def route_of(path: str) -> str:
    """``path`` as a server routing leniently sees it: lower case, ``;`` parameters of
    each segment, doubled and trailing slashes and dot segments dropped (Express and
    ASP.NET route case-insensitively and ignore a trailing slash, Tomcat and Spring strip
    ``;`` parameters; a cap must match every spelling a server may serve as its route)."""
    p = path.lower()
    if ";" in p:
        p = re.sub(";[^/]*", "", p)
    if "//" in p:
        p = re.sub("/{2,}", "/", p)
    if "/." in p:
        segs: list[str] = []
        for seg in p.split("/"):
            if seg == "..":
                if len(segs) > 1:
                    segs.pop()
            elif seg != ".":
                segs.append(seg)
        p = "/".join(segs)
    return p.rstrip("/") or "/"


def _on_route(path: str, route: str) -> bool:
    p, r = route_of(path), route_of(route)
    return p == r or p.endswith(r)


#: Each bound of OUTPUT_BOUNDS by name (``container.name`` for a nested one).
BOUND_NAMES = tuple(".".join(p) for p in OUTPUT_BOUNDS)
_NESTED = tuple((p[0], p[1]) for p in OUTPUT_BOUNDS if len(p) == 2)
#: Containers of nested bounds, in order, each with the bound added to it (its first).
_CONTAINERS: dict[str, str] = {}
for _c, _n in _NESTED:
    _CONTAINERS.setdefault(_c, _n)
#: Spellings of one container (a body naming one group twice is refused).
_GROUPS = tuple(
    tuple(c for c, g in CONTAINERS if g == group)
    for group in dict.fromkeys(g for _, g in CONTAINERS)
)
# Why a body a cap matches cannot be capped (the native reader's words).
CHOICES_REFUSED = "asks for n or best_of choices that are not a positive integer"
TOO_MANY_CHOICES = "asks for more choices (n, best_of) than the cap has tokens"
REPEATED_CONTAINER = "names an object of output bounds twice"


#: Route endings of APIs that produce no text, whose bodies a cap adds no bound to (their
#: servers refuse a field they do not know): the core's table.
_NO_OUTPUT: tuple[str, ...] = tuple(_NO_TEXT_ROUTES)
#: Bedrock model ids (parts of) of models that produce no text: embeddings, images, video.
_NO_OUTPUT_MODELS = ("embed", "image", "nova-canvas", "nova-reel", "stability.")


def output_field(path: str) -> str | None:
    """The body field that bounds output on this route's API (``container.name`` for a
    nested one); None on an API that produces no text, or manages batches and files
    (nothing is added there)."""
    if _spends_no_tokens(path):
        return None
    path = route_of(path)
    if path.endswith("/responses"):
        return "max_output_tokens"
    if path.endswith("/chat/completions"):
        return "max_completion_tokens"
    if path.endswith((":generatecontent", ":streamgeneratecontent")):
        return "generationConfig.maxOutputTokens"
    if path.endswith(("/converse", "/converse-stream")):
        return "inferenceConfig.maxTokens"
    if path.endswith(_NO_OUTPUT):
        return None
    if path.endswith(("/invoke", "/invoke-with-response-stream")) and "/model/" in path:
        # Bedrock's InvokeModel: the body is the model's own; its id (or an inference
        # profile's ARN naming it) is in the path.
        model = path[path.index("/model/") + 7 : path.rindex("/")]
        if any(m in model for m in _NO_OUTPUT_MODELS):
            return None
        if "meta.llama" in model:
            return "max_gen_len"
        if "amazon.titan-text" in model or "amazon.titan-tg1" in model:
            return "textGenerationConfig.maxTokenCount"
        if "amazon.nova" in model:  # Nova's own body bounds it there, as Converse does
            return "inferenceConfig.maxTokens"
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
    nested: Mapping[tuple[str, str], Sequence[Any]] | None = None,
) -> tuple[Capped | None, dict[str | tuple[str, str], int]]:
    """Bound the body's output at ``limit`` for the whole call, in place: what was done
    (None: nothing) and the fields written (``(container, name)`` for a nested one, as
    ``spliced`` takes them). ``repeated``: every value of a top-level key the body's
    bytes repeat (``body`` holds the last); any one the cap replaces writes them all, so
    a parser keeping the first of a repeated key sees the cap too. ``nested``: every
    value of each nested bound (default: ``body``'s). Raises :class:`CapNotApplied` when
    the body's choices cannot share the cap or it names a container twice."""
    rep = repeated or {}

    def values(k: str) -> Sequence[Any]:
        return rep.get(k) or ((body[k],) if k in body else ())

    if nested is None:
        nested = {
            (c, n): (d[n],)
            for c, n in _NESTED + NESTED_CHOICES
            if type(d := body.get(c)) is dict and n in d
        }
    choices = 1
    for vals in _choice_values(body, values, nested):
        for v in vals:
            if v is None:  # the API's default: one choice
                continue
            if type(v) is not int or v < 1:
                raise CapNotApplied(CHOICES_REFUSED)
            choices = max(choices, v)
    per = limit // choices
    if per == 0:
        raise CapNotApplied(TOO_MANY_CHOICES)
    for group in _GROUPS:
        if sum(len(values(c)) for c in group) > 1:
            raise CapNotApplied(REPEATED_CONTAINER)
    fields: dict[str | tuple[str, str], int] = {}
    done: Capped | None = None
    for i, p in enumerate(OUTPUT_BOUNDS):
        vals = values(p[0]) if len(p) == 1 else nested.get((p[0], p[1]), ())
        over = [v for v in vals if _over(v, per)]
        if over:
            v = over[-1]
            fields[p[0] if len(p) == 1 else (p[0], p[1])] = per
            asked = v if not isinstance(v, bool) and isinstance(v, int) and v >= 0 else None
            done = Capped(BOUND_NAMES[i], asked, per)
    added: int | None = None
    for c, name in _CONTAINERS.items():
        if c not in body:
            continue
        d = body[c]
        if type(d) is dict and any(n in d for c2, n in _NESTED if c2 == c):
            continue
        fields[(c, name)] = per
        added = max(added or 0, BOUND_NAMES.index(f"{c}.{name}"))
    route = output_field(path)
    if (
        route is not None
        and not any(f in body for f in OUTPUT_FIELDS)
        and not any(c in body for c in _CONTAINERS)
    ):
        c, _, name = route.rpartition(".")
        fields[(c, name) if c else route] = per
        added = BOUND_NAMES.index(route)
    for key in fields:  # the body as sent
        if isinstance(key, tuple):
            d = body.get(key[0])
            if type(d) is dict:
                d[key[1]] = per
            else:
                body[key[0]] = {key[1]: per}
        else:
            body[key] = per
    if done is None and added is not None:
        done = Capped(BOUND_NAMES[added], None, per)
    return done, fields


def _choice_values(
    body: dict[str, Any],
    values: Callable[[str], Sequence[Any]],
    nested: Mapping[tuple[str, str], Sequence[Any]],
) -> Iterator[Sequence[Any]]:
    """Every value of each choice count: top-level ones, and nested ones (every value
    ``nested`` holds, else the body's own: a caller that did not read them from the
    bytes still has the last one counted)."""
    for k in CHOICES:
        yield values(k)
    for c, n in NESTED_CHOICES:
        got = nested.get((c, n))
        if got:
            yield got
        elif type(d := body.get(c)) is dict and n in d:
            yield (d[n],)


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
    what was done, or None when no cap applied (:class:`CapNotApplied` as
    :func:`cap_fields` raises it)."""
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
        nested: Mapping[tuple[str, str], Sequence[Any]] | None = None,
    ) -> tuple[Capped | None, dict[str | tuple[str, str], int]]:
        """``cap_fields`` with this table's limit for the call (nothing when none)."""
        model = body.get("model")
        models = repeated.get("model") if repeated else None
        if models:
            limit = self.limit_any(path, models, task)
        else:
            limit = self.limit(path, model if type(model) is str else None, task)
        if limit is None:
            return None, {}
        return cap_fields(body, path, limit, repeated, nested)
