"""The request side of the transport: what a call is before it is sent.

Its own headers read (and removed), the body capped and estimated when anything needs
it, its costs per unit planned, the budget charged, the call's record made. One native
call (``_RequestReader.read``) does the reading on the common path; the Python
reference here does it wherever that reader defers (other header types, an estimator
other than the character count, caps, a stream to ask for its usage, bodies only a full
parse can decide).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any, Literal
from urllib.parse import unquote

from .._ratequeue import Histogram, Limiter, Policy, _cap_output, _RequestReader, _spends_no_tokens
from .._ratequeue import _read_call_headers as _call_headers
from .._ratequeue import _read_request as _body_facts
from ..pool import Pool
from . import _budget, _wire
from ._body import nested_values, repeated, replace_body, set_body
from ._budget import _CURRENT as _CURRENT_BUDGET
from ._caps import BOUND_NAMES, Cap, CapNotApplied, Capped, CapTable, output_field
from ._context import _EMPTY, _OPTIONS, current_options
from ._estimate import (
    _CHARS,
    CHOICES,
    NESTED_CHOICES,
    OUTPUT_BOUNDS,
    OUTPUT_FIELDS,
    Estimate,
    TokenEstimator,
    chars_estimate,
)
from ._record import _CONSTANT_SLOTS, _Call, json_object
from ._wire import _TRIPLES, header_list, new_id

_new = tuple.__new__
_NOTHING = Estimate(0, 0)  # a call that spends no tokens
PRIORITY_HEADER = "x-ratequeue-priority"
TASK_HEADER = "x-ratequeue-task"
ACCOUNT_HEADER = "x-ratequeue-account"
_OWN_HEADERS = (PRIORITY_HEADER, TASK_HEADER, ACCOUNT_HEADER)
# Request headers the transport reads, by lower-case name: 0-2 its own (removed before
# sending), 3 the SDK's idempotency key, 4 the body's length; 5 read by nobody.
_READ = {
    b"x-ratequeue-priority": 0,
    b"x-ratequeue-task": 1,
    b"x-ratequeue-account": 2,
    b"idempotency-key": 3,
    b"content-length": 4,
}
_READ_MAX = 512


def _read_request(
    hl: list[tuple[bytes, bytes, bytes]],
) -> tuple[str | None, str | None, str | None, str | None, bytes | None]:
    """The headers the transport reads, by name (``_READ``; names seen are added to it
    as read by nobody, up to ``_READ_MAX``): priority, task, account, request id and
    content length."""
    out: list[Any] = [None, None, None, None, None]
    for _, lk, v in hl:
        i = _READ.get(lk)
        if i is None:
            if len(_READ) < _READ_MAX:  # names come from callers: the table stays bounded
                _READ[lk] = 5
            continue
        if i == 4:
            out[4] = v
        elif i != 5:
            out[i] = v.decode("latin-1")
    return out[0], out[1], out[2], out[3], out[4]


# Where each unit's cost is in (requests, tokens, input_tokens, output_tokens); any other
# unit costs 1 per call.
_UNIT_INDEX = {"requests": 0, "tokens": 1, "input_tokens": 2, "output_tokens": 3}
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_ADD = {f: i for i, f in enumerate(BOUND_NAMES)}
_MODEL = ("model",)
# Nested bounds and nested choice counts (Gemini's candidateCount): every value of each.
_NESTED = tuple((p[0], p[1]) for p in OUTPUT_BOUNDS if len(p) == 2) + NESTED_CHOICES
_CONTAINERS = tuple(dict.fromkeys(c for c, _ in _NESTED))
# Every value of each, when one is repeated.
_CAP_KEYS = (*OUTPUT_FIELDS, *CHOICES, *_CONTAINERS, "model")
# Multipart form fields that name a bound (or a choice count, or a container of bounds).
_FORM_BOUNDS = frozenset((*OUTPUT_FIELDS, *CHOICES, *_CONTAINERS))
_BOUNDARY = re.compile(r'boundary\s*=\s*(?:"([^"]+)"|([^;\s]+))', re.IGNORECASE)
_FORM_NAME = re.compile(
    r'(?:^|;)\s*name(\*?)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;\s]*))', re.IGNORECASE
)
# A body read natively: model, a stream to ask for its usage, prompt and output tokens.
_Facts = tuple[str | None, bool, int, int]
# What a call read from its request: priority, task, account, request id, model,
# estimate, costs, units clamped, body, cap applied, spends no tokens, sends no body.
_Read = tuple[
    str | None,
    str | None,
    str | None,
    str | None,
    str | None,
    Estimate | None,
    dict[str, int],
    tuple[str, ...],
    Any,
    Capped | None,
    bool,
    bool,
]


def _content(request: Any) -> bytes | None:
    """The request's body, None when it is a stream not read (RequestNotRead)."""
    try:
        return request.content  # type: ignore[no-any-return]
    except Exception:
        return None


def _sent_bytes(request: Any) -> bytes | None:
    """The bytes the transport will send: an in-memory stream's own (an event hook may
    have swapped the stream and left ``content`` stale; a redirect's stream is not read),
    else the body read, else None (a stream not read)."""
    stream = request.stream
    if type(stream).__name__ == "ByteStream":
        b = getattr(stream, "_stream", None)
        if type(b) is bytes:
            return b
    return _content(request)


def _sends_nothing(request: Any) -> bool:
    """True when the request sends no body: its stream is httpx's in-memory one, empty (a
    GET's, an empty POST's), whatever its headers or a stale ``_content`` say; any other
    stream may send bytes."""
    stream = request.stream
    if type(stream).__name__ != "ByteStream":
        return False
    b = getattr(stream, "_stream", None)
    return type(b) is bytes and not b


def _is_upload(request: Any, whole: Any) -> bool:
    """A multipart upload: labelled so, and its body a multipart one (its bytes open with
    a boundary; or not read, httpx's own multipart stream)."""
    ctype = request.headers.get("content-type", "").strip().lower()
    if not ctype.startswith("multipart/"):
        return False
    if whole is None:
        return type(request.stream).__name__ == "MultipartStream"
    return type(whole) is bytes and whole.lstrip(b"\r\n").startswith(b"--")


def _refused(request: Any, path: str, why: str) -> CapNotApplied:
    return CapNotApplied(
        f"an output cap matches {request.method} {path} but its body {why}: refused before sending"
    )


def _form_names_a_bound(request: Any, whole: Any) -> bool:
    """True when a multipart body has a form field naming an output bound by its head
    (``max_tokens``, ``max_tokens[]``, ``n``, ``generationConfig[maxOutputTokens]``), or
    its fields cannot be listed."""
    names = _form_names(request, whole)
    if names is None:
        return True
    return any(re.split(r"[\[.]", n, maxsplit=1)[0] in _FORM_BOUNDS for n in names)


def _form_names(request: Any, whole: Any) -> Iterator[str] | None:
    """The names of a multipart body's form fields: httpx's multipart stream's own, or
    read from the bytes' part headers (None: no boundary to read them by)."""
    if whole is None:
        fields = getattr(request.stream, "fields", None)
        if not isinstance(fields, list):
            return None
        return (str(getattr(f, "name", "")) for f in fields)
    m = _BOUNDARY.search(request.headers.get("content-type", ""))
    if m is None:
        return None
    return _part_names(whole, b"--" + (m.group(1) or m.group(2)).encode("latin-1"))


def _part_names(data: bytes, delim: bytes) -> Iterator[str]:
    """The ``name`` of each part's Content-Disposition (its headers read up to 16 KiB;
    one pass over the bytes, nothing copied but the headers)."""
    at = data.find(delim)
    while at != -1:
        start = at + len(delim)
        end = start + 16384
        for blank in (b"\r\n\r\n", b"\n\n"):
            i = data.find(blank, start, end)
            if i != -1:
                end = i
        for line in data[start:end].split(b"\n"):
            head, _, params = line.partition(b":")
            if head.strip().lower() != b"content-disposition":
                continue
            for m in _FORM_NAME.finditer(params.decode("utf-8", "replace")):
                name = m.group(2) if m.group(2) is not None else m.group(3)
                if m.group(1):  # name*=utf-8''max_tokens
                    name = unquote(name.split("''", 1)[-1])
                yield name
        at = data.find(delim, start)


class _Requests:
    """The transport's request side (a base of ``RateLimitedTransport``)."""

    # Set by RateLimitedTransport.__init__.
    limit: Limiter | Policy | Pool
    upstream: Limiter | None
    units: frozenset[str]
    timeout: float | None
    priority: str | None
    estimator: Callable[[dict[str, Any] | None, str], Estimate]
    caps: tuple[Cap, ...]
    _cap_table: CapTable
    account: str | Callable[[Any], str]
    keys: Callable[[Any], Any] | None
    stream_usage: bool
    max_body: int
    uncapped: str
    _needs_body: bool
    _is_policy: bool
    _reader: _RequestReader | None = None
    ledger: Any
    wait_histogram: Histogram

    def _unit_bursts(self) -> dict[str, int]:
        """Per unit, the largest cost any route could admit (estimates are clamped to it)."""
        limiters: list[Limiter] = []
        if isinstance(self.limit, Pool):
            limiters = [p.limiter for p in self.limit.providers]
        elif self.upstream is not None:
            limiters = [self.upstream]
        out: dict[str, int] = {}
        for lim in limiters:
            per: dict[str, int] = {}
            for r in lim.rates:
                per[r.unit] = min(per.get(r.unit, r.burst), r.burst)
            for u, b in per.items():
                out[u] = max(out.get(u, 0), b)
        return out

    def _set_bursts(self) -> None:
        self._bursts = self._unit_bursts()
        # Per unit: where its cost is in (requests, tokens, input, output), -1 for 1 per
        # call; and the clamp (None: none).
        self._plan = tuple(
            (u, _UNIT_INDEX.get(u, -1), self._bursts.get(u)) for u in sorted(self.units)
        )
        self._unit_costs = {u: 1 for u in sorted(self.units)}  # a call without an estimate
        # The units a settle corrects (those that follow the tokens).
        self._token_plan = tuple((u, j) for u, j, _ in self._plan if j > 0)
        if hasattr(self, "_needs_body"):
            self._reader = self._new_reader()

    def _new_reader(self) -> _RequestReader | None:
        """The native reader of this plan (None: the Python reference prepares every call)."""
        try:
            return _RequestReader(
                self._plan,
                self._unit_costs,
                _TRIPLES,
                TokenEstimator,
                chars_estimate,
                _CHARS,
                Estimate,
                needs_body=self._needs_body,
                stream_usage=self.stream_usage,
                caps=bool(self.caps),
                max_body=self.max_body,
                replace_body=replace_body,
                # Calls outside budgets and call options, on a Limiter or Pool, without
                # caps: the whole record made natively (``prepare``).
                call=None
                if self.caps or isinstance(self.limit, Policy)
                else (
                    _Call,
                    _CURRENT_BUDGET,
                    _OPTIONS,
                    _EMPTY,
                    _wire,
                    _OWN_HEADERS,
                    _CONSTANT_SLOTS,
                ),
                # A Limiter's call granted at once takes its permit there too (a ledger
                # holds the call first: then the transport acquires).
                limiter=self.limit if type(self.limit) is Limiter and self.ledger is None else None,
            )
        except OverflowError:  # a burst past 64 bits
            return None

    def _prepare(self, request: Any, is_async: bool) -> _Call:
        """The call's record: its own headers read (and removed), the body capped and
        estimated when anything needs it, its costs planned, the budget charged."""
        r = self._reader
        if r is not None:
            call = r.prepare(
                request,
                self.estimator,
                is_async,
                self.priority,
                self.timeout,
                self.account,
                self.wait_histogram,
            )
            if call is not None:
                return call  # type: ignore[no-any-return]
        path = request.url.path
        budget = _CURRENT_BUDGET.get()
        got: _Read | None = None
        if r is not None:
            got = r.read(request, path, budget is not None, self.estimator)
        if got is None:  # the reference
            got = self._read_py(request, path, budget is not None)
        (
            priority,
            task,
            account,
            request_id,
            model,
            est,
            costs,
            clamped,
            data,
            capped,
            free,
            bare,
        ) = got
        if priority is not None or task is not None or account is not None:
            headers = request.headers
            for h in _OWN_HEADERS:
                if h in headers:
                    del headers[h]
        opts = _OPTIONS.get()
        if opts is not _EMPTY:
            priority = priority or opts.priority
            task = task or opts.task
            account = account or opts.account
        priority = priority or self.priority
        # What acquire takes: the costs, and the priority, keys and bound on the wait.
        if self._is_policy:
            kw: dict[str, Any] = dict(costs)
            kw.update(current_options().keys)
            if self.keys is not None:
                kw.update(self.keys(request))
            kw["timeout"] = self.timeout
        elif priority is not None or self.timeout is not None:
            kw = dict(costs)
            kw["timeout"] = self.timeout
            if priority is not None:
                kw["priority"] = priority
        else:
            kw = costs
        acc = self.account
        if type(acc) is not str:
            acc = acc(request) or "default"  # type: ignore[operator]
        call = _Call(
            request,
            request_id or new_id(),
            path,
            model,
            est,
            capped,
            priority,
            task,
            None if est is not None else (data, self.estimator),
            costs,
            clamped,
            kw,
            account or acc,
            is_async,
            free,
            bare,
        )
        if budget is not None:
            assert est is not None
            chain = budget.chain()
            call._sub = _budget.charge(
                chain, call.request_id, model, est.input_tokens, est.output_tokens
            )
            call._chain = chain
        return call

    def _read_py(self, request: Any, path: str, want_estimate: bool) -> _Read:
        """What ``_RequestReader.read`` gives, in Python (and the body rewritten for the
        caps and a stream's usage)."""
        headers = request.headers
        hl = headers._list if type(headers) in _TRIPLES else header_list(headers)
        own = _call_headers(hl) if type(hl) is list else None  # one native pass
        if own is None:
            own = _read_request(hl)
        priority, task, account, request_id, length = own
        data = None
        if (
            length is not None
            and (request.method in _BODY_METHODS or self.caps)  # a GET's body is capped too
            and length.isdigit()
            and int(length) <= self.max_body
        ):
            data = _sent_bytes(request) if self.caps else _content(request)
        capped = model = est = None
        clamped: tuple[str, ...] = ()
        parsed = False  # the body read as one JSON object
        # Spends none of the model's tokens: manages batches and files, or counts tokens
        # (the estimator is not asked); else, sends no body: estimated as a body not read.
        free = _spends_no_tokens(path)
        bare = not free and not data and _sends_nothing(request)
        if (
            self._needs_body
            or want_estimate
            or (data and self.stream_usage and b'"stream"' in data)
        ):
            facts: _Facts | Literal[False] | None = (None, False, 0, 0)
            if not free:
                facts = self._read_body(data, path) if data else False
            if facts and self.caps and data and not free:  # no output: nothing to cap
                on = task or _OPTIONS.get().task  # the task a cap matches
                capped, facts = self._cap(request, data, path, facts, on)
            if facts is False:  # the reference: a full parse, the estimator over it
                body = json_object(data) if data else None
                if body is not None:
                    parsed = True
                    if self.caps or "stream" in body:
                        on = task or _OPTIONS.get().task  # the task a cap matches
                        capped = self._rewrite(request, data, body, path, on)  # type: ignore[arg-type]
                    m = body.get("model")
                    model = m if type(m) is str else None
                est = _NOTHING if free else self.estimator(body, path)
            elif facts is None:  # not a JSON object
                est = self.estimator(None, path)
            else:
                parsed = bool(data)  # an empty body is not read as JSON
                model, _, i, o = facts
                est = _new(Estimate, (i, o))
            if free:
                model, est = None, _NOTHING
            costs, clamped = self._costs(est)
        else:
            costs = self._unit_costs
            if free:
                est = _NOTHING
        if not parsed and self.caps and self.uncapped == "refuse" and not free:
            self._uncapped(request, path, task, data)
        return (
            priority,
            task,
            account,
            request_id,
            model,
            est,
            costs,
            clamped,
            data,
            capped,
            free,
            bare,
        )

    def _uncapped(self, request: Any, path: str, task: str | None, data: Any) -> None:
        """Refuse a call with a body the caps could not read (not read, or not one JSON
        object) when a cap may match it, whatever its method: a body past ``max_body``
        must not carry a call around its cap. Bodies with nothing to cap pass: an empty
        one (as read, never as a Content-Length claims), or a multipart upload (by its
        bytes or its stream, never by its Content-Type alone: some servers parse any body
        as JSON)."""
        whole = data if data is not None else _sent_bytes(request)  # past max_body
        if whole == b"":
            return
        if not self._cap_table.may_match(path, task or _OPTIONS.get().task):
            return
        if _is_upload(request, whole):
            if not _form_names_a_bound(request, whole):
                return
            raise CapNotApplied(
                f"an output cap matches {request.method} {path} but its multipart body has a "
                "form field naming an output bound (max_tokens, n, ...): refused before "
                "sending (send the bound in a JSON body)"
            )
        why = (
            "is not one JSON object"
            if data
            else f"was not read (a stream, or longer than max_body={self.max_body})"
        )
        raise CapNotApplied(
            f"an output cap matches {request.method} {path} but its body {why}: refused "
            "before sending (raise max_body, send the body whole, or build the transport "
            'with uncapped="send")'
        )

    def _cap(
        self, request: Any, data: bytes, path: str, facts: _Facts, task: str | None
    ) -> tuple[Capped | None, _Facts | Literal[False]]:
        """The output cap of a body read natively, written natively (one number, or the
        field added; the other bytes kept): the cap applied and the facts of the body
        sent; False facts: the reference decides (nothing was changed)."""
        table = self._cap_table
        models = repeated(data, _MODEL).get("model") if table.by_model else None
        # A repeated model: a first-wins parser sees another one; the smallest cap of any.
        limit = table.limit_any(path, models, task) if models else table.limit(path, facts[0], task)
        if limit is None:
            return None, facts
        # No field to add (an API that produces no text): the reference decides.
        route_field = output_field(path)
        out = _cap_output(data, limit, len(_ADD) if route_field is None else _ADD[route_field])
        if out is None:  # every bound is within the cap
            return None, facts
        if out is False:
            return None, False
        if isinstance(out, str):  # the body cannot be capped: refused
            raise _refused(request, path, out)
        new, field, requested, bound = out
        sent = self._read_body(new, path)
        if not sent:
            return None, False
        replace_body(request, new)
        return Capped(BOUND_NAMES[field], requested, bound), sent

    def _read_body(self, data: Any, path: str) -> _Facts | Literal[False] | None:
        """The body's model and estimate read natively in one pass (``(model, stream,
        input, output)``, or None when it is not a JSON object), when the estimate is the
        character count; False: parse it in Python."""
        e = self.estimator
        if type(e) is not TokenEstimator:
            if e is not chars_estimate:
                return False
            e = _CHARS
        if e._encoding is not None or not e._started or type(data) is not bytes:
            return False
        read = _body_facts(data, e.chars_per_token, e.default_output(path))
        if read and read[1] and self.stream_usage and path.endswith("/chat/completions"):
            return False  # a stream to ask for its usage: the body is rewritten
        return read

    def _rewrite(
        self, request: Any, data: bytes, body: dict[str, Any], path: str, task: str | None
    ) -> Capped | None:
        """Apply the output caps and ask a stream for its usage: the body and the request
        rewritten in place when a field changed; the cap applied, if any."""
        fields: dict[str | tuple[str, str], Any] = {}
        capped = None
        if self.caps:
            nested = None
            if any(c in body for c in _CONTAINERS):
                nested = nested_values(data, _NESTED)
            try:
                capped, written = self._cap_table.apply_fields(
                    body, path, task, repeated(data, _CAP_KEYS), nested
                )
            except CapNotApplied as e:
                raise _refused(request, path, str(e)) from None
            fields.update(written)
        if body.get("stream") is True and self._stream_opts(body, path):
            fields["stream_options"] = body["stream_options"]
        if fields:
            set_body(request, data, body, fields)
        return capped

    def _stream_opts(self, body: dict[str, Any], path: str) -> bool:
        """Ask a streamed chat call (``"stream": true``) for its usage in the last event;
        True if the body changed."""
        if not self.stream_usage or not path.endswith("/chat/completions"):
            return False
        so = body.get("stream_options")
        if isinstance(so, dict) and so.get("include_usage") is True:
            return False
        body["stream_options"] = {**(so if isinstance(so, dict) else {}), "include_usage": True}
        return True

    def _costs(self, est: Estimate) -> tuple[dict[str, int], tuple[str, ...]]:
        """Per unit, what a call of this estimate takes; clamped to the burst (never more
        than the limiter can grant), and the units clamped."""
        i, o = est
        vals = (1, i + o, i, o)
        out = {}
        clamped: tuple[str, ...] = ()
        for u, j, b in self._plan:
            c = 1 if j < 0 else vals[j]
            if b is not None and c > b:
                c = b
                clamped += (u,)
            out[u] = c
        return out, clamped
