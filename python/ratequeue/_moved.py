"""Old import paths of moved modules: they keep working for one release, with a warning."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def forward(
    old: str, new: str, target: str | None = None, instead: Mapping[str, str] | None = None
) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``old``: each name comes from ``target`` (default
    ``new``) with a ``DeprecationWarning`` that points at the importing line and names
    the new home (``instead`` overrides it per name)."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        module = importlib.import_module(target or new)
        try:
            value = getattr(module, name)
        except AttributeError:
            raise AttributeError(f"module {old!r} has no attribute {name!r}") from None
        warnings.warn(
            f"{old} is deprecated and goes in the next release: use "
            f"{(instead or {}).get(name, f'{new}.{name}')}",
            DeprecationWarning,
            stacklevel=2,
        )
        return value

    return __getattr__
