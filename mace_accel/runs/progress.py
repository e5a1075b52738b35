"""Progress of YAML runs on stderr: a tqdm bar on a terminal, whole lines anywhere else.

A batch job's or ``nohup``'s log gets a line every ``interval`` seconds (and one at the end),
never a bar's carriage returns; the minute of loading, patching and verifying the model at
start-up is covered by :func:`ticker`'s lines. ``progress: false`` in a run file turns both off.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Callable, Iterator, Optional, TextIO, Union

from tqdm import tqdm

LINE_INTERVAL = 10.0  # seconds between two progress lines off a terminal
_LINE_FORMAT = "{desc}: {n_fmt}/{total_fmt} {unit} ({percentage:.0f}%) in {elapsed}, " \
               "{remaining} left ({rate_fmt})"


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class ProgressLines:
    """Progress as whole lines, for streams that are not a terminal (a log file).

    Used like a tqdm bar: ``update(n)`` per step, as a context manager. A line is printed when
    ``interval`` seconds have passed since the last one, and one at the end (saying where it
    stopped if the block raised).

    Args:
        total: steps expected.
        desc: label in front of each line.
        stream: where the lines go.
        unit: what a step is called (plural), e.g. ``"steps"`` or ``"frames"``.
        interval: seconds between lines (0: a line per update).
        clock: the time source (tests).
    """

    def __init__(self, total: int, desc: str, stream: TextIO, unit: str = "steps",
                 interval: float = LINE_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.desc, self.stream, self.unit = int(total), desc, stream, unit
        self.interval, self.clock = float(interval), clock
        self.n = 0
        self._start = self._last = clock()

    def _line(self, now: float, ending: str = "") -> None:
        text = tqdm.format_meter(self.n, self.total, now - self._start, prefix=self.desc,
                                 unit=self.unit.rstrip("s"), bar_format=_LINE_FORMAT.replace(
                                     "{unit}", self.unit))
        text = " ".join(text.split()).replace("( ", "(")  # tqdm pads the rate
        print(text + ending, file=self.stream, flush=True)
        self._last = now

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if now - self._last >= self.interval and self.n < self.total:
            self._line(now)

    def close(self, stopped: bool = False) -> None:
        if self.total > 0:
            self._line(self.clock(), "; stopped" if stopped else "")
        self.total = 0  # closed: no second final line

    def __enter__(self) -> "ProgressLines":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(stopped=exc_type is not None)


def progress_bar(total: int, desc: str = "", stream: Optional[TextIO] = None,
                 enabled: Optional[bool] = None, unit: str = "steps",
                 interval: float = LINE_INTERVAL) -> Union[tqdm, ProgressLines]:
    """A progress reporter of ``total`` steps (use it as a context manager; ``update()`` per
    step): a tqdm bar on a terminal, :class:`ProgressLines` on any other stream.

    Args:
        total: number of steps expected (0 reports nothing).
        desc: short label in front of the bar or lines.
        stream: where to report (default ``sys.stderr``).
        enabled: ``None``: a bar on a terminal, lines elsewhere; ``False``: nothing (the run
            file's ``progress: false``); ``True``: a bar even to a file (tests).
        unit: what a step is called (plural), e.g. ``"frames"``.
        interval: seconds between two lines off a terminal.
    """
    stream = stream if stream is not None else sys.stderr
    if enabled is None and not _is_terminal(stream) and total > 0:
        return ProgressLines(total, desc or "progress", stream, unit=unit, interval=interval)
    return tqdm(total=total, desc=desc or None, file=stream,
                disable=enabled is False or total <= 0, unit=unit.rstrip("s"),
                mininterval=0.2, dynamic_ncols=True, leave=True)


@contextlib.contextmanager
def ticker(what: str, stream: Optional[TextIO] = None, enabled: bool = True,
           interval: float = LINE_INTERVAL) -> Iterator[None]:
    """Lines on ``stream`` while the block runs: ``mace-accel: <what> ...`` at once, a line
    every ``interval`` seconds while it lasts, and one with its time when it ends, so that a
    long start-up (loading, patching and verifying a model) is never silent.

    Args:
        what: the work in words (``"loading, accelerating and verifying the model"``).
        stream: where the lines go (default ``sys.stderr``).
        enabled: ``False`` prints nothing (``progress: false``).
        interval: seconds between the lines while it lasts.
    """
    if not enabled:
        yield
        return
    stream = stream if stream is not None else sys.stderr
    start = time.monotonic()
    done = threading.Event()

    def tick() -> None:
        while not done.wait(interval):
            print(f"mace-accel: still {what} ({time.monotonic() - start:.0f} s)", file=stream,
                  flush=True)

    print(f"mace-accel: {what} ...", file=stream, flush=True)
    thread = threading.Thread(target=tick, name="mace-accel-ticker", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    print(f"mace-accel: {what}: done in {time.monotonic() - start:.1f} s", file=stream,
          flush=True)
