"""Batched evaluation: many structures per model call, filled up to a measured memory budget.

One model call per structure leaves a GPU idle at small sizes (a 256-atom call is bound by
launches and Python). :class:`BatchEvaluator` packs structures, in input order, into chunks of
at most ``max_edges`` edges and evaluates each chunk as one batch of graphs::

    evaluator = mace_accel.BatchEvaluator("my.model", device="cuda")
    results = evaluator.evaluate(frames)          # one dict per frame, in input order
    results[0]["energy"], results[0]["forces"], results[0].get("stress")

The edge budget on a GPU is measured, not guessed: the first chunk is a probe of at most
``probe_edges`` edges, its peak memory per edge gives the chunk size that fills
``memory_fraction`` of the memory free on the device. A chunk that runs out of memory anyway is
split in two and retried (logged as a warning). On the CPU the budget is ``cpu_max_edges``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch

from mace_accel.errors import ConfigError, InputError
from mace_accel.models.frames import (FrameBatcher, HostFrame, host_frame, species_table,
                                      split_results)
from mace_accel.models.outputs import evaluate as evaluate_model
from mace_accel.prepared import PreparedModel, prepare_model
from mace_accel.options import AccelOptions, make_options

log = logging.getLogger(__name__)

Result = Dict[str, object]


@dataclasses.dataclass
class MemoryBudget:
    """How chunk sizes were chosen (reported by :attr:`BatchEvaluator.budget`).

    Attributes:
        max_edges: the largest chunk, in edges.
        bytes_per_edge: peak device memory per edge measured on the probe chunk (None on CPU or
            before the probe).
        free_bytes: device memory free (plus torch's cached, unused memory) when measured.
        source: ``"measured"``, ``"given"`` (``max_edges`` passed) or ``"cpu default"``.
    """

    max_edges: int
    bytes_per_edge: Optional[float] = None
    free_bytes: Optional[int] = None
    source: str = "given"


class BatchEvaluator:
    """Energies, forces and stresses of many structures, several structures per model call.

    Args:
        model: a MACE ``.model`` path, a loaded module (patched in place) or None (bundled model).
        device, default_dtype, head, backend, verify, fallback, deterministic, options: as
            :class:`~mace_accel.calculator.MACEAccelCalculator`.
        min_distance: smallest interatomic distance accepted (Å); None disables the check.
        max_edges: edges per model call; None measures it on a GPU (see the module doc).
        memory_fraction: share of the free device memory a chunk may use (measured budget).
        probe_edges: size of the first, measuring chunk.
        cpu_max_edges: edges per call on the CPU when ``max_edges`` is None.
        compute_stress: stress of the periodic structures (3D cell of non-zero volume).
        workers: threads preparing structures on the host (validation, neighbour lists);
            default: the CPU count, at most 8.
    """

    def __init__(self, model: Union[str, Path, torch.nn.Module, None] = None,
                 device: Union[str, torch.device] = "auto", default_dtype: str = "float32",
                 head: Optional[str] = None, backend: str = "auto", verify: bool = True,
                 fallback: str = "warn", deterministic: bool = True,
                 min_distance: Optional[float] = 0.5, max_edges: Optional[int] = None,
                 memory_fraction: float = 0.7, probe_edges: int = 200_000,
                 cpu_max_edges: int = 100_000, compute_stress: bool = True,
                 workers: Optional[int] = None, options: Optional[AccelOptions] = None) -> None:
        if max_edges is not None and (isinstance(max_edges, bool) or int(max_edges) < 1):
            raise ConfigError(f"max_edges must be a positive number of edges, got {max_edges!r}")
        if workers is not None and (isinstance(workers, bool) or int(workers) < 1):
            raise ConfigError(f"workers must be a positive number of threads, got {workers!r}")
        if not 0.0 < float(memory_fraction) <= 0.95:
            raise ConfigError(f"memory_fraction must be in (0, 0.95], got {memory_fraction!r}")
        requested = make_options(options, backend=backend, verify=verify, fallback=fallback,
                                 deterministic=deterministic)
        self.prepared: PreparedModel = prepare_model(model, device, default_dtype, head,
                                                     requested)
        self.min_distance = min_distance
        self.compute_stress = bool(compute_stress)
        self.memory_fraction = float(memory_fraction)
        self.probe_edges = int(probe_edges)
        on_gpu = self.prepared.device.type == "cuda"
        if max_edges is not None:
            self.budget = MemoryBudget(int(max_edges))
        elif on_gpu:
            self.budget = MemoryBudget(self.probe_edges, source="probe")
        else:
            self.budget = MemoryBudget(int(cpu_max_edges), source="cpu default")
        self._table = species_table(self.prepared.info)
        self.workers = int(workers) if workers is not None else min(8, os.cpu_count() or 1)
        self.prefetch = 4 * self.workers  # frames prepared ahead of the one being batched
        self._batcher: Optional[FrameBatcher] = None
        self.n_calls = 0

    @property
    def model(self) -> torch.nn.Module:
        return self.prepared.model

    @property
    def backend(self) -> str:
        return self.prepared.backend

    @property
    def info(self):
        return self.prepared.info

    @property
    def report(self):
        return self.prepared.report

    @property
    def options(self) -> AccelOptions:
        return self.prepared.options

    # -- public ---------------------------------------------------------------------------------
    def evaluate(self, frames: Iterable, progress: Optional[Callable[[int], None]] = None
                 ) -> List[Result]:
        """Results of every frame, in input order (see :meth:`iter_results`)."""
        return list(self.iter_results(frames, progress))

    def iter_results(self, frames: Iterable, progress: Optional[Callable[[int], None]] = None
                     ) -> Iterator[Result]:
        """Evaluate ``frames`` chunk by chunk, yielding one result dict per frame in input order.

        Each dict has ``energy``/``free_energy`` (eV), ``energies [N]`` (eV), ``forces [N, 3]``
        (eV/Å) and, for periodic structures with a 3D cell when ``compute_stress``,
        ``stress [6]`` (eV/Å^3, ASE Voigt order and sign), all float64.

        Args:
            frames: ``ase.Atoms`` objects (any iterable; consumed once).
            progress: called with the number of frames finished after each chunk.

        Raises:
            InputError: a frame cannot be evaluated; the message starts with ``frame <i>:``
                (its index in ``frames``).
        """
        pending: List[HostFrame] = []
        stress: List[bool] = []
        edges = 0
        for atoms, frame in self._host_frames(frames):
            if self._batcher is None:  # learns mace's fields from the first frame
                p = self.prepared
                self._batcher = FrameBatcher(atoms, p.info, p.head, p.dtype, p.device)
            if pending and edges + frame.n_edges > self.budget.max_edges:
                yield from self._run_chunk(pending, stress, progress)
                pending, stress, edges = [], [], 0
            pending.append(frame)
            stress.append(self.compute_stress and _has_stress(atoms))
            edges += frame.n_edges
        if pending:
            yield from self._run_chunk(pending, stress, progress)

    # -- internals ------------------------------------------------------------------------------
    def _host_frames(self, frames: Iterable) -> Iterator[Tuple[object, HostFrame]]:
        """``(atoms, HostFrame)`` in input order, prepared by a pool of threads a bounded
        window ahead (vesin and numpy release the GIL), so the host keeps up with the GPU."""
        window: "collections.deque" = collections.deque()
        with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
            for index, atoms in enumerate(frames):
                window.append((atoms, pool.submit(self._host, index, atoms)))
                if len(window) >= self.prefetch:
                    atoms_, future = window.popleft()
                    yield atoms_, future.result()
            while window:
                atoms_, future = window.popleft()
                yield atoms_, future.result()

    def _host(self, index: int, atoms) -> HostFrame:
        try:
            return host_frame(atoms, self.prepared.info, self._table, self.min_distance,
                              device=self.prepared.device)
        except InputError as exc:
            raise InputError(f"frame {index}: {exc}") from None
        except (AttributeError, TypeError) as exc:
            raise InputError(f"frame {index}: not an ase.Atoms ({type(atoms).__name__}): "
                             f"{exc}") from None

    def _run_chunk(self, frames: List[HostFrame], stress: List[bool],
                   progress: Optional[Callable[[int], None]]) -> Iterator[Result]:
        try:
            results = self._call(frames, stress)
        except torch.cuda.OutOfMemoryError:
            if len(frames) == 1:
                raise InputError(
                    f"one structure of {frames[0].n_atoms} atoms / {frames[0].n_edges} edges does "
                    "not fit in the device's memory") from None
            half = len(frames) // 2
            self.budget.max_edges = max(1, sum(f.n_edges for f in frames[:half]))
            log.warning("mace-accel: a chunk of %d structures ran out of device memory; "
                        "retrying in halves (max_edges now %d)", len(frames),
                        self.budget.max_edges)
            _free(self.prepared.device)
            yield from self._run_chunk(frames[:half], stress[:half], progress)
            yield from self._run_chunk(frames[half:], stress[half:], progress)
            return
        if progress is not None:
            progress(len(frames))
        yield from results

    def _call(self, frames: List[HostFrame], stress: List[bool]) -> List[Result]:
        p = self.prepared
        batch = self._batcher.collate(frames)
        measuring = self.budget.source == "probe"
        if measuring:
            baseline = _start_peak(p.device)
        t0 = time.perf_counter()
        out = evaluate_model(p.model, batch, any(stress))  # edges come grouped by structure
        results = split_results(out, frames, stress)
        self.n_calls += 1
        if measuring:
            self._set_budget(sum(f.n_edges for f in frames), baseline)
        log.debug("mace-accel: %d structures, %d edges in %.1f ms", len(frames),
                  sum(f.n_edges for f in frames), 1e3 * (time.perf_counter() - t0))
        return results

    def _set_budget(self, n_edges: int, baseline: int) -> None:
        """Chunk size from the probe chunk's peak memory per edge."""
        device = self.prepared.device
        peak = torch.cuda.max_memory_allocated(device) - baseline
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        per_edge = max(peak, 1) / max(n_edges, 1)
        self.budget = MemoryBudget(max(1, int(self.memory_fraction * free / per_edge)),
                                   per_edge, int(free), "measured")
        log.info("mace-accel: batched evaluation: %.0f bytes per edge measured; chunks of up to "
                 "%d edges (%.0f%% of %.1f GiB free)", per_edge, self.budget.max_edges,
                 100 * self.memory_fraction, free / 2**30)


def evaluate(frames: Iterable, model: Union[str, Path, torch.nn.Module, None] = None,
             **kwargs) -> List[Result]:
    """Evaluate many structures with batched calls: ``BatchEvaluator(model, **kwargs)``'s
    :meth:`~BatchEvaluator.evaluate` (results in input order)."""
    return BatchEvaluator(model, **kwargs).evaluate(frames)


def _has_stress(atoms) -> bool:
    from mace_accel.calculator import has_stress

    return has_stress(atoms)


def _start_peak(device: torch.device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()

