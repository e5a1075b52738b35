"""MD throughput through ASE calculators: steps per second including the neighbour list, the
host-device transfers and the integrator, i.e. what a user running MD gets.

Calculators: ``mace-accel`` = :class:`mace_accel.MACEAccelCalculator`; ``e3nn``, ``cueq`` and
``oeq`` = mace's ``MACECalculator`` without and with ``enable_cueq`` / ``enable_oeq``. As in
:mod:`.backends`, a missing package is reported ``not installed`` (mace's calculator would
otherwise run plain e3nn under the cueq name) and nothing is dropped.
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
from mace_accel.bench.timing import free_memory
from mace_accel.errors import ConfigError

DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64"}


@dataclasses.dataclass
class MDRecord:
    """MD throughput of one calculator on one system (schema: see :mod:`.report`)."""

    model: str
    dtype: str
    backend: str
    status: str
    atoms: int
    steps: int
    warmup_steps: int
    timestep_fs: float
    ms_per_step: Optional[float] = None
    steps_per_s: Optional[float] = None
    ns_per_day: Optional[float] = None
    detail: str = ""


def _mace_calculator(backend: str, model: torch.nn.Module, device: str, dtype: torch.dtype):
    from mace_accel._e3nn_compat import import_mace

    import_mace()
    from mace.calculators import MACECalculator

    return MACECalculator(models=copy.deepcopy(model), device=device,
                          default_dtype=DTYPE_NAMES[dtype], enable_cueq=backend == "cueq",
                          enable_oeq=backend == "oeq")


def _accel_calculator(backend: str, model: torch.nn.Module, device: str, dtype: torch.dtype):
    from mace_accel.calculator import MACEAccelCalculator

    return MACEAccelCalculator(model=copy.deepcopy(model), device=device,
                               default_dtype=DTYPE_NAMES[dtype], backend=backend,
                               fallback="error")  # a benchmark must not time a fallback


def _thermalize(atoms, temperature_K: float, seed: int) -> None:
    """Maxwell-Boltzmann velocities (ase >= 3.27 renamed the function)."""
    from ase.md import velocitydistribution as vd

    rng = np.random.default_rng(seed)
    if hasattr(vd, "thermalize_momenta"):
        vd.thermalize_momenta(atoms, temperature_K, rng=rng)
    else:
        vd.MaxwellBoltzmannDistribution(atoms, temperature_K=temperature_K, rng=rng)


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
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    record = MDRecord(label, DTYPE_NAMES[dtype], backend, OK, len(atoms), steps, warmup_steps,
                      timestep_fs)
    missing = missing_requirement(backend)
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
            seconds = _steps(atoms, calc, steps, timestep_fs)
    except Exception as exc:  # reported in the record; the other calculators still run
        record.status = failure_status(exc)
        return record
    finally:
        del calc
        free_memory(device)
    record.ms_per_step = 1e3 * seconds / steps
    record.steps_per_s = steps / seconds
    record.ns_per_day = record.steps_per_s * timestep_fs * 86400 * 1e-6
    return record
