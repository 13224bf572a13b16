"""Token costs of OpenAI-compatible requests: an estimate from the request body, and the
actual usage read from the response (JSON or server-sent events) as it streams past."""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from .._ratequeue import _emits_no_tokens

__all__ = ["OpenAITokens", "UsageScanner"]


@dataclass(frozen=True)
class OpenAITokens:
    """Estimates a request's tokens as prompt + requested maximum output; settled later.

    The prompt counts ``ceil(characters / chars_per_token)`` plus ``per_message`` per chat
    message and ``per_image`` per non-text part; the output is ``max_completion_tokens``,
    ``max_tokens`` or ``max_output_tokens``, else ``default_max_output`` — or 0 on a route
    that produces no tokens (embeddings, moderations, token counts: the transport's rule)
    — times ``n``. The body is read up to ``max_body`` bytes (413 beyond); ``unit`` is
    the limiter unit charged.
    """

    unit: str = "tokens"
    max_body: int = 2 * 1024 * 1024
    chars_per_token: float = 4.0
    per_message: int = 4
    per_image: int = 85
    default_max_output: int = 1024
    max_n: int = 128

    def __post_init__(self) -> None:
        if not isinstance(self.unit, str) or not self.unit:
            raise TypeError(f"unit must be a non-empty str, got {self.unit!r}")
        for name in ("max_body", "per_message", "per_image", "default_max_output", "max_n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}={v!r} must be an integer >= 0")
        if not (math.isfinite(self.chars_per_token) and self.chars_per_token > 0):
            raise ValueError(f"chars_per_token={self.chars_per_token!r} must be > 0")

    def _text(self, n_chars: int) -> int:
        return math.ceil(n_chars / self.chars_per_token)

    def _content(self, content: Any) -> int:
        if isinstance(content, str):
            return self._text(len(content))
        if isinstance(content, list):
            total = 0
            for part in content:
                if isinstance(part, str):
                    total += self._text(len(part))
                elif isinstance(part, dict):
                    text = part.get("text")
                    if isinstance(text, str):
                        total += self._text(len(text))
                    else:
                        total += self.per_image
            return total
        if content is None:
            return 0
        return self._text(len(json.dumps(content, default=str)))

    def estimate(self, body: bytes, path: str | None = None) -> int:
        """Tokens for a request body on ``path``: prompt estimate + maximum output (at
        least 1). Without a path, a body with ``input`` and no ``messages`` is taken for
        an embeddings call (no output), as before paths were read."""
        try:
            req = json.loads(body) if body else {}
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            return max(1, self._text(len(body)) + self.default_max_output)
        if not isinstance(req, dict):
            return max(1, self._text(len(body)) + self.default_max_output)
        prompt = 0
        messages = req.get("messages")
        if isinstance(messages, list):
            for m in messages:
                prompt += self.per_message
                if isinstance(m, dict):
                    prompt += self._content(m.get("content"))
                    for k in ("tool_calls", "function_call", "name"):
                        if k in m:
                            prompt += self._content(json.dumps(m[k], default=str))
        for k in ("prompt", "input", "instructions", "system"):
            if k in req:
                prompt += self._content(req[k])
        for k in ("tools", "functions", "response_format"):
            if k in req:
                prompt += self._text(len(json.dumps(req[k], default=str)))
        output = 0
        for k in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
            v = req.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                output = v
                break
        else:
            if path is not None:
                output = 0 if _emits_no_tokens(path) else self.default_max_output
            else:
                output = 0 if "input" in req and "messages" not in req else self.default_max_output
        n = req.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            n = 1
        return max(1, prompt + output * min(n, self.max_n))


_USAGE = re.compile(rb'(?<!\\)"usage"\s*:\s*\{')
#: Longest usage object looked for (bytes); a longer one is ignored.
_MAX_USAGE = 8192
_TAIL = 64


def usage_total(usage: Any) -> int | None:
    """Total tokens of an OpenAI-style ``usage`` object (chat, completions or responses)."""
    if not isinstance(usage, dict):
        return None

    def num(k: str) -> int | None:
        v = usage.get(k)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    total = num("total_tokens")
    if total is not None:
        return total
    parts = [
        num(a) if num(a) is not None else num(b)
        for a, b in (("prompt_tokens", "input_tokens"), ("completion_tokens", "output_tokens"))
    ]
    if all(p is None for p in parts):
        return None
    return sum(p or 0 for p in parts)


def _object_end(data: bytes, start: int) -> int:
    """Index after the JSON object opening at ``start``; -1 if it does not end in ``data``."""
    depth = 0
    in_str = False
    esc = False
    end = min(len(data), start + _MAX_USAGE)
    for i in range(start, end):
        c = data[i]
        if in_str:
            if esc:
                esc = False
            elif c == 0x5C:  # backslash
                esc = True
            elif c == 0x22:
                in_str = False
        elif c == 0x22:
            in_str = True
        elif c == 0x7B:
            depth += 1
        elif c == 0x7D:
            depth -= 1
            if depth == 0:
                return i + 1
    return -1 if end == len(data) else -2


_COUNTS = ("total_tokens", "prompt_tokens", "completion_tokens", "input_tokens", "output_tokens")


class UsageScanner:
    """Reads the ``"usage": {...}`` objects of a response body fed chunk by chunk, keeping
    at most a few kilobytes (the body itself passes through untouched).

    Counts of later objects replace earlier ones, field by field, so a stream that sends
    its input tokens first and its output tokens last (Anthropic's ``message_start`` then
    ``message_delta``) is counted whole; ``total`` is None until a count is seen.
    """

    __slots__ = ("_carry", "_counts")

    def __init__(self) -> None:
        self._carry = b""
        self._counts: dict[str, int] = {}

    @property
    def total(self) -> int | None:
        """Total tokens of the usage seen so far."""
        return usage_total(self._counts) if self._counts else None

    def _merge(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        for k in _COUNTS:
            v = usage.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                self._counts[k] = v

    def feed(self, chunk: bytes) -> None:
        """Reads one more chunk of the body; keeps at most about 8 KiB between chunks."""
        data = self._carry + chunk if self._carry else chunk
        pos = 0
        carry_from = max(0, len(data) - _TAIL)
        while True:
            m = _USAGE.search(data, pos)
            if m is None:
                break
            brace = m.end() - 1
            end = _object_end(data, brace)
            if end == -1:  # incomplete: keep it for the next chunk
                carry_from = m.start()
                break
            if end == -2:  # too long to be a usage object
                pos = m.end()
                continue
            with contextlib.suppress(ValueError, RecursionError):  # not a usage object
                self._merge(json.loads(data[brace:end]))
            pos = end
            carry_from = max(carry_from, end)
        self._carry = bytes(data[carry_from:])
