"""Progress bars of YAML runs: tqdm on stderr, drawn only when the stream is a terminal.

Logs and CI output stay clean; ``progress: false`` in a run file turns the bar off everywhere.
"""

from __future__ import annotations

import sys
from typing import Optional, TextIO

from tqdm import tqdm


def progress_bar(total: int, desc: str = "", stream: Optional[TextIO] = None,
                 enabled: Optional[bool] = None) -> tqdm:
    """A tqdm bar of ``total`` steps (use it as a context manager; ``update()`` per step).

    Args:
        total: number of steps expected (a bar of 0 steps draws nothing).
        desc: short label in front of the bar.
        stream: where to draw (default ``sys.stderr``).
        enabled: ``None`` draws only if ``stream`` is a TTY; ``False`` never draws; ``True``
            draws even to a file (tests).
    """
    stream = stream if stream is not None else sys.stderr
    if enabled is None:
        isatty = getattr(stream, "isatty", None)
        enabled = bool(isatty and isatty())
    return tqdm(total=total, desc=desc or None, file=stream, disable=not enabled or total <= 0,
                unit="step", mininterval=0.2, dynamic_ncols=True, leave=True)
