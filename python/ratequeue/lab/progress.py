"""A plain progress bar on stderr (no dependency), redrawn at most ten times a second."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``[#########.........]  45%  label  12.3 s`` on one line of ``stream``.

    ``enabled=None`` shows it only when ``stream`` is a terminal.
    """

    def __init__(
        self,
        total: float,
        label: str = "",
        *,
        enabled: bool | None = None,
        stream: TextIO | None = None,
        width: int = 30,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total = max(float(total), 1e-12)
        self.done = 0.0
        self.label = label
        self.width = width
        self._start = time.monotonic()
        self._last = 0.0

    def advance(self, amount: float = 1.0, label: str | None = None) -> None:
        self.done = min(self.total, self.done + amount)
        if label is not None:
            self.label = label
        self._draw()

    def set_label(self, label: str) -> None:
        self.label = label
        self._draw()

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1 and self.done < self.total:
            return
        self._last = now
        frac = self.done / self.total
        filled = round(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        line = f"\r[{bar}] {frac * 100:5.1f}%  {now - self._start:6.1f} s  {self.label[:40]:<40}"
        self.stream.write(line)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> Progress:
        self._draw(force=True)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
