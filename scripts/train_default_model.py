#!/usr/bin/env python3
"""Train the small Cu/Ni MACE model bundled with mace-accel (``mace_accel/data/cu_ni_emt.model``).

What it does, end to end, on CPU in float64 (about 5-8 minutes on 2 cores):

1. Generates reference data with ASE's EMT calculator for a Cu/Ni alloy: rattled fcc supercells
   with random Cu/Ni occupations under isotropic and shear strains, small strained cells, cells
   with vacancies, (100)/(111) slabs, and snapshots of short EMT Langevin runs at 300-1200 K.
   Every structure is labelled with EMT energy, forces and stress.
2. Splits it into a training set (mace holds out its own validation fraction) and a held-out test
   set, writes both as extxyz into a temporary folder, and trains a ScaleShiftMACE there with
   mace's own training entry (``python -m mace.cli.run_train``, a subprocess).
3. Evaluates the trained model on the held-out test set (energy RMSE per atom, force RMSE,
   stress RMSE), and runs a short NVT (Langevin, 300 K) MD with it through
   ``MACEAccelCalculator`` (reference backend, verified against the unpatched model when the
   calculator is set up) to check that it is stable and stays close to EMT.
4. Copies the model (the whole pickled module, as mace saves it) to ``--out`` and writes the
   training metadata and metrics next to it as JSON (``--out`` with suffix ``.json``).

Usage::

    python scripts/train_default_model.py                   # writes mace_accel/data/cu_ni_emt.*
    python scripts/train_default_model.py --epochs 10 --out /tmp/quick.model   # a quick try

The script is the only thing that produces the bundled files; rerun it to rebuild them.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "mace_accel" / "data" / "cu_ni_emt.model"
ELEMENTS = (28, 29)  # Ni, Cu
LATTICE = {28: 3.52, 29: 3.61}  # EMT's equilibrium fcc lattice constants (Å)
KEYS = {"energy": "REF_energy", "forces": "REF_forces", "stress": "REF_stress"}

# The model: small, but the architecture of the MACE-MP models (residual interaction blocks).
HYPERS = {
    "model": "ScaleShiftMACE",
    "interaction": "RealAgnosticResidualInteractionBlock",
    "interaction_first": "RealAgnosticResidualInteractionBlock",
    "hidden_irreps": "16x0e+16x1o",
    "MLP_irreps": "16x0e",
    "max_ell": 2,
    "correlation": 2,
    "r_max": 4.5,
    "num_interactions": 2,
    "num_radial_basis": 8,
    "num_cutoff_basis": 5,
    "radial_MLP": "[32,32,32]",
    "scaling": "rms_forces_scaling",
}


# ----- reference data -------------------------------------------------------------------------
def _alloy_bulk(rng: np.random.Generator, repeat: Sequence[int], x_ni: float,
                strain: float, shear: float, rattle: float):
    """fcc Cu/Ni supercell with random occupations, a Vegard lattice constant and strains."""
    from ase.build import bulk

    a0 = (1.0 - x_ni) * LATTICE[29] + x_ni * LATTICE[28]
    atoms = bulk("Cu", "fcc", a=a0, cubic=True).repeat(tuple(repeat))
    atoms.numbers = np.where(rng.random(len(atoms)) < x_ni, 28, 29)
    deform = np.eye(3) * (1.0 + strain)
    off = rng.normal(0.0, shear, (3, 3))
    deform += 0.5 * (off + off.T) * (1.0 - np.eye(3))
    atoms.set_cell(atoms.cell.array @ deform, scale_atoms=True)
    atoms.positions += rng.normal(0.0, rattle, atoms.positions.shape)
    return atoms


def _slab(rng: np.random.Generator, x_ni: float, rattle: float):
    """A rattled (100) or (111) alloy slab, periodic in all directions with 8 Å of vacuum."""
    from ase.build import fcc100, fcc111

    build = fcc100 if rng.random() < 0.5 else fcc111
    a0 = (1.0 - x_ni) * LATTICE[29] + x_ni * LATTICE[28]
    atoms = build("Cu", size=(2, 2, 5), a=a0, vacuum=4.0, periodic=True)
    atoms.info.pop("adsorbate_info", None)  # a dict extxyz cannot store
    atoms.numbers = np.where(rng.random(len(atoms)) < x_ni, 28, 29)
    atoms.positions += rng.normal(0.0, rattle, atoms.positions.shape)
    return atoms


def _md_snapshots(rng: np.random.Generator, n: int, temperature: float, x_ni: float) -> list:
    """``n`` snapshots (every 10 steps) of an EMT Langevin run of a 32-atom alloy cell."""
    from ase import units
    from ase.calculators.emt import EMT
    from ase.md.langevin import Langevin
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

    atoms = _alloy_bulk(rng, (2, 2, 2), x_ni, strain=0.0, shear=0.0, rattle=0.0)
    atoms.calc = EMT()
    MaxwellBoltzmannDistribution(atoms, temperature_K=temperature, rng=rng)
    dyn = Langevin(atoms, 2.0 * units.fs, temperature_K=temperature,
                   friction=0.02 / units.fs, rng=rng)
    frames = []
    for _ in range(n):
        dyn.run(10)
        frames.append(atoms.copy())
    return frames


def generate_structures(seed: int) -> List:
    """Unlabelled structures of every kind, each with ``info['config_type']`` set."""
    rng = np.random.default_rng(seed)
    out = []

    def add(atoms, kind: str) -> None:
        atoms.info["config_type"] = kind
        out.append(atoms)

    fractions = (0.0, 0.25, 0.5, 0.75, 1.0)
    for _ in range(80):  # the bulk of the data: strained, rattled 32-atom cells
        x = rng.choice(fractions) if rng.random() < 0.5 else rng.random()
        add(_alloy_bulk(rng, (2, 2, 2), x, strain=rng.uniform(-0.04, 0.05),
                        shear=rng.uniform(0.0, 0.02), rattle=rng.uniform(0.02, 0.15)), "bulk")
    for _ in range(35):  # small cells over a wider strain range: the equation of state
        x = rng.choice(fractions)
        add(_alloy_bulk(rng, (1, 1, 2), x, strain=rng.uniform(-0.07, 0.08),
                        shear=rng.uniform(0.0, 0.03), rattle=rng.uniform(0.0, 0.08)), "eos")
    for _ in range(15):  # one or two vacancies
        atoms = _alloy_bulk(rng, (2, 2, 2), rng.random(), strain=rng.uniform(-0.02, 0.03),
                            shear=0.0, rattle=rng.uniform(0.02, 0.1))
        for i in sorted(rng.choice(len(atoms), size=rng.integers(1, 3), replace=False))[::-1]:
            del atoms[int(i)]
        add(atoms, "vacancy")
    for _ in range(25):
        add(_slab(rng, rng.random(), rattle=rng.uniform(0.02, 0.1)), "surface")
    for temperature in (300.0, 600.0, 900.0, 1200.0):
        for atoms in _md_snapshots(rng, 10, temperature, rng.random()):
            add(atoms, f"md{int(temperature)}")
    return out


def label_with_emt(structures: List) -> None:
    """Store EMT energy, forces and stress under the ``REF_*`` keys (no calculator attached)."""
    from ase.calculators.emt import EMT

    for atoms in structures:
        atoms.calc = EMT()
        atoms.info[KEYS["energy"]] = float(atoms.get_potential_energy())
        atoms.arrays[KEYS["forces"]] = np.array(atoms.get_forces())
        atoms.info[KEYS["stress"]] = np.array(atoms.get_stress(voigt=True))
        atoms.calc = None


def isolated_atom_energies() -> Dict[int, float]:
    """EMT energy of a single atom of each element (the model's E0s)."""
    from ase import Atoms
    from ase.calculators.emt import EMT

    e0s = {}
    for z in ELEMENTS:
        atom = Atoms(numbers=[z], positions=[[0.0, 0.0, 0.0]])
        atom.calc = EMT()
        e0s[z] = float(atom.get_potential_energy())
    return e0s


def split(structures: List, test_fraction: float, seed: int):
    """Random train / held-out test split, stratified by config_type."""
    rng = np.random.default_rng(seed + 1)
    train, test = [], []
    kinds = sorted({a.info["config_type"] for a in structures})
    for kind in kinds:
        group = [a for a in structures if a.info["config_type"] == kind]
        order = rng.permutation(len(group))
        n_test = max(1, int(round(test_fraction * len(group))))
        test += [group[i] for i in order[:n_test]]
        train += [group[i] for i in order[n_test:]]
    return train, test


# ----- training (mace's own entry point) ----------------------------------------------------
def train_argv(workdir: Path, e0s: Dict[int, float], epochs: int, seed: int) -> List[str]:
    """Command-line arguments for ``mace.cli.run_train``."""
    hypers = [f"--{k}={v}" for k, v in HYPERS.items()]
    start_stage_two = max(1, int(0.6 * epochs))
    return [
        "--name=cu_ni_emt", f"--work_dir={workdir}", f"--seed={seed}",
        f"--train_file={workdir / 'train.xyz'}", "--valid_fraction=0.1",
        f"--test_file={workdir / 'test.xyz'}",
        f"--energy_key={KEYS['energy']}", f"--forces_key={KEYS['forces']}",
        f"--stress_key={KEYS['stress']}",
        f"--E0s={dict(sorted(e0s.items()))!r}",  # a Python literal with int keys
        *hypers,
        "--loss=stress", "--energy_weight=10.0", "--forces_weight=10.0",
        "--stress_weight=100.0", "--error_table=PerAtomRMSEstressvirials",
        "--batch_size=4", "--valid_batch_size=16", "--lr=0.01",
        f"--max_num_epochs={epochs}", "--swa", f"--start_swa={start_stage_two}",
        "--swa_energy_weight=100.0", "--swa_forces_weight=10.0", "--swa_stress_weight=100.0",
        "--swa_lr=0.001",
        "--ema", "--ema_decay=0.99", "--amsgrad", "--clip_grad=100",
        "--device=cpu", "--default_dtype=float64", "--save_cpu", "--plot=False",
        "--eval_interval=1", "--patience=1000", "--num_workers=0",
    ]


def run_mace_training(workdir: Path, argv: List[str], threads: int | None) -> Path:
    """Run mace's training in a subprocess; returns the path of the final (stage-two) model."""
    log_path = workdir / "train.log"
    cmd = [sys.executable, "-m", "mace.cli.run_train", *argv]
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    print(f"training: {' '.join(cmd[:3])} ... (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log_path.read_text().splitlines()[-40:]
        raise SystemExit("mace training failed (exit code %d); last lines of the log:\n%s"
                         % (proc.returncode, "\n".join(tail)))
    model_path = workdir / "cu_ni_emt_stagetwo.model"
    if not model_path.is_file():
        raise SystemExit(f"mace training finished but wrote no {model_path.name} in {workdir}")
    return model_path


# ----- checks ---------------------------------------------------------------------------------
def load_model(path: Path):
    import torch

    from mace_accel import _e3nn_compat

    _e3nn_compat.import_mace()
    return torch.load(path, map_location="cpu", weights_only=False).eval()


def errors_on(model, structures: List) -> Dict[str, float]:
    """RMSEs of energy per atom (meV/atom), forces (meV/Å) and stress (meV/Å^3) vs EMT."""
    from mace_accel.models.batch import atoms_to_batch, model_info
    from mace_accel.surgery import evaluate

    info = model_info(model)
    de, df, ds = [], [], []
    for atoms in structures:
        out = evaluate(model, atoms_to_batch(atoms, info), compute_stress=True)
        n = len(atoms)
        de.append((float(out["energy"][0]) - atoms.info[KEYS["energy"]]) / n)
        df.append(out["forces"].numpy() - atoms.arrays[KEYS["forces"]])
        stress = out["stress"][0].numpy()
        ref = _voigt_to_full(atoms.info[KEYS["stress"]])
        ds.append(stress - ref)
    return {"energy_rmse_mev_per_atom": 1e3 * _rms([np.array(de)]),
            "force_rmse_mev_per_ang": 1e3 * _rms(df),
            "stress_rmse_mev_per_ang3": 1e3 * _rms(ds),
            "n_structures": len(structures),
            "n_atoms": int(sum(len(a) for a in structures))}


def errors_by_config_type(model, structures: List) -> Dict[str, Dict[str, float]]:
    kinds = sorted({a.info["config_type"] for a in structures})
    return {kind: errors_on(model, [a for a in structures if a.info["config_type"] == kind])
            for kind in kinds}


def _rms(arrays: List[np.ndarray]) -> float:
    return float(np.sqrt(np.mean(np.square(np.concatenate([np.ravel(a) for a in arrays])))))


def _voigt_to_full(s: np.ndarray) -> np.ndarray:
    xx, yy, zz, yz, xz, xy = s
    return np.array([[xx, xy, xz], [xy, yy, yz], [xz, yz, zz]])


def md_check(model, seed: int, steps: int = 250) -> Dict[str, float]:
    """NVT Langevin MD at 300 K (108-atom Cu/Ni cell, 2 fs steps): stability and EMT agreement.

    The run is checked every 25 steps (``steps`` is rounded up to a multiple of 25).

    Runs through :class:`mace_accel.MACEAccelCalculator` (reference backend on CPU, verified
    against the unpatched model when it is set up) on a copy of ``model``.

    Raises:
        SystemExit: atoms came closer than 1.8 Å, the temperature left [150, 600] K at the end,
            or forces along the trajectory disagree with EMT by more than 150 meV/Å RMSE.
    """
    from ase import units
    from ase.calculators.emt import EMT
    from ase.md.langevin import Langevin
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

    from mace_accel.calculator import MACEAccelCalculator

    calc = MACEAccelCalculator(model=copy.deepcopy(model), device="cpu", default_dtype="float64",
                               backend="reference", fallback="error")
    rng = np.random.default_rng(seed + 2)
    atoms = _alloy_bulk(rng, (3, 3, 3), 0.5, strain=0.0, shear=0.0, rattle=0.0)
    atoms.calc = calc
    MaxwellBoltzmannDistribution(atoms, temperature_K=300.0, rng=rng)
    dyn = Langevin(atoms, 2.0 * units.fs, temperature_K=300.0, friction=0.02 / units.fs,
                   rng=rng)
    temps, min_dists, force_err = [], [], []
    emt = EMT()
    t0 = time.perf_counter()
    chunk = 25
    n_chunks = -(-steps // chunk)
    for _ in range(n_chunks):
        dyn.run(chunk)
        temps.append(float(atoms.get_temperature()))
        d = atoms.get_all_distances(mic=True)
        min_dists.append(float(d[np.triu_indices(len(atoms), 1)].min()))
        ref = atoms.copy()
        ref.calc = emt
        force_err.append(atoms.get_forces() - ref.get_forces())
    wall = time.perf_counter() - t0
    result = {
        "calculator": {"backend": calc.backend, "verification": calc.report.verification},
        "steps": n_chunks * chunk, "timestep_fs": 2.0, "temperature_target_k": 300.0,
        "n_atoms": len(atoms),
        "temperature_last_k": temps[-1],
        "temperature_mean_second_half_k": float(np.mean(temps[len(temps) // 2:])),
        "min_distance_ang": float(min(min_dists)),
        "force_rmse_vs_emt_mev_per_ang": 1e3 * _rms(force_err),
        "wall_s": wall,
    }
    bad = []
    if result["min_distance_ang"] < 1.8:
        bad.append(f"atoms came within {result['min_distance_ang']:.2f} Å")
    if not 150.0 <= result["temperature_last_k"] <= 600.0:
        bad.append(f"final temperature {result['temperature_last_k']:.0f} K")
    if result["force_rmse_vs_emt_mev_per_ang"] > 150.0:
        bad.append(f"force RMSE vs EMT {result['force_rmse_vs_emt_mev_per_ang']:.0f} meV/Å")
    if bad:
        raise SystemExit(f"MD check failed ({'; '.join(bad)}): {json.dumps(result, indent=1)}")
    return result


# ----- main -----------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="where to write the model (the metrics go next to it as .json)")
    parser.add_argument("--epochs", type=int, default=80, help="training epochs (default 80)")
    parser.add_argument("--seed", type=int, default=1, help="seed of data and training")
    parser.add_argument("--md-steps", type=int, default=250, help="steps of the final NVT check")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for training and checks (default: torch's choice); "
                             "1 is faster on a machine shared with other jobs")
    parser.add_argument("--keep-workdir", action="store_true",
                        help="keep the temporary folder with data, logs and checkpoints")
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (the last 40%% are mace's stage two)")
    if args.md_steps < 25:
        parser.error("--md-steps must be at least 25")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be a positive integer")

    import ase.io
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    t_start = time.perf_counter()
    structures = generate_structures(args.seed)
    label_with_emt(structures)
    train, test = split(structures, test_fraction=0.15, seed=args.seed)
    e0s = isolated_atom_energies()
    print(f"data: {len(train)} training structures (10% of them mace's validation set), "
          f"{len(test)} held out; {time.perf_counter() - t_start:.0f} s", flush=True)

    workdir = Path(tempfile.mkdtemp(prefix="mace_accel_train_"))
    try:
        ase.io.write(workdir / "train.xyz", train, format="extxyz")
        ase.io.write(workdir / "test.xyz", test, format="extxyz")
        t_train = time.perf_counter()
        model_path = run_mace_training(workdir, train_argv(workdir, e0s, args.epochs, args.seed),
                                       args.threads)
        train_wall = time.perf_counter() - t_train
        print(f"trained in {train_wall:.0f} s", flush=True)

        model = load_model(model_path)
        test_errors = errors_on(model, test)
        test_by_kind = errors_by_config_type(model, test)
        train_errors = errors_on(model, train)
        print(f"held-out test: {json.dumps(test_errors)}", flush=True)
        md = md_check(model, args.seed, steps=args.md_steps)
        print(f"MD check: {json.dumps(md)}", flush=True)

        args.out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(model_path, args.out)
    finally:
        if args.keep_workdir:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    import ase as ase_pkg
    import mace

    counts: Dict[str, int] = {}
    for atoms in structures:
        counts[atoms.info["config_type"]] = counts.get(atoms.info["config_type"], 0) + 1
    meta = {
        "model_file": args.out.name,
        "sha256": hashlib.sha256(args.out.read_bytes()).hexdigest(),
        "description": "Small ScaleShiftMACE for a Cu/Ni alloy trained on ASE EMT energies, "
                       "forces and stress; a demo model for mace-accel (not for production "
                       "science: EMT is a toy potential)",
        "elements": ["Ni", "Cu"],
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "hyperparameters": {**HYPERS, "epochs": args.epochs, "seed": args.seed},
        "isolated_atom_energies_ev": {str(z): e for z, e in e0s.items()},
        "data": {"reference": "ase.calculators.emt.EMT", "config_types": counts,
                 "n_train_incl_valid": len(train), "n_test": len(test)},
        "metrics": {"test": test_errors, "train": train_errors,
                    "test_by_config_type": test_by_kind},
        "md_check": md,
        "training_wall_s": round(train_wall, 1),
        "total_wall_s": round(time.perf_counter() - t_start, 1),
        "versions": {"mace-torch": mace.__version__, "torch": torch.__version__,
                     "ase": ase_pkg.__version__, "python": platform.python_version()},
        "cpu_threads": torch.get_num_threads(),
        "command": "python scripts/train_default_model.py " + " ".join(
            argv if argv is not None else sys.argv[1:]),
    }
    json_path = args.out.with_suffix(".json")
    json_path.write_text(json.dumps(meta, indent=2) + "\n")
    size_mb = os.path.getsize(args.out) / 2**20
    print(f"wrote {args.out} ({size_mb:.2f} MiB) and {json_path} in "
          f"{meta['total_wall_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
