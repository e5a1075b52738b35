"""Timing one callable the same way for every backend: warm-up, then many timed repeats.

On a CUDA device each repeat is bracketed by CUDA events recorded on the current stream (device
work is asynchronous, so a host clock would measure launch time only); on the CPU the repeats
are timed with ``time.perf_counter``. Which clock was used is part of the result, so a CPU number
is never mistaken for a GPU one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from mace_accel.ops.runtime import side_stream

CUDA_CLOCK = "cuda-events"
HOST_CLOCK = "perf_counter"


class WallClock:
    """Wall seconds spent inside the callables it wraps, summed (host time: what a step of MD
    spends in the calculator, or in a LAMMPS model's ``compute_forces``)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable) -> Callable:
        """``fn`` with its calls timed."""
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


@dataclasses.dataclass(frozen=True)
class Timing:
    """Statistics of ``repeats`` timed calls (milliseconds).

    Attributes:
        median_ms, p10_ms, p90_ms: median and 10th/90th percentiles of the per-call times.
        samples_ms: every per-call time, in call order.
        clock: ``"cuda-events"`` or ``"perf_counter"``.
        warmup: untimed calls made before the timed ones.
    """

    median_ms: float
    p10_ms: float
    p90_ms: float
    samples_ms: tuple
    clock: str
    warmup: int

    @classmethod
    def from_samples(cls, samples_ms: Sequence[float], clock: str, warmup: int) -> "Timing":
        if len(samples_ms) == 0:
            raise ValueError("need at least one timed call")
        arr = np.asarray(samples_ms, dtype=np.float64)
        return cls(median_ms=float(np.median(arr)), p10_ms=float(np.percentile(arr, 10)),
                   p90_ms=float(np.percentile(arr, 90)), samples_ms=tuple(float(v) for v in arr),
                   clock=clock, warmup=warmup)


def as_device(device: torch.device | str) -> torch.device:
    """``torch.device`` of ``device``; a bare ``"cuda"`` becomes the *current* CUDA device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def synchronize(device: torch.device | str) -> None:
    """Wait for all queued work on ``device`` (no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], Any], device: torch.device | str, warmup: int = 5,
               repeats: int = 20, clock: Optional[Callable[[], float]] = None) -> Timing:
    """Call ``fn`` ``warmup`` times untimed, then ``repeats`` times timed.

    Args:
        fn: the work to time; its return value is dropped after each call.
        device: where ``fn`` runs; CUDA devices are timed with events on the current stream.
        warmup: untimed calls first (module loads, kernel compilation, allocator growth).
        repeats: timed calls.
        clock: host clock in seconds for the CPU path (``time.perf_counter``; tests pass a fake).

    Returns:
        per-call :class:`Timing`.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        with torch.cuda.device(device):
            synchronize(device)
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(repeats)]
            for start, end in events:
                start.record()
                fn()
                end.record()
            synchronize(device)
            samples = [start.elapsed_time(end) for start, end in events]
        return Timing.from_samples(samples, CUDA_CLOCK, warmup)
    clock = clock or time.perf_counter
    samples: List[float] = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        samples.append((clock() - t0) * 1e3)
    return Timing.from_samples(samples, HOST_CLOCK, warmup)


class PeakMemory:
    """Filled by :func:`track_peak_memory`: peak allocated device memory in MiB (None on CPU)."""

    peak_mb: Optional[float] = None


@contextlib.contextmanager
def track_peak_memory(device: torch.device | str) -> Iterator[PeakMemory]:
    """Measure ``torch.cuda.max_memory_allocated`` over the block (after a peak reset).

    The number includes what was already resident (weights, the batch), since that is what a
    user must fit too.
    """
    device = torch.device(device)
    result = PeakMemory()
    if device.type != "cuda":
        yield result
        return
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield result
    synchronize(device)
    result.peak_mb = torch.cuda.max_memory_allocated(device) / 2**20


def free_memory(device: torch.device | str) -> None:
    """Collect garbage and give cached blocks back, so the next backend starts clean."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a device out-of-memory error (torch's, cupy's, or a wrapped one)."""
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    if "OutOfMemory" in type(exc).__name__:  # cupy.cuda.memory.OutOfMemoryError and the like
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("CUDA out of memory" in text
                                              or "CUBLAS_STATUS_ALLOC_FAILED" in text
                                              or "cudaErrorMemoryAllocation" in text)


class Deadline:
    """A wall-clock budget: ``expired()`` once ``seconds`` have passed (never if None).

    Args:
        seconds: the budget, or None for no limit.
        clock: seconds since an arbitrary origin (``time.monotonic``; tests pass a fake).
    """

    def __init__(self, seconds: Optional[float], clock: Callable[[], float] = time.monotonic):
        if seconds is not None and seconds <= 0:
            raise ValueError(f"a time limit must be positive, got {seconds}")
        self.seconds = seconds
        self._clock = clock
        self._start = clock()

    def elapsed(self) -> float:
        return self._clock() - self._start

    def expired(self) -> bool:
        return self.seconds is not None and self.elapsed() >= self.seconds


def capture_graph(fn: Callable[[], Any], launches: int = 1) -> Tuple[Any, Any]:
    """``launches`` calls of ``fn`` captured in one CUDA graph, after one warm-up call on a side
    stream (kernels compiled, caches filled off the capture): ``(graph, the last call's output
    in the graph)``; ``graph.replay()`` rewrites that output."""
    side = side_stream("warm-up", torch.device("cuda", torch.cuda.current_device()))
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    out = None
    with torch.cuda.graph(graph):
        for _ in range(launches):
            out = fn()
    return graph, out


def graph_ms_per_launch(fn: Callable[[], Any], launches: int, repeats: int = 20) -> float:
    """Median milliseconds per call of ``fn``, ``launches`` calls captured in one CUDA graph and
    replayed (3 warm-up replays; kernel benchmarks): timing the replay takes the host's launch
    cost out of small kernels."""
    replay = capture_graph(fn, launches)[0].replay
    return time_calls(replay, "cuda", 3, repeats).median_ms / launches
