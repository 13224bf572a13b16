"""A request body rewritten in place: only the top-level fields that change are written
again, the rest of the bytes stay as the SDK serialized them."""

from __future__ import annotations

import json
import json.decoder
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._record import SCAN
from ._wire import header_list

_WS = re.compile(r"[ \t\n\r]*")
_scanstring: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]


def _skip(s: str, pos: int = 0) -> int:
    """Where the JSON whitespace from ``pos`` ends."""
    m = _WS.match(s, pos)
    return m.end() if m is not None else pos


def _dumps(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _members(s: str) -> tuple[dict[str, list[tuple[int, int]]], int] | None:
    """Where the value of each top-level member of the JSON object ``s`` is (every
    occurrence of a key), and where its closing brace is; None if ``s`` is not one."""
    ws = _skip
    spans: dict[str, list[tuple[int, int]]] = {}
    try:
        pos = ws(s)
        if s[pos] != "{":
            return None
        pos = ws(s, pos + 1)
        if s[pos] == "}":
            return spans, pos
        while True:
            if s[pos] != '"':
                return None
            key, pos = _scanstring(s, pos + 1)
            pos = ws(s, pos)
            if s[pos] != ":":
                return None
            pos = ws(s, pos + 1)
            _, end = SCAN(s, pos)
            spans.setdefault(key, []).append((pos, end))
            pos = ws(s, end)
            c = s[pos]
            if c == "}":
                return (spans, pos) if not s[pos + 1 :].strip(" \t\n\r") else None
            if c != ",":
                return None
            pos = ws(s, pos + 1)
    except (IndexError, StopIteration, ValueError, RecursionError):
        return None


def _object(data: bytes) -> tuple[str, tuple[dict[str, list[tuple[int, int]]], int]] | None:
    """``data`` decoded, with its top-level members (``_members``); None when it is not
    a UTF-8 JSON object."""
    try:
        s = data.decode()
    except UnicodeDecodeError:
        return None
    found = _members(s)
    return None if found is None else (s, found)


def repeated(data: bytes, names: Sequence[str]) -> dict[str, list[Any]]:
    """Every value of each of ``names`` that occurs more than once at the top level of
    the UTF-8 JSON object ``data``, in order (empty when none does, or when ``data`` is
    not such an object: ``spliced`` then writes no occurrence of its own)."""
    # A key spelled with an escape other than \uXXXX is not one of these names.
    if b"\\u" not in data and all(data.count(b'"%s"' % n.encode()) < 2 for n in names):
        return {}  # no key written twice, nor escaped
    got = _object(data)
    if got is None:
        return {}
    s, (spans, _) = got
    return {n: [SCAN(s, a)[0] for a, _ in spans[n]] for n in names if len(spans.get(n, ())) > 1}


def nested_values(
    data: bytes, names: Sequence[tuple[str, str]]
) -> dict[tuple[str, str], list[Any]] | None:
    """Every value of each ``(container, name)`` inside the top-level objects of the UTF-8
    JSON object ``data`` named ``container``, in order (every occurrence of either key);
    None when ``data`` is not such an object."""
    got = _object(data)
    if got is None:
        return None
    s, found = got
    out: dict[tuple[str, str], list[Any]] = {}
    for c in {c for c, _ in names}:
        for a, b in found[0].get(c, ()):
            inner = _members(s[a:b])
            if inner is None:  # not an object
                continue
            for c2, n in names:
                if c2 == c:
                    for x, _ in inner[0].get(n, ()):
                        out.setdefault((c, n), []).append(SCAN(s, a + x)[0])
    return out


def spliced(data: bytes, fields: Mapping[str | tuple[str, str], Any]) -> bytes | None:
    """``data`` (a UTF-8 JSON object) with these fields set: a top-level field's value
    written where the field is (every occurrence), a missing one added at the end; a
    nested field ``(container, name)`` written where it is in each object the container
    names, else added at the end of each, a container that is no object replaced by
    ``{name: value}``, a missing one added at the end. Every other byte kept. None when
    ``data`` is not such an object."""
    got = _object(data)
    if got is None:
        return None
    s, (spans, close) = got
    edits: list[tuple[int, int, str]] = []
    added: list[str] = []
    for key, value in fields.items():
        text = _dumps(value)
        if isinstance(key, tuple):
            outer, name = key
            where = spans.get(outer)
            if not where:
                added.append(_dumps(outer) + ":" + _dumps({name: value}))
                continue
            for a, b in where:
                inner = _members(s[a:b])
                if inner is None:
                    edits.append((a, b, _dumps({name: value})))
                elif name in inner[0]:
                    edits.extend((a + x, a + y, text) for x, y in inner[0][name])
                else:
                    at = a + inner[1]
                    edits.append((at, at, ("," if inner[0] else "") + _dumps(name) + ":" + text))
            continue
        where = spans.get(key)
        if where:
            edits.extend((a, b, text) for a, b in where)
        else:
            added.append(_dumps(key) + ":" + text)
    if added:
        edits.append((close, close, ("," if spans else "") + ",".join(added)))
    edits.sort()
    out: list[str] = []
    at = 0
    for a, b, text in edits:
        out.append(s[at:a])
        out.append(text)
        at = b
    out.append(s[at:])
    return "".join(out).encode()


def set_body(
    request: Any, data: bytes, body: dict[str, Any], fields: Mapping[str | tuple[str, str], Any]
) -> None:
    """Send ``request`` with ``body`` (whose ``fields`` changed): the bytes it had with
    only those fields written again (the whole body serialized again when its bytes are
    not plain UTF-8 JSON), its stream, content and ``Content-Length`` replaced in place."""
    new = spliced(data, fields)
    if new is None:
        # Written again whole: in ASCII (a lone surrogate the bytes held is escaped, not
        # an encoding error) and with NaN as it came (never a ValueError).
        new = json.dumps(body, separators=(",", ":")).encode()
    replace_body(request, new)


def replace_body(request: Any, new: bytes) -> None:
    """Send ``request`` with the bytes ``new``: its stream, content and
    ``Content-Length`` replaced in place."""
    stream_type = type(request.stream)
    if stream_type.__name__ != "ByteStream":
        stream_type = sys.modules[type(request).__module__].ByteStream
    request.stream = stream_type(new)
    request._content = new
    headers = request.headers
    name = "Content-Length"
    for raw, lower, _ in header_list(headers):
        if lower == b"content-length":
            name = raw.decode("latin-1")  # the SDK's spelling, kept
            break
    headers[name] = str(len(new))
