"""LAMMPS with mace-accel's ML-IAP model (``pair_style mliap unified``) on 1, 2 and 4 MPI ranks
equals the ASE calculator: the energy, every force and the virial, for the bundled model and
for an MPA-0-type model (Agnesi transform, ZBL, Density blocks); a short NVE trajectory is the
same on 1 and 2 ranks. Needs a LAMMPS built by scripts/build_lammps.sh for this Python (the
tests skip without one) and, for several ranks, mpirun."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest
import torch

from test_lammps_model import calculator_results

pytestmark = pytest.mark.lammps
RUN = Path(__file__).with_name("lammps_run.py")
# 1 eV/Å^3 in bar as LAMMPS's metal units convert it (force->nktv2p, update.cpp): 8e-8 off the
# CODATA value 1.602176634e6, which would show in a float64 comparison
BAR_PER_EV_A3 = 1.6021765e6


def _lammps_unavailable() -> str:
    from mace_accel.lammps import import_before_lammps

    import_before_lammps()  # before LAMMPS's library is loaded in this process
    try:
        from lammps import lammps
    except ImportError:
        return "the lammps Python module is not installed (bash scripts/build_lammps.sh SRC)"
    lmp = lammps(cmdargs=["-log", "none", "-screen", "none", "-nocite"])
    try:
        if not lmp.has_package("ML-IAP") or not lmp.has_package("PYTHON"):
            return "this LAMMPS has no ML-IAP with Python (bash scripts/build_lammps.sh SRC)"
    finally:
        lmp.close()
    return ""


def _build_lammps() -> None:
    """Fetch, patch and build LAMMPS under ~/.cache/mace-accel (CI; reused where present):
    Open MPI from apt where mpicxx is missing, Cython from PyPI."""
    cache = Path.home() / ".cache" / "mace-accel"
    scripts = Path(__file__).resolve().parent.parent / "scripts"
    steps = []
    if shutil.which("mpicxx") is None:
        steps += [["apt-get", "update", "-q"],
                  ["apt-get", "install", "-y", "-q", "libopenmpi-dev", "openmpi-bin"]]
    steps += [[sys.executable, "-m", "pip", "install", "-q", "cython"],
              ["bash", str(scripts / "fetch_lammps.sh"), str(cache / "lammps-src")],
              ["bash", str(scripts / "build_lammps.sh"), str(cache / "lammps-src"),
               str(cache / "lammps-build")]]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               DEBIAN_FRONTEND="noninteractive")
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            pytest.fail(f"building LAMMPS for the tests failed at {' '.join(step)}:\n"
                        f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    importlib.invalidate_caches()  # the lammps module was installed after this process began


def _cached_build_lacks_patches() -> str:
    """Why the build under ~/.cache/mace-accel (CI's) needs to be made again: the patches of
    scripts/lammps/series it was not made with (a new or changed patch), else ''."""
    patches = Path(__file__).resolve().parent.parent / "scripts" / "lammps"
    stamp = Path.home() / ".cache" / "mace-accel" / "lammps-build" / ".mace-accel-patches"
    made = set(stamp.read_text().split("\n")) if stamp.exists() else set()
    missing = []
    for name in (patches / "series").read_text().split():
        if name.startswith("#") or not name.endswith(".patch"):
            continue
        digest = hashlib.sha256((patches / name).read_bytes()).hexdigest()[:16]
        if f"{name} {digest}" not in made:
            missing.append(name)
    return f"the cached LAMMPS lacks {', '.join(missing)}" if missing else ""


@pytest.fixture(scope="module")
def lammps_ready():
    """A LAMMPS with ML-IAP's Python coupling for this Python: present, built here on CI
    (``CI`` set: about 35 minutes on 2 cores, once; again, in minutes, where a patch is new or
    changed), else the tests skip."""
    why = _lammps_unavailable()
    if os.environ.get("CI") and not why:
        why = _cached_build_lacks_patches()
    if why and os.environ.get("CI"):
        _build_lammps()
        why = _lammps_unavailable()
        if why:
            pytest.fail(f"LAMMPS was built but {why}")
    if why:
        pytest.skip(why + "; bash scripts/fetch_lammps.sh SRC first")


def _structure(atoms, made) -> dict:
    from ase.data import atomic_masses, atomic_numbers

    cell = np.asarray(atoms.cell)
    return {"symbols": atoms.get_chemical_symbols(), "positions": atoms.positions.tolist(),
            "cell": cell.tolist(), "elements": made.element_types,
            "masses": [float(atomic_masses[atomic_numbers[e]]) for e in made.element_types],
            "exchange": made.exchange_width}


def _run(tmp_path: Path, model_path: Path, structure: dict, ranks: int, steps: int = 0,
         gpus: bool = False) -> dict:
    """One LAMMPS run (tests/lammps_run.py) on ``ranks`` MPI ranks; without ``gpus`` the GPUs
    are hidden (the reference backend on the CPU), with it each rank takes its own GPU."""
    return _run_jobs(tmp_path, [(model_path, structure, steps)], ranks, gpus)[0]


def _run_jobs(tmp_path: Path, jobs: List[Tuple[Path, dict, int]], ranks: int,
              gpus: bool = False) -> List[dict]:
    """LAMMPS runs of ``(model file, structure, MD steps)`` one after another in one launch of
    tests/lammps_run.py on ``ranks`` MPI ranks (one start of the ranks' Pythons for all)."""
    spec = tmp_path / f"jobs-{ranks}.json"
    outs = [tmp_path / f"out-{ranks}-{k}.json" for k in range(len(jobs))]
    spec.write_text(json.dumps([{"model": str(model), "structure": structure, "out": str(out),
                                 "steps": steps}
                                for (model, structure, steps), out in zip(jobs, outs)]))
    command = [sys.executable, str(RUN), str(spec)]
    if ranks > 1:
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            pytest.skip("mpirun not found")
        command = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(ranks)] + command
    # one rank makes ML-IAP's pair arrays on two threads (mliap-threaded-pairs.patch): the
    # equality with the calculator then holds for them too
    env = dict(os.environ, OMP_NUM_THREADS="2" if ranks == 1 else "1")
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(out.read_text()) for out in outs]


def _alloy(atoms_numbers, repeat=(3, 3, 3)):
    """An fcc alloy of the model's elements in LAMMPS's cell form (a, b, c along x, xy, ...)."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(repeat)
    rng = np.random.default_rng(3)
    atoms.numbers = rng.choice(atoms_numbers, size=len(atoms))
    atoms.rattle(stdev=0.05, seed=4)
    return atoms


def _lammps_virial(virial: np.ndarray) -> np.ndarray:
    """A ``[3, 3]`` virial in the order of LAMMPS's pressure tensor (xx yy zz xy xz yz)."""
    return np.asarray([virial[0, 0], virial[1, 1], virial[2, 2], virial[0, 1], virial[0, 2],
                       virial[1, 2]])


def _check(result, energy, forces, virial, volume):
    assert result["energy"] == pytest.approx(energy, rel=1e-10, abs=1e-10)
    for name in ("forces", "forces_without_virial"):  # per pair, and (one rank) per atom
        np.testing.assert_allclose(np.asarray(result[name]), forces, atol=1e-9)
    # LAMMPS's virial pressure (bar): the virial per volume; the per-atom virial (bar Å^3)
    # sums to minus the virial
    want = _lammps_virial(virial) / volume
    for got in (np.asarray(result["virial_bar"]) / BAR_PER_EV_A3,
                -np.asarray(result["peratom_virial_sum"]) / BAR_PER_EV_A3 / volume):
        np.testing.assert_allclose(got, want, atol=1e-9)
        assert np.linalg.norm(got - want) <= 1e-10 * np.linalg.norm(want)  # as the GPU test


@pytest.fixture(scope="module")
def files(tmp_path_factory, lammps_ready):
    """The bundled model and an MPA-0-type model, as model files and as LAMMPS files."""
    from mace_accel import cli
    from mace_accel.models.architectures import build_model
    from mace_accel.models.checkpoint import default_model_path, save_model

    from fine_tuning import SMALL_DENSITY

    folder = tmp_path_factory.mktemp("lammps")
    made = {}
    density = build_model(SMALL_DENSITY, dtype=torch.float64, seed=4)
    save_model(density, folder / "density.model")
    for name, path in (("bundled", default_model_path()), ("density", folder / "density.model")):
        out = folder / f"{name}-mliap.pt"
        assert cli.main(["convert", str(path), str(out), "--lammps"]) == 0
        made[name] = (Path(path), out, torch.load(out, weights_only=False))
    return made


TRAJECTORY_STEPS = 10


@pytest.fixture(scope="module")
def cpu_runs(files, tmp_path_factory):
    """``ranks -> {name: result}``: the runs of one rank count in one launch, made on first use:
    both models' alloys (the bundled model's then runs a short NVE trajectory on one and two
    ranks), on one and two ranks the bundled model's alloy in a tilted box, in a box that is
    not periodic along z and under hybrid/overlay, and on two ranks its slab and its float32
    file."""
    made: Dict[int, Dict[str, dict]] = {}

    def runs(ranks: int) -> Dict[str, dict]:
        if ranks not in made:
            folder = tmp_path_factory.mktemp(f"ranks{ranks}")
            jobs = {name: (files[name][1], _structure(_test_alloy(files[name][2]), files[name][2]),
                           TRAJECTORY_STEPS if name == "bundled" and ranks <= 2 else 0)
                    for name in ("bundled", "density")}
            if ranks <= 2:
                bundled = files["bundled"]
                for name, (structure, settings) in OTHER_SETUPS.items():
                    jobs[name] = (bundled[1],
                                  dict(_structure(structure(bundled[2]), bundled[2]), **settings),
                                  0)
            if ranks == 2:
                bundled = files["bundled"]
                jobs["slab"] = (bundled[1], _structure(_slab(bundled[2]), bundled[2]), 0)
                float32 = _converted(bundled[0], folder / "bundled-float32.pt", "float32")
                jobs["float32"] = (float32, _structure(_test_alloy(bundled[2]), bundled[2]), 0)
            made[ranks] = dict(zip(jobs, _run_jobs(folder, list(jobs.values()), ranks)))
        return made[ranks]

    return runs


def _test_alloy(made):
    """The structure of the equality tests: an alloy of (at most three of) the model's
    elements."""
    return _alloy([int(z) for z in made.model.atomic_numbers][:3])


def _tilted(made):
    """The test alloy in a triclinic box (LAMMPS's tilts xy, xz, yz), its atoms at the same
    fractional coordinates."""
    atoms = _test_alloy(made)
    length = atoms.cell[0, 0]
    atoms.set_cell([[length, 0, 0], [0.9, length, 0], [0.6, -0.7, length]], scale_atoms=True)
    return atoms


def _in_vacuum(made):
    """The test alloy as a film between two vacuum layers along z, each wider than the cutoff:
    the same energy, forces and virial in a box not periodic along z (LAMMPS's boundary
    ``p p f``) as in this periodic one."""
    atoms = _test_alloy(made)
    atoms.positions[:, 2] += 10.0
    atoms.set_cell([atoms.cell[0, 0], atoms.cell[1, 1], atoms.cell[2, 2] + 20.0])
    return atoms


# the bundled model's runs in other setups, on one and two ranks: name -> (its structure, the
# run's settings beyond it; tests/lammps_run.py)
OTHER_SETUPS = {
    # a triclinic box: on one rank its tilts make the calculator's cell
    "tilted": (_tilted, {}),
    # LAMMPS's boundary p p f: one rank asks for the pair arrays there and takes the virial from
    # the pair forces (the calculator has no stress without three periodic directions)
    "open": (_in_vacuum, {"boundary": "p p f"}),
    # pair_style hybrid/overlay with a pair style of zero forces: LAMMPS takes the virial as
    # the sum of x f over all forces, so one rank hands it the forces per pair
    "overlay": (_test_alloy, {"overlay": True}),
}


def _slab(made):
    """The test alloy as a slab in a box four times as long along x: with two ranks the second
    rank's half holds no atom, only ghosts."""
    atoms = _test_alloy(made)
    atoms.positions[:, 0] += 1.0  # none across x = 0 (it would be wrapped into the far half)
    atoms.set_cell([4 * atoms.cell[0, 0], atoms.cell[1, 1], atoms.cell[2, 2]])
    return atoms


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("name", ["bundled", "density"])
def test_lammps_equals_the_calculator(files, cpu_runs, name, ranks):
    model_file, _, made = files[name]
    atoms = _test_alloy(made)
    energy, forces, virial = calculator_results(model_file, atoms)
    result = cpu_runs(ranks)[name]
    assert result["ranks"] == ranks
    _check(result, energy, forces, virial, atoms.get_volume())
    # one rank: the calculator's call from LAMMPS's positions and box, except on the step of
    # the per-atom virial, which takes ML-IAP's pairs
    one = {"positions": 1, "pairs": 0} if ranks == 1 else {"positions": 0, "pairs": 0}
    assert result["paths"] == one, "a LAMMPS without mliap-positions.patch? scripts/build_lammps.sh"
    assert result["paths_peratom"] == ({"positions": 0, "pairs": 1} if ranks == 1 else one)
    # several ranks find the pairs on the device where LAMMPS makes none (every step after the
    # first but the per-atom virial's)
    assert (result["pairs_found"] > 0) == (ranks > 1)


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", ["bundled", "density"])
def test_lammps_on_gpus_equals_the_reference(files, tmp_path, name, dtype, ranks):
    """One rank per GPU, the fused kernels inside LAMMPS (host exchanges between the blocks)
    against the float64 reference calculator, within the tolerance table (relative norms)."""
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"{ranks} ranks need {ranks} GPUs")
    model_file, _, made = files[name]
    lammps_file = _converted(model_file, tmp_path / f"{name}-{dtype}.pt", dtype)
    atoms = _test_alloy(made)
    energy, forces, virial = calculator_results(model_file, atoms)
    result = _run(tmp_path, lammps_file, _structure(atoms, made), ranks, gpus=True)
    assert result["ranks"] == ranks
    _check_within_tolerance(result, energy, forces, virial, atoms.get_volume(), dtype)


def _converted(model_file: Path, out: Path, dtype: str) -> Path:
    from mace_accel import cli

    assert cli.main(["convert", str(model_file), str(out), "--lammps", "--dtype", dtype]) == 0
    return out


def _check_within_tolerance(result, energy, forces, virial, volume, dtype: str):
    """Energy, forces and virial within the tolerance table's model-level bound for ``dtype``
    (relative norms)."""
    from mace_accel.tolerances import MODEL_TOL, rel_norm_error

    tol = MODEL_TOL[getattr(torch, dtype)]
    assert abs(result["energy"] - energy) <= tol * abs(energy)
    for name in ("forces", "forces_without_virial"):  # per pair, and (one rank) per atom
        # LAMMPS's forces come back as a list: as float64, not torch's default dtype (float32)
        got = torch.tensor(result[name], dtype=torch.float64)
        assert rel_norm_error(got, torch.from_numpy(forces)) <= tol
    want = torch.tensor(_lammps_virial(virial))
    pressure = np.asarray(result["virial_bar"]) / BAR_PER_EV_A3 * volume
    assert rel_norm_error(torch.tensor(pressure), want) <= tol
    peratom = -np.asarray(result["peratom_virial_sum"]) / BAR_PER_EV_A3
    assert rel_norm_error(torch.tensor(peratom), want) <= tol


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("setup", sorted(OTHER_SETUPS))
def test_other_setups_equal_the_calculator(files, cpu_runs, setup, ranks):
    """A tilted box, a box open along z, the model under hybrid/overlay (OTHER_SETUPS)."""
    model_file, _, made = files["bundled"]
    atoms = OTHER_SETUPS[setup][0](made)
    energy, forces, virial = calculator_results(model_file, atoms)
    _check(cpu_runs(ranks)[setup], energy, forces, virial, atoms.get_volume())


def test_a_rank_without_atoms_takes_part_in_the_exchanges(files, cpu_runs):
    """A slab whose second rank's half holds no atom, only ghosts: that rank still makes its
    part of the other rank's exchanges (else both wait for ever)."""
    model_file, _, made = files["bundled"]
    atoms = _slab(made)
    energy, forces, virial = calculator_results(model_file, atoms)
    _check(cpu_runs(2)["slab"], energy, forces, virial, atoms.get_volume())


def test_float32_features_cross_between_two_ranks(files, cpu_runs):
    """A float32 model on two ranks: its ghosts' float32 rows cross through the exchange (two
    values to each of Comm's doubles) and the energy, forces and virial are the float64
    calculator's within the float32 tolerance."""
    model_file, _, made = files["bundled"]
    atoms = _test_alloy(made)
    energy, forces, virial = calculator_results(model_file, atoms)
    _check_within_tolerance(cpu_runs(2)["float32"], energy, forces, virial, atoms.get_volume(),
                            "float32")


def test_a_trajectory_is_the_same_on_one_and_two_ranks(cpu_runs):
    one, two = cpu_runs(1)["bundled"], cpu_runs(2)["bundled"]
    np.testing.assert_allclose(two["positions_after"], one["positions_after"], atol=1e-9)
    assert two["energy_after"] == pytest.approx(one["energy_after"], rel=1e-10)


def test_the_example_input_runs(files, tmp_path):
    """configs/lammps_cuni.in with the bundled model: a few MD steps conserve the energy."""
    _, lammps_file, _ = files["bundled"]
    script = tmp_path / "run.py"
    script.write_text(f"""
from mace_accel.lammps import import_before_lammps
import_before_lammps()
from lammps import lammps, mliap
lmp = lammps(cmdargs=["-log", "none", "-screen", "none", "-nocite", "-var", "model",
                      {str(lammps_file)!r}, "-var", "steps", "4"])
mliap.activate_mliappy(lmp)
lmp.file({str(RUN.parent.parent / "configs" / "lammps_cuni.in")!r})
print(lmp.get_natoms(), lmp.get_thermo("etotal"), lmp.get_thermo("pe"))
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert done.returncode == 0, done.stderr[-3000:]
    natoms, etotal, pe = (float(v) for v in done.stdout.split()[-3:])
    assert natoms == 864 and np.isfinite(pe)
    assert abs(etotal - 82.2130) < 0.05  # the first step's total energy, kept over 4 steps
