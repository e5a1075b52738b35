"""Throughput of many small structures: batched evaluation vs one call per structure.

High-throughput users (screening, dataset labelling) evaluate thousands of structures of a few
hundred atoms. This measures frames/s and atoms/s over the same frames:

* ``batched``: :class:`mace_accel.BatchEvaluator` (many structures per model call);
* ``one-by-one``: :class:`mace_accel.MACEAccelCalculator`, one call per structure;
* ``cueq one-by-one``: mace's ``MACECalculator(enable_cueq=True)``, one call per structure.

The one-by-one rows time the first ``one_by_one_frames`` frames only (they take long); all rows
include the host work (neighbour lists, batch building) a user pays, after an untimed warm-up on
a few frames. Frames are rattled fcc supercells of the model's elements with 64-256 atoms.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import List, Optional, Sequence

import numpy as np
import torch

from mace_accel.bench.backends import OK, failure_status, mace_device, missing_requirement
from mace_accel.bench.systems import FCC_A, FCC_ELEMENTS, substitute
from mace_accel.bench.timing import free_memory, synchronize
from mace_accel.models.batch import model_dtype, model_info
from mace_accel.options import dtype_name

# (a, b, c) repeats of the 4-atom fcc cell giving 64..256 atoms
SHAPES = tuple((a, b, c) for a in range(2, 5) for b in range(2, 5) for c in range(2, 5)
               if 64 <= 4 * a * b * c <= 256)


@dataclasses.dataclass
class ThroughputRecord:
    """Frames per second of one way of evaluating (schema: see :mod:`.report`)."""

    model: str
    dtype: str
    mode: str
    status: str
    frames: int
    atoms: int
    seconds: Optional[float] = None
    frames_per_s: Optional[float] = None
    atoms_per_s: Optional[float] = None
    model_calls: Optional[int] = None
    detail: str = ""


def make_frames(model: torch.nn.Module, n_frames: int, seed: int = 0) -> List[object]:
    """``n_frames`` rattled binary fcc cells of 64-256 atoms (elements the model has)."""
    from ase.build import bulk

    info = model_info(model)
    mapping = substitute(FCC_ELEMENTS, info.atomic_numbers)
    species = np.asarray([mapping[z] for z in FCC_ELEMENTS])
    rng = np.random.default_rng(seed)
    frames = []
    for _ in range(n_frames):
        shape = SHAPES[rng.integers(len(SHAPES))]
        atoms = bulk("Cu", "fcc", a=FCC_A, cubic=True).repeat(shape)
        atoms.set_atomic_numbers(rng.choice(species, size=len(atoms)))
        atoms.positions += rng.normal(0.0, 0.05, size=atoms.positions.shape)
        frames.append(atoms)
    return frames


def _record(label: str, dtype: torch.dtype, mode: str, frames: Sequence) -> ThroughputRecord:
    return ThroughputRecord(label, dtype_name(dtype), mode, OK, len(frames),
                            sum(len(a) for a in frames))


def _finish(record: ThroughputRecord, seconds: float, calls: Optional[int]) -> ThroughputRecord:
    record.seconds = seconds
    record.frames_per_s = record.frames / seconds
    record.atoms_per_s = record.atoms / seconds
    record.model_calls = calls
    return record


def run_batched(model: torch.nn.Module, frames: Sequence, device, label: str,
                warmup_frames: int = 8) -> ThroughputRecord:
    """Frames/s of :class:`~mace_accel.batched.BatchEvaluator` over ``frames``."""
    from mace_accel.batched import BatchEvaluator

    dtype = model_dtype(model)
    record = _record(label, dtype, "batched", frames)
    try:
        with mace_device(device) as dev:
            evaluator = BatchEvaluator(copy.deepcopy(model), device=dev,
                                       default_dtype=dtype_name(dtype), fallback="error")
            evaluator.evaluate(frames[:warmup_frames])  # compiles kernels, measures memory
            calls = evaluator.n_calls
            synchronize(dev)
            t0 = time.perf_counter()
            evaluator.evaluate(frames)
            synchronize(dev)
            seconds = time.perf_counter() - t0
            record.detail = (f"up to {evaluator.budget.max_edges} edges per call "
                             f"({evaluator.budget.source})")
            return _finish(record, seconds, evaluator.n_calls - calls)
    except Exception as exc:  # reported in the record
        record.status = failure_status(exc)
        return record
    finally:
        free_memory(device)


def run_one_by_one(model: torch.nn.Module, frames: Sequence, device, label: str,
                   backend: str = "mace-accel", warmup_frames: int = 4) -> ThroughputRecord:
    """Frames/s of one calculator call per frame: ``mace-accel`` (our calculator) or ``cueq``
    (mace's ``MACECalculator(enable_cueq=True)``)."""
    dtype = model_dtype(model)
    record = _record(label, dtype, f"{backend} one-by-one", frames)
    if backend == "cueq":
        missing = missing_requirement("cueq")
        if missing is not None:
            record.status = f"not installed: {missing}"
            return record
    try:
        with mace_device(device) as dev:
            if backend == "cueq":
                from mace_accel.bench.md import _mace_calculator

                calc = _mace_calculator("cueq", model, dev, dtype)
            else:
                from mace_accel.bench.md import _accel_calculator

                calc = _accel_calculator("cuda" if torch.device(dev).type == "cuda"
                                         else "reference", model, dev, dtype)
            for atoms in frames[:warmup_frames]:
                _forces(calc, atoms)
            t0 = time.perf_counter()
            for atoms in frames:
                _forces(calc, atoms)
            seconds = time.perf_counter() - t0
            return _finish(record, seconds, len(frames))
    except Exception as exc:  # reported in the record
        record.status = failure_status(exc)
        return record
    finally:
        free_memory(device)


def _forces(calc, atoms) -> None:
    atoms = atoms.copy()
    atoms.calc = calc
    atoms.get_potential_energy()
    atoms.get_forces()


def run_throughput(model: torch.nn.Module, device, label: str, n_frames: int = 2000,
                   one_by_one_frames: int = 200, seed: int = 0,
                   log=print) -> List[ThroughputRecord]:
    """The three rows of the module docstring on the same frames."""
    frames = make_frames(model, n_frames, seed)
    records = [run_batched(model, frames, device, label)]
    log(progress_line(records[-1]))
    for backend in ("mace-accel", "cueq"):
        records.append(run_one_by_one(model, frames[:one_by_one_frames], device, label, backend))
        log(progress_line(records[-1]))
    return records


def progress_line(r: ThroughputRecord) -> str:
    """The line the bench prints as a throughput record comes in (the runner's for the runs
    over several GPUs too)."""
    if r.status != OK:
        return f"   throughput {r.mode:<22} {r.frames} frames: {r.status}"
    return (f"   throughput {r.mode:<22} {r.frames} frames: {r.frames_per_s:.1f} frames/s, "
            f"{r.atoms_per_s:.0f} atoms/s ({r.model_calls} model calls)")
