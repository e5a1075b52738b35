"""MD throughput through ASE calculators: steps per second including the neighbour list, the
host-device transfers and the integrator, i.e. what a user running MD gets.

Calculators: ``mace-accel`` = :class:`mace_accel.MACEAccelCalculator`; ``e3nn``, ``cueq`` and
``oeq`` = mace's ``MACECalculator`` without and with ``enable_cueq`` / ``enable_oeq``;
``cueq-compile`` = mace's ``MACECalculator(enable_cueq=True, compile_mode="reduce-overhead")``
(torch.compile with CUDA graphs: the strongest thing a mace user has today; compiling takes
minutes, spent in the warm-up steps). As in :mod:`.backends`, a missing package is reported
``not installed`` (mace's calculator would otherwise run plain e3nn under the cueq name) and
nothing is dropped.

Each step's time is split into the calculator (``calc_ms``: everything inside ``calculate``)
and the rest (the integrator, ASE's bookkeeping); for mace-accel the calculator's part is split
again into checks, neighbour list and model (:class:`mace_accel.calculator.CallTimings`).

:func:`nve_drift` runs a long NVE trajectory and fits the drift of the total energy.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Optional

import numpy as np
import torch

from mace_accel.bench.backends import (
    BACKENDS,
    OK,
    cuda_or_reference,
    failure_status,
    mace_device,
    missing_requirement,
    preserve_default_dtype,
)
from mace_accel.bench.timing import WallClock, free_memory
from mace_accel.errors import ConfigError
from mace_accel.models.batch import model_dtype, model_info
from mace_accel.options import dtype_name


@dataclasses.dataclass
class _Trajectory:
    """What every MD record names: model, dtype, calculator, outcome, system size, steps."""

    model: str
    dtype: str
    backend: str
    status: str
    atoms: int
    steps: int


@dataclasses.dataclass
class MDRecord(_Trajectory):
    """MD throughput of one calculator on one system (schema: see :mod:`.report`)."""

    warmup_steps: int
    timestep_fs: float
    ms_per_step: Optional[float] = None
    steps_per_s: Optional[float] = None
    ns_per_day: Optional[float] = None
    calc_ms: Optional[float] = None
    rest_ms: Optional[float] = None
    checks_ms: Optional[float] = None
    neighbours_ms: Optional[float] = None
    model_ms: Optional[float] = None
    detail: str = ""


MD_BACKENDS = BACKENDS + ("cueq-compile",)


def _mace_calculator(backend: str, model: torch.nn.Module, device: str, dtype: torch.dtype):
    from mace_accel._e3nn_compat import import_mace

    import_mace()
    from mace.calculators import MACECalculator

    extra = {"compile_mode": "reduce-overhead"} if backend == "cueq-compile" else {}
    return MACECalculator(models=copy.deepcopy(model), device=device,
                          default_dtype=dtype_name(dtype),
                          enable_cueq=backend in ("cueq", "cueq-compile"),
                          enable_oeq=backend == "oeq", head=bench_head(model), **extra)


def _accel_calculator(backend: str, model: torch.nn.Module, device: str, dtype: torch.dtype):
    from mace_accel.calculator import MACEAccelCalculator

    return MACEAccelCalculator(model=copy.deepcopy(model), device=device,
                               default_dtype=dtype_name(dtype), backend=backend,
                               fallback="error",  # a benchmark must not time a fallback
                               head=bench_head(model))


def bench_head(model: torch.nn.Module) -> str:
    """The head every benchmark evaluates: the model's last (as a batch without a head does)."""
    return model_info(model).heads[-1]


def _thermalize(atoms, temperature_K: float, seed: int) -> None:
    """Maxwell-Boltzmann velocities drawn from ``seed``."""
    from mace_accel.runs.tasks import maxwell_boltzmann

    maxwell_boltzmann(atoms, temperature_K, np.random.default_rng(seed))


def _steps(atoms, calc, n: int, timestep_fs: float) -> float:
    """Run ``n`` velocity-Verlet steps; returns the wall time in seconds."""
    from ase import units
    from ase.md.verlet import VelocityVerlet

    atoms.calc = calc
    dyn = VelocityVerlet(atoms, timestep=timestep_fs * units.fs)
    t0 = time.perf_counter()
    dyn.run(n)
    return time.perf_counter() - t0


def run_md(backend: str, model: torch.nn.Module, atoms, device: torch.device | str,
           label: str, steps: int = 20, warmup_steps: int = 5, timestep_fs: float = 1.0,
           temperature_K: float = 300.0, allow_reference: bool = False,
           seed: int = 0) -> MDRecord:
    """Steps per second of NVE velocity-Verlet MD with ``backend``'s calculator.

    Args:
        backend: one of :data:`mace_accel.bench.backends.BACKENDS`.
        model: the source (e3nn) MACE model; each calculator gets its own copy.
        atoms: the structure (copied; velocities drawn at ``temperature_K``).
        label: model name for the record.
        steps: timed MD steps, after ``warmup_steps`` untimed ones.

    Returns:
        an :class:`MDRecord`; failures are in its ``status``, never raised.
    """
    if backend not in MD_BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose from {', '.join(MD_BACKENDS)}")
    dtype = model_dtype(model)
    record = MDRecord(label, dtype_name(dtype), backend, OK, len(atoms), steps, warmup_steps,
                      timestep_fs)
    missing = missing_requirement("cueq" if backend == "cueq-compile" else backend)
    if missing is not None:
        record.status = f"not installed: {missing}"
        return record
    atoms = atoms.copy()
    _thermalize(atoms, temperature_K, seed)
    calc = None
    try:
        with preserve_default_dtype(), mace_device(device) as dev:
            if backend == "mace-accel":
                name, calc, status, detail = cuda_or_reference(
                    lambda b: _accel_calculator(b, model, dev, dtype), allow_reference)
                record.backend, record.status, record.detail = name, status, detail
                if calc is None:
                    return record
            else:
                calc = _mace_calculator(backend, model, dev, dtype)
            _steps(atoms, calc, warmup_steps, timestep_fs)
            if hasattr(calc, "timings"):  # count the timed steps only
                calc.timings = type(calc.timings)()
            clock = WallClock()  # everything inside ``calculate``
            calc.calculate = clock.wrap(calc.calculate)
            seconds = _steps(atoms, calc, steps, timestep_fs)
            timings = getattr(calc, "timings", None)
    except Exception as exc:  # reported in the record; the other calculators still run
        record.status = failure_status(exc)
        return record
    finally:
        del calc
        free_memory(device)
    record.ms_per_step = 1e3 * seconds / steps
    record.steps_per_s = steps / seconds
    record.ns_per_day = record.steps_per_s * timestep_fs * 86400 * 1e-6
    record.calc_ms = 1e3 * clock.seconds / steps
    record.rest_ms = record.ms_per_step - record.calc_ms
    if timings is not None and timings.calls:
        split = timings.per_call_ms()
        record.checks_ms, record.neighbours_ms, record.model_ms = (
            split["checks"], split["neighbours"], split["model"])
    return record


DRIFT_BACKENDS = ("mace-accel", "e3nn-graphs")


@dataclasses.dataclass
class DriftRecord(_Trajectory):
    """Energy conservation of an NVE run (velocity Verlet).

    Attributes:
        drift_meV_per_atom_per_ns: slope of a straight line fitted to the total energy per
            atom against time.
        max_dev_meV_per_atom: largest deviation of the total energy per atom from its start.
        steps_per_s: of the whole run, samples included.
    """

    timestep_fs: float
    temperature_K: float
    drift_meV_per_atom_per_ns: Optional[float] = None
    max_dev_meV_per_atom: Optional[float] = None
    steps_per_s: Optional[float] = None
    detail: str = ""


def nve_drift(backend: str, model: torch.nn.Module, atoms, device: torch.device | str,
              label: str, steps: int = 10_000, timestep_fs: float = 1.0,
              temperature_K: float = 300.0, sample_every: int = 10,
              seed: int = 0) -> DriftRecord:
    """Total-energy drift of ``steps`` NVE velocity-Verlet steps.

    Backends: ``mace-accel`` (:class:`~mace_accel.MACEAccelCalculator`, fused kernels and CUDA
    graphs on a GPU) and ``e3nn-graphs``: the same calculator with the surgery reverted, i.e.
    mace's own e3nn code behind the same integrator, neighbour list and CUDA graphs, so that
    only the model's arithmetic differs (mace's ``MACECalculator`` would take an hour for 10,000
    steps of e3nn).

    Returns:
        a :class:`DriftRecord`; failures are in its ``status``, never raised.
    """
    from ase import units
    from ase.md.verlet import VelocityVerlet

    from mace_accel.surgery import revert

    if backend not in DRIFT_BACKENDS:
        raise ConfigError(f"unknown drift backend {backend!r}; choose from "
                          f"{', '.join(DRIFT_BACKENDS)}")
    dtype = model_dtype(model)
    record = DriftRecord(label, dtype_name(dtype), backend, OK, len(atoms), steps, timestep_fs,
                         temperature_K)
    atoms = atoms.copy()
    _thermalize(atoms, temperature_K, seed)
    energies: list = []
    calc = None
    try:
        with preserve_default_dtype(), mace_device(device) as dev:
            calc = _accel_calculator("auto", model, dev, dtype)
            if backend == "e3nn-graphs":
                revert(calc.model)
            record.detail = f"backend {calc.backend}, graphs {calc.graphs}"
            atoms.calc = calc
            dyn = VelocityVerlet(atoms, timestep=timestep_fs * units.fs)
            dyn.attach(lambda: energies.append(atoms.get_total_energy()), interval=sample_every)
            t0 = time.perf_counter()
            dyn.run(steps)
            seconds = time.perf_counter() - t0
    except Exception as exc:  # reported in the record
        record.status = failure_status(exc)
        return record
    finally:
        atoms.calc = calc = None
        free_memory(device)
    per_atom = np.asarray(energies) / len(atoms)
    if not np.all(np.isfinite(per_atom)):
        record.status = "failed: the total energy became NaN or infinite"
        return record
    t_ns = np.arange(len(per_atom)) * sample_every * timestep_fs * 1e-6
    if len(per_atom) > 1:
        record.drift_meV_per_atom_per_ns = 1e3 * float(np.polyfit(t_ns, per_atom, 1)[0])
    record.max_dev_meV_per_atom = 1e3 * float(np.abs(per_atom - per_atom[0]).max())
    record.steps_per_s = steps / seconds
    return record
