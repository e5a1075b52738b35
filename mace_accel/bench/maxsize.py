"""The largest system that fits in device memory: growth (or shrinking) then bisection over
supercell size n.

The search is independent of models: it calls ``try_size(n)``, which raises an out-of-memory
error (see :func:`mace_accel.bench.timing.is_out_of_memory`) or a
:class:`~mace_accel.errors.KernelSizeError` (more edges or nodes than a kernel's int32 indices
take) when size ``n`` does not fit; the trial records which. Any other exception is a real
failure and propagates.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional

from mace_accel.bench.timing import Deadline, is_out_of_memory
from mace_accel.errors import KernelSizeError

CONVERGED = "converged"
UPPER_BOUND = "upper bound reached"
TIME_LIMIT = "time limit"
NOTHING_FITS = "smallest size does not fit"


@dataclasses.dataclass
class Trial:
    """One attempted size: ``n``, whether it fitted, and what ``try_size`` returned."""

    n: int
    fits: bool
    info: Any = None


@dataclasses.dataclass
class MaxSizeResult:
    """Outcome of :func:`find_max_size`.

    Attributes:
        largest_fit: the largest n that ran (None if even ``start`` did not fit).
        smallest_oom: the smallest n seen not to fit: out of memory or past a kernel's int32
            indices (None if none was).
        stop_reason: ``converged`` (they differ by one), ``upper bound reached``,
            ``time limit`` (``largest_fit`` is then a lower bound) or
            ``smallest size does not fit``.
        trials: every attempt, in order.
    """

    largest_fit: Optional[int]
    smallest_oom: Optional[int]
    stop_reason: str
    trials: List[Trial]


def find_max_size(try_size: Callable[[int], Any], start: int, upper: int,
                  deadline: Optional[Deadline] = None) -> MaxSizeResult:
    """Largest ``n`` in ``[start, upper]`` for which ``try_size(n)`` does not run out of memory.

    Doubles ``n`` from ``start`` until a size fails or ``upper`` is reached (or, if ``start``
    already fails, halves it until a size fits), then bisects between the largest size that
    fitted and the smallest that did not. Assumes that fitting is monotone in ``n``. Checks
    ``deadline`` before every attempt.
    """
    if not 1 <= start <= upper:
        raise ValueError(f"need 1 <= start <= upper, got start={start}, upper={upper}")
    trials: List[Trial] = []
    fit: Optional[int] = None
    oom: Optional[int] = None

    def attempt(n: int) -> Optional[bool]:
        """Try size ``n``, record it as the new ``fit`` or ``oom``; None if time is up."""
        nonlocal fit, oom
        if deadline is not None and deadline.expired():
            return None
        try:
            info = try_size(n)
        except Exception as exc:
            if not (is_out_of_memory(exc) or isinstance(exc, KernelSizeError)):
                raise
            trials.append(Trial(n, False, str(exc).splitlines()[0] if str(exc) else "OOM"))
            oom = n
            return False
        trials.append(Trial(n, True, info))
        fit = n
        return True

    n = start
    while True:  # growth phase
        ok = attempt(n)
        if ok is None:
            return MaxSizeResult(fit, oom, TIME_LIMIT, trials)
        if not ok:
            break
        if n == upper:
            return MaxSizeResult(fit, oom, UPPER_BOUND, trials)
        n = min(2 * n, upper)
    n = oom // 2
    while fit is None and n >= 1:  # shrink phase: start did not fit
        ok = attempt(n)
        if ok is None:
            return MaxSizeResult(fit, oom, TIME_LIMIT, trials)
        n //= 2
    if fit is None:
        return MaxSizeResult(None, oom, NOTHING_FITS, trials)
    while oom - fit > 1:  # bisection phase
        if attempt((fit + oom) // 2) is None:
            return MaxSizeResult(fit, oom, TIME_LIMIT, trials)
    return MaxSizeResult(fit, oom, CONVERGED, trials)
