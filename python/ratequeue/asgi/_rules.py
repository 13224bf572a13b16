"""Rules: which requests pass which levels, at what cost, in which class."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._keys import Scope
from ._tokens import OpenAITokens

__all__ = ["Rule"]

CostFunc = Callable[[Scope], Mapping[str, int]]


def compile_path(pattern: str) -> re.Pattern[str] | None:
    """A regex for a path pattern, or None when the pattern is a literal path.

    ``{name}`` and ``*`` match one path segment, ``**`` any rest of the path.
    """
    if not isinstance(pattern, str) or not pattern:
        raise TypeError(f"path must be a non-empty str, got {pattern!r}")
    if "*" not in pattern and "{" not in pattern:
        return None
    out = []
    for tok in re.split(r"(\*\*|\*|\{[^{}/]*\})", pattern):
        if tok == "**":
            out.append(".*")
        elif tok == "*" or (tok.startswith("{") and tok.endswith("}")):
            out.append("[^/]+")
        else:
            out.append(re.escape(tok))
    return re.compile("".join(out))


@dataclass(frozen=True)
class Rule:
    """Requests matching ``path`` and ``methods`` pass ``levels`` (all the middleware's
    levels when None; none when empty: exempt) at ``cost`` per unit, estimating
    ``tokens`` from the body when given, in class ``priority``, waiting at most
    ``max_wait`` seconds (default: the class's, else the middleware's)."""

    path: str = "/**"
    methods: Collection[str] | None = None
    levels: Sequence[str] | None = None
    cost: Mapping[str, int] | CostFunc | None = None
    tokens: OpenAITokens | None = None
    priority: str | None = None
    max_wait: float | None = None
    name: str | None = None
    _regex: re.Pattern[str] | None = field(default=None, init=False, repr=False, compare=False)
    _methods: frozenset[str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_regex", compile_path(self.path))
        if self.methods is not None:
            if isinstance(self.methods, str):
                raise TypeError("methods must be a collection of str, e.g. ['POST']")
            object.__setattr__(self, "_methods", frozenset(m.upper() for m in self.methods))
        if self.levels is not None and isinstance(self.levels, str):
            raise TypeError("levels must be a sequence of level names, e.g. ['user']")
        if self.max_wait is not None and not (
            isinstance(self.max_wait, (int, float))
            and not isinstance(self.max_wait, bool)
            and math.isfinite(self.max_wait)
            and self.max_wait >= 0
        ):
            raise ValueError(f"max_wait={self.max_wait!r} must be a finite number >= 0")
        if isinstance(self.cost, Mapping):
            for unit, c in self.cost.items():
                if isinstance(c, bool) or not isinstance(c, int) or c < 0:
                    raise ValueError(f"cost[{unit!r}]={c!r} must be an integer >= 0")

    @property
    def label(self) -> str:
        """The name used in metrics: ``name`` or the path pattern."""
        return self.name or self.path

    def matches(self, method: str, path: str) -> bool:
        """Whether a request of ``method`` on ``path`` falls under this rule."""
        if self._methods is not None and method not in self._methods:
            return False
        if self._regex is None:
            return path == self.path
        return self._regex.fullmatch(path) is not None

    def costs(self, scope: Scope) -> dict[str, Any]:
        """The per-unit costs of this request (before any token estimate)."""
        if self.cost is None:
            return {}
        if isinstance(self.cost, Mapping):
            return dict(self.cost)
        out = dict(self.cost(scope))
        for unit, c in out.items():
            if isinstance(c, bool) or not isinstance(c, int) or c < 0:
                raise ValueError(f"cost function returned {unit}={c!r}: must be an integer >= 0")
        return out


def content_length(unit: str = "bytes") -> CostFunc:
    """A cost function charging the request's Content-Length (0 when absent) in ``unit``."""

    def cost(scope: Scope) -> Mapping[str, int]:
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                s = bytes(v).strip()
                if s.isdigit() and len(s) <= 18:
                    return {unit: int(s)}
                break
        return {unit: 0}

    return cost
