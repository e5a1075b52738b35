"""``mace-accel bench``: side-by-side benchmark and GPU verification of MACE backends.

Modules, one job each: :mod:`.systems` (structures), :mod:`.backends` (each backend's model
from one source), :mod:`.timing` (CUDA-event / perf_counter timing, peak memory),
:mod:`.runner` (the loop and its records), :mod:`.maxsize` (largest system that fits),
:mod:`.profile` (where one call spends its time), :mod:`.md` (MD throughput),
:mod:`.training` (training-step time), :mod:`.report` (tables, JSON schema, plots),
:mod:`.cli` (the command). Importing this package does no work.
"""

from __future__ import annotations

__all__ = ["add_bench_parser"]


def __getattr__(name: str):
    if name in __all__:
        from mace_accel.bench import cli

        return getattr(cli, name)
    raise AttributeError(f"module 'mace_accel.bench' has no attribute {name!r}")
