"""A minimal text progress bar on stderr (rate and ETA), with no dependency.

It draws only when the stream is a terminal, so logs and CI output stay clean; ``enabled=False``
turns it off everywhere. Redraws are throttled so a fast loop does not spend its time printing.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO


def _format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours:d}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class ProgressBar:
    """``desc [#####.....] 50/100 12.3 it/s ETA 00:04`` on one line, redrawn in place.

    Args:
        total: number of steps expected (a bar of 0 steps draws nothing).
        desc: short label in front of the bar.
        stream: where to draw (default ``sys.stderr``).
        enabled: ``None`` draws only if ``stream`` is a TTY; ``False`` never draws; ``True``
            draws even to a file (tests).
        min_interval: seconds between redraws.
        width: characters of the bar itself.
        clock: time source (seconds), replaceable in tests.

    Use as a context manager, or call :meth:`close` at the end.
    """

    def __init__(self, total: int, desc: str = "", stream: Optional[TextIO] = None,
                 enabled: Optional[bool] = None, min_interval: float = 0.2, width: int = 30,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.total = int(total)
        self.desc = desc
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled and self.total > 0
        self.min_interval = min_interval
        self.width = width
        self.n = 0
        self._clock = clock
        self._start = clock()
        self._last_draw = -float("inf")
        self._drawn_n: Optional[int] = None  # self.n at the last draw (None: never drawn)

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` steps (redraws at most every ``min_interval`` seconds)."""
        self.n = min(self.n + n, self.total)
        if not self.enabled:
            return
        now = self._clock()
        if self.n >= self.total or now - self._last_draw >= self.min_interval:
            self._draw(now)

    def render(self, now: Optional[float] = None) -> str:
        """The bar's current text (without the carriage return)."""
        now = self._clock() if now is None else now
        elapsed = max(now - self._start, 0.0)
        frac = self.n / self.total if self.total else 1.0
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        rate = self.n / elapsed if elapsed > 0 else 0.0
        if self.n >= self.total:
            tail = f"{_format_duration(elapsed)} total"
        elif rate > 0:
            tail = f"ETA {_format_duration((self.total - self.n) / rate)}"
        else:
            tail = "ETA --:--"
        label = f"{self.desc} " if self.desc else ""
        return f"{label}[{bar}] {self.n}/{self.total} {rate:.3g} it/s {tail}"

    def _draw(self, now: float) -> None:
        self.stream.write("\r" + self.render(now) + "\033[K")
        self.stream.flush()
        self._last_draw = now
        self._drawn_n = self.n

    def close(self) -> None:
        """Draw the final state and end the line (only if anything was drawn)."""
        if self.enabled and self._drawn_n is not None:
            if self._drawn_n != self.n:
                self._draw(self._clock())
            self.stream.write("\n")
            self.stream.flush()
        self.enabled = False

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
