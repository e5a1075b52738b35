"""The ASE calculator's contract on CPU (reference backend, tiny float64 models)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk
from ase.calculators.calculator import PropertyNotImplementedError
from helpers import rel_error

import mace_accel
from mace_accel.calculator import MACEAccelCalculator
from mace_accel.errors import InputError
from mace_accel.models.checkpoint import save_model
from mace_accel.tolerances import EQUIVARIANCE_TOL, MODEL_TOL

# mace-accel's own (reference) ops on the CPU, where backend "auto" runs mace's modules
REFERENCE = {"device": "cpu", "backend": "reference"}

TOL = MODEL_TOL[torch.float64]
EQ_TOL = EQUIVARIANCE_TOL[torch.float64]


@pytest.fixture(scope="module")
def model_file(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("calc") / "tiny.model"
    save_model(tiny_model(), path)
    return path


@pytest.fixture(scope="module")
def calc(model_file):
    return MACEAccelCalculator(model_file, **REFERENCE, default_dtype="float64")


def evaluate(calc, atoms, stress=True):
    atoms = atoms.copy()
    atoms.calc = calc
    out = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(),
           "energies": atoms.get_potential_energies()}
    if stress:
        out["stress"] = atoms.get_stress()
    return out


def random_rotation(seed: int, improper: bool) -> np.ndarray:
    q, r = np.linalg.qr(np.random.default_rng(seed).normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))
    if np.linalg.det(q) < 0:
        q[:, 0] *= -1
    return -q if improper else q


def test_reports_reference_backend_once(model_file, caplog):
    with caplog.at_level(logging.WARNING, logger="mace_accel"):
        calc = MACEAccelCalculator(model_file, **REFERENCE, default_dtype="float64")
        atoms = bulk("Cu", "fcc", a=3.6)
        atoms.calc = calc
        atoms.get_potential_energy()
        atoms.positions += 0.01
        atoms.get_forces()
    messages = [r.getMessage() for r in caplog.records if "backend" in r.getMessage()]
    assert len(messages) == 1 and "'reference'" in messages[0]
    assert calc.backend == "reference" and calc.report.backend == "reference"
    assert [r.kind for r in calc.report.patched] == [
        "edge_features", "node_embedding", "interaction_block", "interaction_block",
        "product_block", "product_block", "readout_block", "readout_block"]


def test_on_a_cpu_auto_runs_maces_own_modules_and_says_so_once(model_file, calc, caplog):
    """Without a GPU the default (backend "auto") evaluates the model as mace built it (faster
    there than the reference backend), says so once, and gives the reference's results."""
    with caplog.at_level(logging.WARNING, logger="mace_accel"):
        plain = MACEAccelCalculator(model_file, device="cpu", default_dtype="float64")
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(2)
        atoms.numbers[::3] = 8
        atoms.calc = plain
        forces = atoms.get_forces()
        atoms.positions[0] += 0.01
        atoms.get_forces()
    messages = [r.getMessage() for r in caplog.records if "mace built" in r.getMessage()]
    assert len(messages) == 1 and "backend='reference'" in messages[0]
    assert plain.backend == "mace" and not plain.report.patched
    assert "nothing patched" in str(plain.report)
    assert not mace_accel.surgery.is_accelerated(plain.model)
    atoms.positions[0] -= 0.01
    atoms.calc = calc  # the reference backend, by name
    assert np.allclose(atoms.get_forces(), forces, rtol=0, atol=1e-10)


@pytest.mark.parametrize("structure", ["cu_atoms", "molecule_atoms"])
def test_matches_mace_calculator(structure, request, calc, model_file):
    from mace.calculators import MACECalculator

    atoms = request.getfixturevalue(structure)
    periodic = structure == "cu_atoms"
    ours = evaluate(calc, atoms, stress=periodic)
    mace_calc = MACECalculator(model_paths=str(model_file), device="cpu", default_dtype="float64")
    theirs = evaluate(mace_calc, atoms, stress=periodic)
    for key in ours:
        assert rel_error(ours[key], theirs[key]) <= TOL, key
    assert np.abs(ours["forces"]).max() > 1e-4  # the comparison is not between zeros


def test_results_are_float64_numpy_and_energies_sum(calc, cu_atoms):
    out = evaluate(calc, cu_atoms)
    for key in ("forces", "energies", "stress"):
        assert isinstance(out[key], np.ndarray) and out[key].dtype == np.float64, key
    assert out["forces"].shape == (len(cu_atoms), 3) and out["stress"].shape == (6,)
    assert isinstance(out["energy"], float)
    assert abs(out["energies"].sum() - out["energy"]) <= TOL * abs(out["energy"])
    cu_atoms.calc = calc
    assert cu_atoms.get_potential_energy(force_consistent=True) == out["energy"]


def test_rotation_translation_invariance(calc, molecule_atoms, cu_atoms):
    for atoms, seed in ((molecule_atoms, 0), (cu_atoms, 1)):
        base = evaluate(calc, atoms, stress=False)
        for improper in (False, True):
            rot = random_rotation(seed, improper)
            moved = atoms.copy()
            moved.positions = atoms.positions @ rot.T + np.array([1.3, -0.7, 2.1])
            moved.set_cell(atoms.cell.array @ rot.T, scale_atoms=False)
            out = evaluate(calc, moved, stress=False)
            assert abs(out["energy"] - base["energy"]) <= EQ_TOL * abs(base["energy"])
            assert rel_error(out["forces"], base["forces"] @ rot.T) <= EQ_TOL
            assert rel_error(out["energies"], base["energies"]) <= EQ_TOL


def test_rotated_stress(calc, cu_atoms):
    rot = random_rotation(3, improper=False)
    base = evaluate(calc, cu_atoms)["stress"]
    moved = cu_atoms.copy()
    moved.positions = cu_atoms.positions @ rot.T
    moved.set_cell(cu_atoms.cell.array @ rot.T, scale_atoms=False)
    from ase.stress import full_3x3_to_voigt_6_stress, voigt_6_to_full_3x3_stress

    expected = full_3x3_to_voigt_6_stress(rot @ voigt_6_to_full_3x3_stress(base) @ rot.T)
    assert rel_error(evaluate(calc, moved)["stress"], expected) <= EQ_TOL


def test_permutation(calc, molecule_atoms):
    base = evaluate(calc, molecule_atoms, stress=False)
    perm = np.random.default_rng(4).permutation(len(molecule_atoms))
    out = evaluate(calc, molecule_atoms[perm], stress=False)
    assert abs(out["energy"] - base["energy"]) <= TOL * abs(base["energy"])
    assert rel_error(out["forces"], base["forces"][perm]) <= TOL
    assert rel_error(out["energies"], base["energies"][perm]) <= TOL


def test_forces_match_finite_differences(calc, cu_atoms):
    forces = evaluate(calc, cu_atoms, stress=False)["forces"]
    h = 1e-4
    rng = np.random.default_rng(5)
    picks = [(int(rng.integers(len(cu_atoms))), k) for k in range(3)] + [(0, 0), (3, 2)]
    for i, k in picks:
        energies = []
        for sign in (1, -1):
            displaced = cu_atoms.copy()
            displaced.positions[i, k] += sign * h
            energies.append(evaluate(calc, displaced, stress=False)["energy"])
        numeric = -(energies[0] - energies[1]) / (2 * h)
        assert abs(numeric - forces[i, k]) <= 1e-7 + 1e-5 * np.abs(forces).max(), (i, k)


def test_stress_matches_finite_strain(calc, cu_atoms):
    stress = evaluate(calc, cu_atoms)["stress"]
    volume = cu_atoms.get_volume()
    h = 1e-5
    voigt = [(0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1)]
    numeric = np.zeros(6)
    for n, (a, b) in enumerate(voigt):
        energies = []
        for sign in (1, -1):
            strain = np.eye(3)
            strain[a, b] += sign * h / (1 if a == b else 2)
            strain[b, a] += 0 if a == b else sign * h / 2
            strained = cu_atoms.copy()
            strained.set_cell(cu_atoms.cell.array @ strain, scale_atoms=True)
            energies.append(evaluate(calc, strained, stress=False)["energy"])
        numeric[n] = (energies[0] - energies[1]) / (2 * h) / volume
    assert np.abs(stress).max() > 1e-6
    assert np.allclose(stress, numeric, rtol=1e-5, atol=1e-9)


def test_one_atom_cell_is_extensive(calc):
    prim = bulk("Cu", "fcc", a=3.6)  # one atom, every neighbour is a periodic image
    one = evaluate(calc, prim)
    assert np.abs(one["forces"]).max() < 1e-12  # inversion symmetry
    supercell = evaluate(calc, prim.repeat((2, 2, 2)))
    assert abs(supercell["energy"] - 8 * one["energy"]) <= TOL * abs(supercell["energy"])
    assert rel_error(supercell["stress"], one["stress"]) <= TOL
    assert np.abs(one["stress"]).max() > 1e-6


def test_isolated_atoms(calc):
    single = evaluate(calc, Atoms("Cu", positions=[[0.0, 0.0, 0.0]]), stress=False)
    assert np.abs(single["forces"]).max() == 0.0
    assert np.isfinite(single["energy"])
    # two atoms beyond the cutoff (4 Å) do not interact
    far = evaluate(calc, Atoms("CuO", positions=[[0, 0, 0], [0, 0, 9.0]]), stress=False)
    o_alone = evaluate(calc, Atoms("O"), stress=False)
    assert abs(far["energy"] - single["energy"] - o_alone["energy"]) <= TOL * abs(far["energy"])


def test_stress_needs_a_periodic_cell(calc, molecule_atoms):
    molecule_atoms.calc = calc
    assert molecule_atoms.get_potential_energy() != 0.0
    assert "stress" not in calc.results
    with pytest.raises(PropertyNotImplementedError, match="periodic structure"):
        molecule_atoms.get_stress()


def test_float32_calculator_close_to_float64(model_file, calc, cu_atoms):
    default = torch.get_default_dtype()
    calc32 = MACEAccelCalculator(model_file, **REFERENCE, default_dtype="float32")
    assert calc32.info.dtype == torch.float32
    out32, out64 = evaluate(calc32, cu_atoms), evaluate(calc, cu_atoms)
    assert out32["forces"].dtype == np.float64
    assert abs(out32["energy"] - out64["energy"]) <= 1e-5 * abs(out64["energy"])
    assert rel_error(out32["forces"], out64["forces"]) <= 1e-3
    assert torch.get_default_dtype() == default


def _two_head_model(tiny_model):
    model = tiny_model(heads=("pt_head", "Default"))
    # small_test_model gives multi-head models a scalar scale/shift; mace indexes them per head
    block = model.scale_shift
    block.scale = torch.tensor([1.0, 1.5], dtype=block.scale.dtype)
    block.shift = torch.tensor([0.0, 0.1], dtype=block.shift.dtype)
    return model


def test_multi_head_model(tiny_model, cu_atoms):
    default = MACEAccelCalculator(_two_head_model(tiny_model), **REFERENCE,
                                  default_dtype="float64")
    assert default.head == "Default"
    other = MACEAccelCalculator(_two_head_model(tiny_model), **REFERENCE,
                                default_dtype="float64", head="pt_head")
    assert other.head == "pt_head"
    e_default, e_other = evaluate(default, cu_atoms)["energy"], evaluate(other, cu_atoms)["energy"]
    assert abs(e_default - e_other) > 1e-3


@pytest.mark.gpu
def test_cuda_calculator_matches_reference(model_file, calc, cu_atoms):
    cuda = MACEAccelCalculator(model_file, device="cuda", default_dtype="float64",
                               fallback="error")
    assert cuda.backend == "cuda" and cuda.report.backend == "cuda"
    ours, reference = evaluate(cuda, cu_atoms), evaluate(calc, cu_atoms)
    for key in ours:
        assert rel_error(ours[key], reference[key]) <= TOL, key


# ----- the resident batch: a step copies geometry in, the neighbour list has a skin -------------
def _md_like_steps(atoms, n: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        atoms.positions += rng.normal(scale=0.02, size=atoms.positions.shape)
        yield atoms


@pytest.mark.parametrize("skin", [0.0, 0.4])
def test_resident_steps_match_a_fresh_calculator(model_file, skin):
    """Positions and cell changed step by step (as MD and cell relaxations do) give what a new
    calculator computes from scratch; the neighbour list is rebuilt only when needed."""
    calc = MACEAccelCalculator(model_file, **REFERENCE, default_dtype="float64", skin=skin,
                               compute_stress=True)  # one call per step gives forces and stress
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(2)
    atoms.numbers[::3] = 8
    atoms.calc = calc
    for step, moved in enumerate(_md_like_steps(atoms)):
        if step == 2:
            moved.set_cell(moved.cell.array * 1.01, scale_atoms=True)
        fresh = MACEAccelCalculator(model_file, **REFERENCE, default_dtype="float64",
                                    verify=False)
        want = moved.copy()
        want.calc = fresh
        assert rel_error(moved.get_forces(), want.get_forces()) < TOL
        assert rel_error(moved.get_stress(), want.get_stress()) < TOL
        assert abs(moved.get_potential_energy() - want.get_potential_energy()) < 1e-9
    assert calc._resident.n_templates == 1
    builds = calc._resident.neighbours.n_builds
    assert builds == (4 if skin == 0 else 2)  # skin: the first list and the cell change


def test_list_reuse_check_catches_a_large_move(model_file):
    """The list's reuse is decided on the host from the float64 positions: a move of more than
    half the skin rebuilds it before the call, which gives the fresh result; a cell change
    rebuilds too."""
    calc = MACEAccelCalculator(model_file, **REFERENCE, default_dtype="float64", skin=0.4)
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(2)
    atoms.calc = calc
    atoms.get_forces()
    atoms.positions[3] += [0.05, 0.0, 0.0]  # within skin / 2: reused
    atoms.get_forces()
    assert calc._resident.neighbours.n_builds == 1
    atoms.positions[3] += [0.25, 0.0, 0.0]  # beyond: stale, rebuilt within the same call
    forces = atoms.get_forces()
    assert calc._resident.neighbours.n_builds == 2
    atoms.set_cell(atoms.cell.array * 1.001, scale_atoms=False)
    atoms.get_forces()
    assert calc._resident.neighbours.n_builds == 3
    atoms.positions[3] += [0.05, 0.0, 0.0]
    forces = atoms.get_forces()
    assert calc._resident.neighbours.n_builds == 3
    fresh = atoms.copy()
    fresh.calc = MACEAccelCalculator(model_file, **REFERENCE, default_dtype="float64",
                                     verify=False)
    assert rel_error(forces, fresh.get_forces()) < TOL


def test_stress_only_when_asked_by_default(model_file):
    """The default leaves the stress out of energy/forces calls (MD does not use it) and
    computes it when asked, equal to a calculator that always computes it; the call timings
    count every call."""
    lazy = MACEAccelCalculator(model_file, **REFERENCE, default_dtype="float64")
    eager = MACEAccelCalculator(model_file, **REFERENCE, default_dtype="float64",
                                verify=False, compute_stress=True)
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(2)
    atoms.rattle(0.05, seed=2)
    atoms.calc = lazy
    forces = atoms.get_forces()
    assert "stress" not in lazy.results and lazy.timings.calls == 1
    stress = atoms.get_stress()
    assert lazy.timings.calls == 2
    other = atoms.copy()
    other.calc = eager
    assert rel_error(other.get_forces(), forces) < TOL and "stress" in eager.results
    assert rel_error(other.get_stress(), stress) < TOL
    parts = lazy.timings.per_call_ms()
    assert set(parts) == {"checks", "neighbours", "model"} and all(v > 0 for v in parts.values())


def test_new_numbers_or_atom_count_rebuild_the_batch(model_file):
    calc = MACEAccelCalculator(model_file, **REFERENCE, default_dtype="float64")
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(2)
    atoms.calc = calc
    atoms.get_forces()
    atoms.numbers[0] = 8
    e_swapped = atoms.get_potential_energy()
    del atoms[5]
    forces = atoms.get_forces()
    assert forces.shape == (31, 3) and calc._resident.n_templates == 3
    fresh = atoms.copy()
    fresh.calc = MACEAccelCalculator(model_file, **REFERENCE, default_dtype="float64")
    assert rel_error(forces, fresh.get_forces()) < TOL
    assert np.isfinite(e_swapped)


def test_overlap_found_in_a_step_names_the_atoms(model_file):
    calc = MACEAccelCalculator(model_file, **REFERENCE, default_dtype="float64")
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(2)
    atoms.calc = calc
    atoms.get_forces()
    atoms.positions[7] = atoms.positions[3] + 0.1
    with pytest.raises(InputError, match="atoms 3 .* and 7 .*closer than min_distance"):
        atoms.get_forces()
    atoms.positions[7, 0] = float("nan")
    with pytest.raises(InputError, match="NaN"):
        atoms.get_forces()


def test_graphs_are_off_by_default_on_the_cpu(model_file):
    """(graphs=True on the CPU and a negative skin are errors: test_bad_input.py's API_CASES.)"""
    calc = MACEAccelCalculator(model_file, **REFERENCE, default_dtype="float64")
    assert calc.graphs is False


def test_cell_checks_follow_the_cell_between_steps(model_file):
    """The cell is re-checked (and the stress verdict recomputed) only when it changed: a cell
    made singular in a step is still refused, a periodic cell made non-periodic loses its
    stress, and the original cell afterwards works again."""
    calc = MACEAccelCalculator(model_file, **REFERENCE, default_dtype="float64")
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(2)
    atoms.calc = calc
    assert atoms.get_stress().shape == (6,)
    good = atoms.cell.array.copy()
    flat = good.copy()
    flat[2] = flat[0] + flat[1]
    atoms.set_cell(flat, scale_atoms=False)
    with pytest.raises(InputError, match="linearly dependent"):
        atoms.get_forces()
    atoms.set_cell(good, scale_atoms=False)
    atoms.positions[0, 0] += 0.01
    assert atoms.get_stress().shape == (6,)
    atoms.set_cell(np.zeros((3, 3)))
    atoms.pbc = False
    atoms.get_forces()
    with pytest.raises(PropertyNotImplementedError):
        atoms.get_stress()
