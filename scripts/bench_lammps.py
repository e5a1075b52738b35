"""MD steps per second of LAMMPS with mace-accel's ML-IAP model, beside the ASE calculator's MD on
the same structure: what the LAMMPS path costs (host copies, exchanges, LAMMPS's own work) and
what several GPUs give.

    mace-accel convert MODEL model-mliap.pt --lammps --dtype float32
    python scripts/bench_lammps.py model-mliap.pt --atoms 864,6912 --ase
    mpirun -np 2 --bind-to none -x OMP_NUM_THREADS python scripts/bench_lammps.py model-mliap.pt --atoms 97556
    mpirun -np 2 python scripts/bench_lammps.py --exchange-only 512 --atoms 97556

Each size: a rattled fcc alloy of the model's elements (as ``mace-accel bench``), 300 K, NVE
velocity Verlet, 1 fs, a 1 Å neighbour skin; ``--warmup`` untimed steps, then ``--steps`` timed
ones. Printed by rank 0, one JSON line per run: steps/s, and the time per step inside the
model's ``compute_forces`` (``model_ms``), of which the ghost exchanges (``exchange_ms``: the
host copies and LAMMPS's communication, or the all-to-alls between the devices and their plan,
timed to their end); the rest is LAMMPS (neighbour lists, ML-IAP's pair arrays, communication,
integration: give it threads with ``OMP_NUM_THREADS``); ``pair_ms``, ``neigh_ms``, ``comm_ms``,
``modify_ms``, ``other_ms``: LAMMPS's own breakdown of a step; ``gpu_peak_gib``: rank 0's GPU memory
at its fullest during the timed steps (with the warm-up's CUDA graphs). With
``--ase``, the same structure's MD through :class:`mace_accel.MACEAccelCalculator` (CUDA graphs)
in the same process, and the ratio. ``--exchange-only W`` (no model file, no GPU): a stand-in
model that only runs LAMMPS's part of the exchanges, a forward and a reverse exchange in place of
a float32 host array ``[atoms + ghosts, W]`` each step, on a Cu fcc crystal (``exchange_ms``).
Needs a LAMMPS built by scripts/build_lammps.sh.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?",
                   help="an ML-IAP model file (mace-accel convert MODEL OUT --lammps)")
    p.add_argument("--atoms", default="864,6912", help="comma-separated sizes (fcc: 4n^3)")
    p.add_argument("--steps", type=int, default=50, help="timed MD steps (default 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed MD steps (default 10)")
    p.add_argument("--ase", action="store_true", help="also time the ASE calculator's MD")
    p.add_argument("--exchange-only", type=int, metavar="W",
                   help="time only LAMMPS's exchanges of W float32 values per atom (no model)")
    args = p.parse_args(argv)
    if (args.model is None) == (args.exchange_only is None):
        p.error("give a model file or --exchange-only W")
    return args


_FINALIZE = []  # LAMMPS's MPI finalize, called once at the end (mpirun expects it of each rank)


def _clocks(made):
    """``(model, exchanges)``: wall clocks around ``made``'s ``compute_forces`` and around the
    host exchanges (their copies and LAMMPS's communication), wrapped once."""
    import mace_accel.lammps as accel_lammps
    import mace_accel.lammps_peers as accel_peers
    from mace_accel.bench.timing import WallClock

    model_clock, exchange_clock = WallClock(), WallClock()
    made.compute_forces = model_clock.wrap(made.compute_forces)
    if isinstance(made, _ExchangeOnly):
        made.exchange = exchange_clock.wrap(made.exchange)
        return model_clock, exchange_clock
    for name in ("forward_exchange", "reverse_exchange"):
        setattr(accel_lammps._HostExchange, name,
                exchange_clock.wrap(getattr(accel_lammps._HostExchange, name)))
        # between the devices the collectives are queued: timed to their end (a sync each side)
        setattr(accel_peers.PeerExchange, name,
                exchange_clock.wrap(_synced(getattr(accel_peers.PeerExchange, name))))
    accel_peers.PeerPlan.__init__ = exchange_clock.wrap(_synced(accel_peers.PeerPlan.__init__))
    return model_clock, exchange_clock


def _synced(fn):
    """``fn`` with the GPU's queued work finished before and after it (where there is a GPU)."""
    def synced(*args, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        try:
            return fn(*args, **kwargs)
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()

    return synced


class _ExchangeOnly:
    """A stand-in ML-IAP unified model for Cu that only exchanges (zero energies and forces):
    each call a forward and a reverse exchange in place of a float32 host array ``[ntotal, W]``,
    as :class:`mace_accel.lammps._HostExchange` hands LAMMPS, without the copies to a GPU."""

    def __init__(self, width: int, cutoff: float = 6.0) -> None:
        self.element_types, self.ndescriptors, self.nparams = ["Cu"], 1, 1
        self.rcutfac, self.exchange_width, self.dtype = 0.5 * cutoff, width, "float32"
        self.interface = None
        self._rows = np.zeros((0, width), dtype=np.float32)

    def compute_descriptors(self, data) -> None:
        pass

    def compute_gradients(self, data) -> None:
        pass

    def compute_forces(self, data) -> None:
        n_total = int(data.ntotal)
        if self._rows.shape[0] < n_total:  # kept between calls, as the model's host array
            self._rows = np.ones((n_total + n_total // 4, self.exchange_width), np.float32)
        self.exchange(data, self._rows[:n_total])
        data.eatoms = np.zeros(int(data.nlocal))
        data.energy = 0.0
        data.update_pair_forces(np.zeros((int(data.npairs), 3)))

    def exchange(self, data, rows: np.ndarray) -> None:
        data.forward_exchange(rows, rows, self.exchange_width)
        data.reverse_exchange(rows, rows, self.exchange_width)


def _lammps_md(made, clocks, atoms, steps: int, warmup: int) -> dict:
    from lammps import lammps, mliap

    model_clock, exchange_clock = clocks
    log = Path(tempfile.mkdtemp()) / "log.lammps"  # rank 0's, for the timing breakdown
    lmp = lammps(cmdargs=["-log", str(log), "-screen", "none", "-nocite"])
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
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    lmp.command(f"run {steps} pre no post yes")
    seconds = time.perf_counter() - t0
    ranks = lmp.extract_setting("world_size")
    rank = lmp.extract_setting("world_rank")
    record = {"path": "lammps", "ranks": ranks, "atoms": len(atoms), "steps": steps,
              "steps_per_s": steps / seconds, "ms_per_step": 1e3 * seconds / steps,
              "model_ms": 1e3 * model_clock.seconds / steps,
              "exchange_ms": 1e3 * exchange_clock.seconds / steps,
              "pe": lmp.get_thermo("pe")}
    if rank == 0:
        record.update(_sections(log, steps))
    if torch.cuda.is_available():  # this rank's GPU memory at its fullest (since the warm-up)
        record["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    lmp.close()
    _FINALIZE.append(lmp.lib.lammps_mpi_finalize)
    return record if rank == 0 else {}


def _sections(log: Path, steps: int) -> dict:
    """LAMMPS's own breakdown of the timed run (the ranks' average per step, ms): ``pair_ms``
    (the model's call and ML-IAP's pair arrays), ``neigh_ms`` (neighbour lists), ``comm_ms``
    (ghost atoms, forces and the waits between the ranks), ``modify_ms`` (the integrator),
    ``other_ms``; read from the end of the run's log."""
    found = {}
    text = log.read_text() if log.exists() else ""
    for line in text[text.rfind("MPI task timing breakdown"):].splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 6 and cells[0] in ("Pair", "Neigh", "Comm", "Modify", "Other"):
            found[f"{cells[0].lower()}_ms"] = 1e3 * float(cells[2]) / steps
    return found


def _ase_md(model, atoms, steps: int, warmup: int) -> dict:
    """The ASE calculator's MD of the plain ``model`` (its own copy, in the file's dtype)."""
    from mace_accel.bench.md import run_md

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    md = run_md("mace-accel", model, atoms, device, "bench", steps=steps, warmup_steps=warmup,
                allow_reference=not torch.cuda.is_available())
    return {"path": "ase", "atoms": len(atoms), "steps": steps, "status": md.status,
            "steps_per_s": md.steps_per_s, "ms_per_step": md.ms_per_step,
            "model_ms": md.model_ms}


def _copper(size: int):
    """A Cu fcc crystal (a = 3.61 Å) of about ``size`` atoms (4 n^3)."""
    from ase.build import bulk

    n = max(1, round((size / 4) ** (1 / 3)))
    return bulk("Cu", "fcc", a=3.61, cubic=True).repeat((n, n, n))


def main(argv=None) -> int:
    args = _parse(argv)
    from mace_accel.lammps import import_before_lammps

    import_before_lammps()  # before LAMMPS's library is loaded
    from mace_accel.bench.systems import build_system
    from mace_accel.models.batch import model_info

    if args.exchange_only:
        made, plain, info = _ExchangeOnly(args.exchange_only), None, None
    else:
        made = torch.load(args.model, weights_only=False)
        # the plain model for the ASE runs, a copy: LAMMPS's rank casts, moves and accelerates
        # made.model in place
        plain = (copy.deepcopy(made.model).to(dtype=getattr(torch, made.dtype)) if args.ase
                 else None)
        info = model_info(made.model)
    clocks = _clocks(made)
    for size in (int(s) for s in args.atoms.split(",")):
        atoms = (build_system(info, size, kind="fcc").atoms if info is not None
                 else _copper(size))
        record = _lammps_md(made, clocks, atoms, args.steps, args.warmup)
        if record:
            record["dtype"] = made.dtype
            print(json.dumps(record), flush=True)
        if args.ase and record and plain is not None:
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
