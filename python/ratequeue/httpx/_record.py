"""What one call through the transport is: its public record and what it holds in flight."""

from __future__ import annotations

import json
import json.scanner
from collections.abc import Callable
from typing import Any

from .._ratequeue import _read_usage
from ._budget import CallBudget, SubCall
from ._caps import Capped
from ._estimate import Estimate
from ._headers import RateLimitHeaders
from ._usage import Usage, usage_from_json

__all__ = ["CallRecord"]

_Estimator = Callable[[dict[str, Any] | None, str], Estimate]
_FIELDS = (
    "request_id",
    "path",
    "model",
    "estimate",
    "capped",
    "priority",
    "task",
    "provider",
    "waited",
    "http_seconds",
    "status",
    "usage",
    "settled",
    "rate_limits",
    "charged",
    "clamped",
)


#: The C scanner of the json module: one call decodes a value (``json.loads`` adds two
#: Python frames and two regex matches around it).
SCAN: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
_JSON_SPACE = " \t\n\r"
_new = tuple.__new__


def json_object(data: bytes) -> dict[str, Any] | None:
    """The body as a JSON object, or None (not JSON, or not an object)."""
    try:
        s = data.decode()
    except UnicodeDecodeError:
        s = ""
    if s[:1] == "{":
        # UTF-8 without leading space (what clients send) straight to the scanner.
        try:
            parsed, end = SCAN(s, 0)
        except (StopIteration, ValueError, RecursionError):
            return None
        if end != len(s) and s[end:].strip(_JSON_SPACE):
            return None
        return parsed if type(parsed) is dict else None
    try:
        parsed = json.loads(data)  # other encodings, a BOM, leading space, lone surrogates
    except (ValueError, RecursionError):
        return None
    return parsed if type(parsed) is dict else None


def json_usage(body: bytes) -> Usage | None:
    """The usage of a JSON body, exactly as a full parse finds it (None when there is
    none or the body is not JSON, however nested): read natively in one pass
    (``ratequeue_core::llm``), and by :func:`json_usage_py` where that reader defers
    (other encodings, nesting past 128, counts past 64 bits)."""
    if type(body) is bytes:
        u = _read_usage(body)
        if u is None:
            return None
        if u is not False:
            return _new(Usage, u)
    return json_usage_py(body)


def json_usage_py(body: bytes) -> Usage | None:
    """The reference of :func:`json_usage`: ``usage_from_json`` over a full ``json``
    parse; a UTF-8 object that cannot name ``usage`` (no ``"usage"``, no escape that
    could spell it) is not parsed."""
    if body[:1] != b"{":
        return usage_from_json(json_object(body))
    if b'"usage"' not in body and b"\\u" not in body:
        return None
    # json_object and usage_from_json inline for what providers send: a UTF-8 object
    # with OpenAI chat's usage names; anything else takes the general path.
    try:
        s = body.decode()
        parsed, end = SCAN(s, 0)
    except (UnicodeDecodeError, StopIteration, ValueError, RecursionError):
        return usage_from_json(json_object(body))
    if end != len(s) and s[end:].strip(_JSON_SPACE):
        return None
    if type(parsed) is not dict:
        return None
    u = parsed.get("usage")
    if type(u) is dict:
        g = u.get
        if g("input_tokens") is None and g("output_tokens") is None:
            i = g("prompt_tokens")
            o = g("completion_tokens")
            if type(i) is int and type(o) is int and i >= 0 and o >= 0:
                return _new(Usage, (i, o))
    return usage_from_json(parsed)


def model_of(body: dict[str, Any] | None) -> str | None:
    """The body's ``model`` when it is a string."""
    if body is None:
        return None
    m = body.get("model")
    return m if type(m) is str else None


class CallRecord:
    """One call through the transport, in ``response.extensions["ratequeue"]``.

    ``waited`` is the queue wait and ``http_seconds`` the time from sending to the
    response headers, measured apart; ``usage`` is set when the call settles (the end of
    the body or stream), from the provider's own count. ``charged`` is what the limiter
    was charged per unit: the estimate at acquire, the usage once settled; an estimate
    above what the limiter can ever grant (its burst) is charged that instead, and its
    units are in ``clamped`` (a reported usage is charged as reported). ``estimate`` and
    ``model`` are read from the request body when first asked for if the call did not
    need them.
    """

    __slots__ = (
        "_charged",
        "_correction",
        "_estimate",
        "_model",
        "_pending",
        "_usage",
        "_usage_body",
        "capped",
        "clamped",
        "http_seconds",
        "path",
        "priority",
        "provider",
        "rate_limits",
        "request_id",
        "settled",
        "status",
        "task",
        "waited",
    )

    def __init__(
        self,
        request_id: str,
        path: str,
        model: str | None,
        estimate: Estimate | None,
        capped: Capped | None,
        priority: str | None,
        task: str | None,
        provider: str | None = None,
        waited: float = 0.0,
        http_seconds: float | None = None,
        status: int | None = None,
        usage: Usage | None = None,
        settled: bool = False,
        rate_limits: RateLimitHeaders | None = None,
        charged: dict[str, int] | None = None,
        clamped: tuple[str, ...] = (),
        *,
        body: tuple[bytes | None, _Estimator] | None = None,
    ) -> None:
        self.request_id = request_id
        self.path = path
        self._model = model
        self._estimate = estimate
        self.capped = capped
        self.priority = priority
        self.task = task
        self.provider = provider
        self.waited = waited
        self.http_seconds = http_seconds
        self.status = status
        self._usage = usage
        self._usage_body: bytes | None = None
        self.settled = settled
        self.rate_limits = rate_limits
        self._charged = dict(charged) if charged else {}
        self._correction: dict[str, int] | None = None
        self.clamped = clamped
        self._pending = body if estimate is None else None

    def _resolve(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        data, estimator = pending
        body = json_object(data) if data else None
        self._model = model_of(body)
        self._estimate = estimator(body, self.path)

    @property
    def model(self) -> str | None:
        """The request's ``model``, if its body named one."""
        if self._pending is not None:
            self._resolve()
        return self._model

    @model.setter
    def model(self, value: str | None) -> None:
        self._resolve()
        self._model = value

    @property
    def estimate(self) -> Estimate:
        """Tokens the call may use, estimated before sending (prompt + max output)."""
        if self._pending is not None:
            self._resolve()
        assert self._estimate is not None
        return self._estimate

    @estimate.setter
    def estimate(self, value: Estimate) -> None:
        self._pending = None
        self._estimate = value

    @property
    def usage(self) -> Usage | None:
        """Tokens the call really used, from the provider's count (None: not settled, or
        no count reported); read from the JSON body when first asked for if the call did
        not need it to settle."""
        if self._usage_body is not None:
            body, self._usage_body = self._usage_body, None
            self._usage = json_usage(body)
        return self._usage

    @usage.setter
    def usage(self, value: Usage | None) -> None:
        self._usage_body = None
        self._usage = value

    @property
    def charged(self) -> dict[str, int]:
        """Per unit, what the limiter was charged for this call (a copy)."""
        if self._correction:
            return {**self._charged, **self._correction}
        return dict(self._charged)

    def _astuple(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f) for f in _FIELDS)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, CallRecord)
        return self._astuple() == other._astuple()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        inner = ", ".join(f"{f}={getattr(self, f)!r}" for f in _FIELDS)
        return f"CallRecord({inner})"


_NO_CHAIN: list[CallBudget] = []  # never changed: a call outside budgets shares it
#: What a call owes its ledger when it used nothing: a release (else its ``Usage``).
_RELEASE = object()
#: What a call owes its ledger when it keeps its estimate (a body without a usage).
_ESTIMATE = object()


class _Call(CallRecord):
    """The record of a call in flight, with what it holds (settled exactly once)."""

    __slots__ = (
        "_account",
        "_async",
        "_bodyless",
        "_chain",
        "_done",
        "_held",
        "_kw",
        "_linked",
        "_once",
        "_owed",
        "_permit",
        "_provider",
        "_request",
        "_retried",
        "_rkey",
        "_sub",
        "_tokenless",
    )

    def __init__(
        self,
        request: Any,
        request_id: str,
        path: str,
        model: str | None,
        estimate: Estimate | None,
        capped: Capped | None,
        priority: str | None,
        task: str | None,
        pending: tuple[bytes | None, _Estimator] | None,
        costs: dict[str, int],
        clamped: tuple[str, ...],
        kw: dict[str, Any],
        account: str,
        is_async: bool,
        tokenless: bool = False,
        bodyless: bool = False,
    ) -> None:
        # Every slot set here, without CallRecord.__init__: this runs on every call.
        self.request_id = request_id
        self.path = path
        self._model = model
        self._estimate = estimate
        self._pending = pending
        self.capped = capped
        self.priority = priority
        self.task = task
        self.provider = None
        self.waited = 0.0
        self.http_seconds = None
        self.status = None
        self._usage = None
        self._usage_body = None
        self.settled = False
        self.rate_limits = None
        self._charged = costs
        self._correction = None
        self.clamped = clamped
        self._request = request
        self._permit: Any = None
        self._provider: Any = None
        self._sub: SubCall | None = None
        self._chain: list[CallBudget] = _NO_CHAIN
        self._held = False
        self._done = False
        self._kw = kw
        self._account = account
        self._async = is_async
        # Spends none of the model's tokens (manages batches or files, counts tokens): the
        # usage its response reports (a batch's own) is not its own.
        self._tokenless = tokenless
        # Sends no body: a response that reports no usage settles it to nothing.
        self._bodyless = bodyless
        self._owed: object = None
        self._retried = False
        self._linked: _Call | None = None  # a creation whose ledger part this call pays
        # The (host, id) of a background response its creation's open stream named.
        # (``()`` once let go: its stream's end settles it; ``(b"", "")`` once a poll
        # took it: the poll settles it.)
        self._rkey: tuple[bytes, str] | tuple[()] | None = None
        self._once = [None]  # popped by the one caller that settles


#: The slots ``_Call.__init__`` sets to the same value for every call (the native
#: ``_RequestReader.prepare`` sets them from here, the others from the request; a test
#: holds the two records equal slot by slot).
_CONSTANT_SLOTS = (
    ("provider", None),
    ("waited", 0.0),
    ("http_seconds", None),
    ("status", None),
    ("_usage", None),
    ("_usage_body", None),
    ("settled", False),
    ("rate_limits", None),
    ("_correction", None),
    ("_permit", None),
    ("_provider", None),
    ("_sub", None),
    ("_chain", _NO_CHAIN),
    ("_held", False),
    ("_done", False),
    ("_owed", None),
    ("_retried", False),
    ("_linked", None),
    ("_rkey", None),
)
