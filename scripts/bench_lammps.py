"""MD steps per second of LAMMPS with mace-accel's ML-IAP model, beside the ASE calculator's MD on
the same structure: what the LAMMPS path costs (host copies, exchanges, LAMMPS's own work) and
what several GPUs give.

    mace-accel convert MODEL model-mliap.pt --lammps --dtype float32
    python scripts/bench_lammps.py model-mliap.pt --atoms 864,6912 --ase
    mpirun -np 2 python scripts/bench_lammps.py model-mliap.pt --atoms 97556

Each size: a rattled fcc alloy of the model's elements (as ``mace-accel bench``), 300 K, NVE
velocity Verlet, 1 fs, a 1 Å neighbour skin; ``--warmup`` untimed steps, then ``--steps`` timed
ones. Printed by rank 0, one JSON line per run: steps/s, and the time per step inside the
model's ``compute_forces`` (``model_ms``), of which the host copies of the ghost exchanges
(``exchange_ms``); the rest is LAMMPS (neighbour lists, communication, integration). With
``--ase``, the same structure's MD through :class:`mace_accel.MACEAccelCalculator` (CUDA graphs)
in the same process, and the ratio. Needs a LAMMPS built by scripts/build_lammps.sh.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import numpy as np
import torch


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="an ML-IAP model file (mace-accel convert MODEL OUT --lammps)")
    p.add_argument("--atoms", default="864,6912", help="comma-separated sizes (fcc: 4n^3)")
    p.add_argument("--steps", type=int, default=50, help="timed MD steps (default 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed MD steps (default 10)")
    p.add_argument("--ase", action="store_true", help="also time the ASE calculator's MD")
    return p.parse_args(argv)


_FINALIZE = []  # LAMMPS's MPI finalize, called once at the end (mpirun expects it of each rank)


def _clocks(made):
    """``(model, exchanges)``: wall clocks around ``made``'s ``compute_forces`` and around the
    host exchanges (their copies and LAMMPS's communication), wrapped once."""
    import mace_accel.lammps as accel_lammps
    from mace_accel.bench.timing import WallClock

    model_clock, exchange_clock = WallClock(), WallClock()
    made.compute_forces = model_clock.wrap(made.compute_forces)
    for name in ("forward_exchange", "reverse_exchange"):
        setattr(accel_lammps._HostExchange, name,
                exchange_clock.wrap(getattr(accel_lammps._HostExchange, name)))
    return model_clock, exchange_clock


def _lammps_md(made, clocks, atoms, steps: int, warmup: int) -> dict:
    from lammps import lammps, mliap

    model_clock, exchange_clock = clocks
    lmp = lammps(cmdargs=["-log", "none", "-screen", "none", "-nocite"])
    mliap.activate_mliappy(lmp)
    mliap.load_unified(made)
    elements = list(made.element_types)
    cell = np.asarray(atoms.cell)
    lmp.commands_list([
        "units metal", "atom_style atomic", "atom_modify map array", "boundary p p p",
        f"region box prism 0 {float(cell[0, 0])!r} 0 {float(cell[1, 1])!r} 0 "
        f"{float(cell[2, 2])!r} 0 0 0 units box",
        f"create_box {len(elements)} box"])
    types = [elements.index(s) + 1 for s in atoms.get_chemical_symbols()]
    lmp.create_atoms(len(atoms), list(range(1, len(atoms) + 1)), types,
                     atoms.positions.reshape(-1).tolist())
    from ase.data import atomic_masses, atomic_numbers

    lmp.commands_list(
        [f"mass {i + 1} {float(atomic_masses[atomic_numbers[e]])!r}"
         for i, e in enumerate(elements)]
        + [f"pair_style mliap unified EXISTS 0 exchange {made.exchange_width}",
           f"pair_coeff * * {' '.join(elements)}",
           "neighbor 1.0 bin", "neigh_modify every 1 delay 0 check yes",
           "velocity all create 300.0 4928459 mom yes rot yes dist gaussian",
           "timestep 0.001", "fix nve all nve", "thermo 0", f"run {warmup}"])
    model_clock.seconds = exchange_clock.seconds = 0.0
    t0 = time.perf_counter()
    lmp.command(f"run {steps} pre no post no")
    seconds = time.perf_counter() - t0
    ranks = lmp.extract_setting("world_size")
    rank = lmp.extract_setting("world_rank")
    record = {"path": "lammps", "ranks": ranks, "atoms": len(atoms), "steps": steps,
              "steps_per_s": steps / seconds, "ms_per_step": 1e3 * seconds / steps,
              "model_ms": 1e3 * model_clock.seconds / steps,
              "exchange_ms": 1e3 * exchange_clock.seconds / steps,
              "pe": lmp.get_thermo("pe")}
    lmp.close()
    _FINALIZE.append(lmp.lib.lammps_mpi_finalize)
    return record if rank == 0 else {}


def _ase_md(model, atoms, steps: int, warmup: int) -> dict:
    """The ASE calculator's MD of the plain ``model`` (its own copy, in the file's dtype)."""
    from mace_accel.bench.md import run_md

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    md = run_md("mace-accel", model, atoms, device, "bench", steps=steps, warmup_steps=warmup,
                allow_reference=not torch.cuda.is_available())
    return {"path": "ase", "atoms": len(atoms), "steps": steps, "status": md.status,
            "steps_per_s": md.steps_per_s, "ms_per_step": md.ms_per_step,
            "model_ms": md.model_ms}


def main(argv=None) -> int:
    args = _parse(argv)
    from mace_accel.lammps import import_before_lammps

    import_before_lammps()  # before LAMMPS's library is loaded
    from mace_accel.bench.systems import build_system
    from mace_accel.models.batch import model_info

    made = torch.load(args.model, weights_only=False)
    # the plain model for the ASE runs, a copy: LAMMPS's rank casts, moves and accelerates
    # made.model in place
    plain = (copy.deepcopy(made.model).to(dtype=getattr(torch, made.dtype)) if args.ase
             else None)
    clocks = _clocks(made)
    info = model_info(made.model)
    for size in (int(s) for s in args.atoms.split(",")):
        atoms = build_system(info, size, kind="fcc").atoms
        record = _lammps_md(made, clocks, atoms, args.steps, args.warmup)
        if record:
            record["dtype"] = made.dtype
            print(json.dumps(record), flush=True)
        if args.ase and record:
            ase = _ase_md(plain, atoms, args.steps, args.warmup)
            ase["dtype"] = made.dtype
            print(json.dumps(ase), flush=True)
            if ase.get("steps_per_s"):
                print(f"{len(atoms)} atoms: LAMMPS {record['steps_per_s']:.1f} steps/s "
                      f"({record['ranks']} rank), ASE {ase['steps_per_s']:.1f} steps/s: "
                      f"{record['steps_per_s'] / ase['steps_per_s']:.2f}x", flush=True)
    if _FINALIZE:
        _FINALIZE[-1]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
