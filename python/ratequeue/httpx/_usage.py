"""Real usage from a response: JSON bodies and Server-Sent Events, read as they pass.

OpenAI chat (``usage.prompt_tokens`` / ``completion_tokens``), OpenAI responses and
Anthropic (``usage.input_tokens`` / ``output_tokens``). Streams: OpenAI chat's final
chunk with ``usage``, the responses API's ``response.completed`` event, Anthropic's
``message_start`` (input) and ``message_delta`` (output, cumulative); a chat chunk's
usage is final once no choice in it is still streaming (vLLM's continuous usage reports
a count so far in every chunk). The SSE parser keeps at most one partial event of at
most ``max_event`` bytes (3 while skipping); a longer event is skipped to its end, its
usage unread, never buffered; the work per chunk is proportional to the chunk (natively).
A background response's stream names its id in its first events (``response.created``):
kept, should the stream be cut before its usage.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from .._ratequeue import _read_usage, _SSEFrames

__all__ = ["SSEUsage", "Usage", "usage_from_json", "usage_of", "waiting_response_id"]


#: The events read: those naming a usage object, or a background response (its id).
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{|"background"\s*:\s*true')

#: A response not run yet: its creation's answer.
_WAITING = ("queued", "in_progress")
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_MAX_ID = 256
#: Events of a background response's stream that name it before it has run.
_STARTED = ("response.created", "response.queued", "response.in_progress")
#: Events that end a response's stream (its usage final, if any).
_ENDED = ("response.completed", "response.incomplete", "response.failed", "response.cancelled")


def waiting_response_id(body: Any) -> str | None:
    """The id of a response not run yet (``status`` queued or in progress; an id of
    letters, digits, ``_`` and ``-``), or None."""
    if type(body) is not dict or body.get("status") not in _WAITING:
        return None
    rid = body.get("id")
    if type(rid) is not str or not 0 < len(rid) <= _MAX_ID or not _ID_CHARS.issuperset(rid):
        return None
    return rid


class Usage(NamedTuple):
    """Tokens a call really used."""

    input_tokens: int
    output_tokens: int

    @property
    def tokens(self) -> int:
        """Input plus output."""
        return self.input_tokens + self.output_tokens


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


_new = tuple.__new__


def usage_of(u: Any) -> Usage | None:
    """A ``usage`` object in either dialect, or None."""
    if not isinstance(u, dict):
        return None
    g = u.get
    i = g("input_tokens")
    o = g("output_tokens")
    if i is None and o is None:
        i = g("prompt_tokens")
        o = g("completion_tokens")
        if type(i) is int and type(o) is int and i >= 0 and o >= 0:
            return _new(Usage, (i, o))
        i = i if type(i) is int and i >= 0 else None
        o = o if type(o) is int and o >= 0 else None
        if i is None and o is None:
            return None
        return _new(Usage, (i or 0, o or 0))
    i = i if type(i) is int and i >= 0 else None
    o = o if type(o) is int and o >= 0 else None
    if i is None and o is None:
        # Neither field usable: the OpenAI chat names may still be.
        i = g("prompt_tokens")
        o = g("completion_tokens")
        i = i if type(i) is int and i >= 0 else None
        o = o if type(o) is int and o >= 0 else None
        if i is None and o is None:
            return None
    else:
        # Anthropic counts cached input apart from input_tokens: all of it was sent.
        for extra in ("cache_creation_input_tokens", "cache_read_input_tokens"):
            e = _int(g(extra))
            if e:
                i = (i or 0) + e
    return _new(Usage, (i or 0, o or 0))


def usage_from_json(body: Any) -> Usage | None:
    """Usage of a parsed response body (chat, responses or messages), or None."""
    if not isinstance(body, dict):
        return None
    u = usage_of(body.get("usage"))
    if u is None and isinstance(body.get("response"), dict):
        u = usage_of(body["response"].get("usage"))
    return u


def _chat_final(choices: Any) -> bool:
    """True when a chat chunk's usage is the call's whole count: no choice in it, or
    every one finished (OpenAI's usage chunk has ``"choices": []``; some providers put
    the usage on the chunk that finishes the choice)."""
    if not isinstance(choices, list) or not choices:
        return True
    return all(isinstance(c, dict) and c.get("finish_reason") is not None for c in choices)


def _no_choices(payload: bytes) -> bool:
    """True when a payload's choices are absent or, at most once, ``"choices":[]``
    (whatever their nesting: either way the top level has no choice); anything else is
    left to the full parse."""
    n = payload.count(b'"choices"')
    return n == 0 or (n == 1 and b'"choices":[]' in payload)


class SSEUsage:
    """An incremental SSE reader that finds the usage in a stream of byte chunks.

    ``feed(chunk)`` as chunks pass; ``usage`` is the usage seen so far and ``final`` is
    True once the event that completes it arrived. Only events mentioning ``usage`` are
    parsed as JSON.
    """

    __slots__ = (
        "_buf",
        "_events",
        "_frames",
        "_input",
        "_output",
        "_skip",
        "done",
        "final",
        "max_event",
        "response_id",
    )

    def __init__(self, max_event: int = 1 << 20, *, native: bool = True) -> None:
        self._buf = b""
        self._skip = False
        self._input: int | None = None
        self._output: int | None = None
        self.final = False
        self.max_event = max_event
        # A background response's id, from the events that start it; ``done`` once an
        # event ending it came (its usage final, if it had one).
        self.response_id: str | None = None
        self.done = False
        self._events = 0
        # The framing done natively (``ratequeue_core::llm::sse``); ``native=False``:
        # the reference below, chunk by chunk in Python.
        self._frames = _SSEFrames(max_event) if native else None

    @property
    def events(self) -> int:
        """Events read (complete, not skipped)."""
        f = self._frames
        return self._events if f is None else f.events

    @property
    def usage(self) -> Usage | None:
        """The usage seen so far (None before any)."""
        if self._input is None and self._output is None:
            return None
        return Usage(self._input or 0, self._output or 0)

    def feed(self, chunk: bytes) -> None:
        """Read one chunk; at most ``max_event`` bytes of one event are kept."""
        f = self._frames
        if f is not None:
            found = f.feed(chunk) if type(chunk) is bytes else f.feed(bytes(chunk))
            if found is not None:
                for payload in found:
                    self._use(payload)
            return
        data = self._buf + chunk if self._buf else chunk
        start = 0
        if b"\r" not in data:
            # Events end at "\n\n" only. The usage pattern is searched ahead once, not
            # in every event: an event before the next match cannot hold one (a match
            # inside an event is also one in the whole chunk).
            find = data.find
            search = _USAGE_OBJECT.search
            ahead = search(data)
            while True:
                end = find(b"\n\n", start)
                if end == -1:
                    break
                if self._skip:
                    self._skip = False
                else:
                    self._events += 1
                    if ahead is not None and ahead.start() < end:
                        if search(data, start, end) is not None:
                            self._parse(data[start:end])
                        ahead = search(data, end)
                start = end + 2
        else:
            while True:
                end = data.find(b"\n\n", start)
                sep = 2
                alt = data.find(b"\r\n\r\n", start)
                if alt != -1 and (end == -1 or alt < end):
                    end, sep = alt, 4
                if end == -1:
                    break
                if self._skip:
                    self._skip = False
                else:
                    self._event(data[start:end])
                start = end + sep
        rest = data[start:]
        if len(rest) > self.max_event:
            # An event longer than the bound: drop it up to its end.
            # (the last bytes stay: a separator may straddle two chunks).
            self._skip = True
            rest = rest[-3:]
        self._buf = rest

    def _event(self, raw: bytes) -> None:
        self._events += 1
        if _USAGE_OBJECT.search(raw) is not None:
            self._parse(raw)

    def _parse(self, raw: bytes) -> None:
        """An event that mentions a usage object: its JSON read."""
        self._payload(
            b"\n".join(
                line[5:].lstrip(b" ") for line in raw.splitlines() if line.startswith(b"data:")
            )
        )

    def _use(self, payload: bytes) -> None:
        """The usage of an event's payload: an event without a ``type`` and without
        choices (OpenAI chat's usage chunk, ``"choices":[]``) read natively as a response
        body is (its usage is final); any other by :meth:`_payload`."""
        if b'"type"' not in payload and b"\\u" not in payload and _no_choices(payload):
            u = _read_usage(payload)
            if u is None:
                return
            if u is not False:
                self._input, self._output = u
                self.final = True
                return
        self._payload(payload)

    def _payload(self, payload: bytes) -> None:
        """The reference: an event's payload parsed as JSON, its usage by its type."""
        try:
            ev = json.loads(payload)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            return
        if not isinstance(ev, dict):
            return
        kind = ev.get("type")
        if kind in _STARTED:
            r = ev.get("response")
            if type(r) is dict and r.get("background") is True:
                rid = waiting_response_id(r)
                if rid is not None:
                    self.response_id = rid
        elif kind in _ENDED:
            self.response_id = None  # done: nothing to wait for
            self.done = True
        if kind == "message_start":  # Anthropic: input (and a first output count)
            msg = ev.get("message")
            u = usage_of(msg.get("usage")) if isinstance(msg, dict) else None
            if u is not None:
                self._input, self._output = u.input_tokens, u.output_tokens
            return
        if kind == "message_delta":  # Anthropic: the cumulative output
            raw_u = ev.get("usage")
            if isinstance(raw_u, dict):
                o = _int(raw_u.get("output_tokens"))
                if o is not None:
                    self._output = o
                i = _int(raw_u.get("input_tokens"))
                if i:
                    self._input = i
                self.final = True
            return
        u = usage_from_json(ev)
        if u is not None:
            self._input, self._output = u.input_tokens, u.output_tokens
            if kind is None:
                # A chat chunk still streaming a choice reports a count so far (vLLM's
                # continuous_usage_stats): final once none is streaming.
                self.final = _chat_final(ev.get("choices"))
            else:
                self.final = kind in (
                    "response.completed",
                    "response.incomplete",
                    "response.failed",
                )
