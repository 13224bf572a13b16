"""Cost of a call before it is sent: prompt tokens + the most output tokens it may produce.

The prompt is the text of the request body's strings (messages, system, input, tools;
not ``model``, ``role``, ``type`` nor base64 data such as images): counted by tiktoken when it is
installed and its encoding loads, otherwise by the documented fallback of one token per
four characters (rounded up) plus four per message. The output is the request's
``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens`` / ``max_gen_len`` (or a
nested bound of :data:`OUTPUT_BOUNDS`: Gemini's ``generationConfig.maxOutputTokens``,
Bedrock Converse's ``inferenceConfig.maxTokens``, Nova's older ``inferenceConfig.max_new_tokens``,
Titan's ``textGenerationConfig.maxTokenCount``), or ``default_output_tokens`` when it names none
(0 on an API that produces no tokens: embeddings, moderations, token counts); times the
choices it asks for (the largest ``n``, ``best_of`` or Gemini ``candidateCount``:
:data:`CHOICES`, :data:`NESTED_CHOICES`): each choice may produce as much.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

from .._ratequeue import _CHOICES, _CONTAINERS, _NESTED_CHOICES, _OUTPUT_BOUNDS, _emits_no_tokens
from .._threads import AfterFork

__all__ = [
    "CHOICES",
    "CONTAINERS",
    "NESTED_CHOICES",
    "OUTPUT_BOUNDS",
    "OUTPUT_FIELDS",
    "Estimate",
    "Estimator",
    "TokenEstimator",
]

#: Where a body bounds a call's output, in the order the estimate reads them: a top-level
#: field ``(name,)`` or one inside a top-level object ``(container, name)``. One table,
#: the native reader's (``ratequeue_core::llm::cap::OUTPUT_BOUNDS``).
OUTPUT_BOUNDS: tuple[tuple[str, ...], ...] = tuple((c, n) if c else (n,) for c, n in _OUTPUT_BOUNDS)
#: The top-level output-bounding fields.
OUTPUT_FIELDS = tuple(p[0] for p in OUTPUT_BOUNDS if len(p) == 1)
#: Top-level fields asking for several choices (each may produce the bound's output).
CHOICES: tuple[str, ...] = tuple(_CHOICES)
#: Choice counts inside a container of bounds ``(container, name)``: Gemini's
#: ``candidateCount`` in every spelling proto3 JSON takes.
NESTED_CHOICES: tuple[tuple[str, str], ...] = tuple((c, n) for c, n in _NESTED_CHOICES)
#: Containers of nested bounds and the group of spellings each is in (a body naming one
#: group twice cannot be capped).
CONTAINERS: tuple[tuple[str, int], ...] = tuple((c, g) for c, g in _CONTAINERS)
_NESTED = tuple(p for p in OUTPUT_BOUNDS if len(p) == 2)
# NESTED_CHOICES as the estimate reads them (written out there: two containers, each
# with both spellings of Gemini's candidateCount).
_CANDIDATES = ("candidateCount", "candidate_count")
assert {(c, n) for c in ("generationConfig", "generation_config") for n in _CANDIDATES} == set(
    NESTED_CHOICES
)
_SKIP = frozenset(
    {"model", "role", "type", "id", "data", "image_url", "source", "file_data", "b64_json"}
)
_MAX_DEPTH = 64


_new = tuple.__new__


class Estimate(NamedTuple):
    """Tokens a call may use: prompt (input) and the most it may produce (output)."""

    input_tokens: int
    output_tokens: int

    @property
    def tokens(self) -> int:
        """Input plus output."""
        return self.input_tokens + self.output_tokens


class Estimator(Protocol):
    """Anything that estimates a call from its parsed JSON body (None if not JSON) and
    its path."""

    def __call__(self, body: dict[str, Any] | None, path: str) -> Estimate: ...


class _Encoding(Protocol):
    def encode(self, text: str, *, disallowed_special: Any = ...) -> list[int]: ...


def _strings(v: Any, depth: int = 0) -> Iterator[str]:
    if depth > _MAX_DEPTH:
        return
    if isinstance(v, str):
        if not v.startswith("data:"):
            yield v
    elif isinstance(v, dict):
        for k, x in v.items():
            if k not in _SKIP:
                yield from _strings(x, depth + 1)
    elif isinstance(v, list):
        for x in v:
            yield from _strings(x, depth + 1)


def _chars(v: Any, depth: int = 0) -> int:
    """Characters of the prompt strings of ``v`` (what :func:`_strings` yields, with one
    separator each), without building the text."""
    t = type(v)
    if t is str:
        return 0 if v.startswith("data:") else len(v) + 1
    if depth > _MAX_DEPTH:
        return 0
    n = 0
    depth += 1
    # Strings are counted here and only containers recurse (most values of a chat body
    # are strings or numbers); a list's dicts (messages, content parts) are read here
    # too, one frame less for each.
    if t is dict:
        for k, x in v.items():
            if k in _SKIP:
                continue
            tx = type(x)
            if tx is str:
                if not x.startswith("data:"):
                    n += len(x) + 1
            elif tx is list:
                n += _list_chars(x, depth)
            elif tx is dict:
                n += _chars(x, depth)
    elif t is list:
        n = _list_chars(v, depth - 1)
    return n


def _list_chars(v: list[Any], depth: int) -> int:
    """``_chars`` of a list at ``depth``, reading the strings of its dicts in place."""
    if depth > _MAX_DEPTH:
        return 0
    n = 0
    depth += 1
    inner = depth + 1  # the depth of what a dict of this list holds
    for x in v:
        tx = type(x)
        if tx is str:
            if not x.startswith("data:"):
                n += len(x) + 1
        elif tx is dict:
            if depth > _MAX_DEPTH:
                continue
            for k, y in x.items():
                if k in _SKIP:
                    continue
                ty = type(y)
                if ty is str:
                    if not y.startswith("data:"):
                        n += len(y) + 1
                elif ty is list:
                    n += _list_chars(y, inner)
                elif ty is dict:
                    n += _chars(y, inner)
        elif tx is list:
            n += _list_chars(x, depth)
    return n


#: A forked child makes again the loads under way at the fork.
_ESTIMATORS = AfterFork("_after_fork")


class TokenEstimator:
    """The default estimator: tiktoken when available, else ceil(chars / 4) + 4 per message.

    ``encoding`` is a tiktoken encoding name (default ``"o200k_base"``), a ready encoding
    object (anything with ``encode``), or ``None`` for the character fallback alone. A
    named encoding is loaded once, in a background thread started on first use (tiktoken
    may download its files, and no call waits for that): calls use the fallback until it
    is loaded, and for good when loading fails (not installed, no network).
    :meth:`load` waits for it.
    """

    def __init__(
        self,
        encoding: str | _Encoding | None = "o200k_base",
        *,
        default_output_tokens: int = 1024,
        chars_per_token: int = 4,
    ) -> None:
        for name, v in (
            ("default_output_tokens", default_output_tokens),
            ("chars_per_token", chars_per_token),
        ):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name}={v!r} must be an int")
        if default_output_tokens < 0 or chars_per_token < 1:
            raise ValueError("default_output_tokens must be >= 0 and chars_per_token >= 1")
        if (
            encoding is not None
            and not isinstance(encoding, str)
            and not hasattr(encoding, "encode")
        ):
            raise TypeError(f"encoding={encoding!r} must be a name, an encoding or None")
        self.default_output_tokens = default_output_tokens
        self.chars_per_token = chars_per_token
        self._name = encoding if isinstance(encoding, str) else None
        self._encoding: _Encoding | None = None if isinstance(encoding, str) else encoding
        self._loaded = threading.Event()
        self._started = not isinstance(encoding, str)
        if self._started:
            self._loaded.set()
        self._lock = threading.Lock()
        _ESTIMATORS.add(self)

    def _after_fork(self) -> None:
        """In a forked child: a free lock and event (a parent thread may have held either
        at the fork), and a load under way at the fork (its thread is the parent's)
        started again on the next use."""
        self._lock = threading.Lock()
        loaded, self._loaded = self._loaded.is_set(), threading.Event()
        if loaded:
            self._loaded.set()
        else:
            self._started = False

    def _start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._load, name="ratequeue-tiktoken", daemon=True).start()

    def _load(self) -> None:
        try:
            self._encoding = _load(self._name)
        finally:
            self._loaded.set()

    def load(self, timeout: float | None = None) -> bool:
        """Load the encoding now (waiting up to ``timeout`` s); True when tiktoken is in use."""
        self._start()
        self._loaded.wait(timeout)
        return self._encoding is not None

    @property
    def encoding(self) -> _Encoding | None:
        """The tiktoken encoding in use, or None while counting characters."""
        if not self._started:
            self._start()
        return self._encoding

    def default_output(self, path: str) -> int:
        """The output a call on ``path`` whose body names no bound is charged:
        ``default_output_tokens``, or 0 on an API that produces no tokens (embeddings,
        moderations, token counts; Bedrock's embedding models)."""
        d = self.default_output_tokens
        return 0 if d and isinstance(path, str) and _emits_no_tokens(path) else d

    def count(self, text: str) -> int:
        """Tokens of ``text``: by the encoding, or ceil(chars / chars_per_token)."""
        enc = self.encoding
        if enc is not None:
            return len(enc.encode(text, disallowed_special=()))
        return -(-len(text) // self.chars_per_token)

    def __call__(self, body: dict[str, Any] | None, path: str) -> Estimate:
        """The estimate of a call with this JSON body (None: one unknown request)."""
        if body is None:
            return Estimate(0, self.default_output(path))
        enc = self._encoding
        if enc is None and not self._started:
            enc = self.encoding
        if enc is None:
            prompt = _chars(body) - 1
            prompt = -(-prompt // self.chars_per_token) if prompt > 0 else 0
        else:
            prompt = self.count("\n".join(_strings(body)))
        g = body.get
        m = g("messages")
        if type(m) is list:
            prompt += 4 * len(m)
        else:
            m = g("input")
            prompt += 4 * len(m) if type(m) is list else 4
        # The first of OUTPUT_BOUNDS that is an int >= 0.
        v = g("max_completion_tokens")
        if type(v) is not int or v < 0:
            v = g("max_output_tokens")
            if type(v) is not int or v < 0:
                v = g("max_tokens")
                if type(v) is not int or v < 0:
                    v = g("max_gen_len")
                    if type(v) is not int or v < 0:
                        v = _nested_bound(body, -1)
                        if v < 0:
                            v = self.default_output(path)
        # Times the choices asked for: the largest n, best_of or nested count (Gemini's
        # candidateCount) that is an int >= 1.
        n = g("n")
        b = g("best_of")
        k = 1
        if (type(n) is int and n > 1) or (type(b) is int and b > 1):
            k = max(n if type(n) is int else 1, b if type(b) is int else 1)
        d = g("generationConfig")
        if type(d) is dict:
            k = _candidates(d, k)
        d = g("generation_config")
        if type(d) is dict:
            k = _candidates(d, k)
        if k > 1:
            v *= k
        return _new(Estimate, (prompt, v))


def _candidates(config: dict[str, Any], k: int) -> int:
    """The larger of ``k`` and a Gemini generation config's candidate counts (ints)."""
    for name in _CANDIDATES:
        x = config.get(name)
        if type(x) is int and x > k:
            k = x
    return k


def _nested_bound(body: dict[str, Any], default: int) -> int:
    """The first nested bound of ``body`` that is an int >= 0, else ``default``."""
    for c, n in _NESTED:
        d = body.get(c)
        if type(d) is dict:
            v = d.get(n)
            if type(v) is int and v >= 0:
                return v
    return default


def _load(name: str | None) -> _Encoding | None:
    if name is None:
        return None
    try:
        import tiktoken
    except ImportError:
        return None
    try:
        enc: _Encoding = tiktoken.get_encoding(name)
    except Exception:  # no network for the encoding files, unknown name: fall back
        return None
    return enc


def chars_estimate(body: dict[str, Any] | None, path: str) -> Estimate:
    """The character fallback alone (no tiktoken): ceil(chars / 4) + 4 per message."""
    return _CHARS(body, path)


_CHARS = TokenEstimator(None)
_DEFAULT: list[TokenEstimator] = []


def default_estimator() -> Callable[[dict[str, Any] | None, str], Estimate]:
    """The shared default :class:`TokenEstimator` (tiktoken's ``o200k_base`` if it loads):
    the first one made (no lock, which a forked child could inherit held: threads racing
    here may each make one, loading nothing yet, and all get the first)."""
    if not _DEFAULT:
        _DEFAULT.append(TokenEstimator())
    return _DEFAULT[0]
