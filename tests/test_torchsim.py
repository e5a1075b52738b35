"""The torch-sim interface (``mace_accel.torchsim``): torch-sim's own model validation, per-system
results equal to the ASE calculator's (single calls, and at the end of batched MD and
relaxations run by torch-sim's runners), and clear errors for bad input."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk
from ase.stress import voigt_6_to_full_3x3_stress

ts = pytest.importorskip("torch_sim")

from mace_accel.calculator import MACEAccelCalculator  # noqa: E402
from mace_accel.errors import ConfigError, InputError  # noqa: E402
from mace_accel.torchsim import AcceleratedMaceModel  # noqa: E402

# mace-accel's own (reference) ops on the CPU, where backend "auto" runs mace's modules
REFERENCE = {"device": "cpu", "backend": "reference"}

CPU = torch.device("cpu")
TOL = 1e-10  # fp64: the same model on the same structure, batched or not


@pytest.fixture(scope="module")
def model():
    return AcceleratedMaceModel(None, **REFERENCE, default_dtype="float64")


@pytest.fixture(scope="module")
def calculator():
    return MACEAccelCalculator(None, **REFERENCE, default_dtype="float64")


def _crystals():
    """Three periodic Cu/Ni systems of different sizes and cells (cubic, primitive), rattled."""
    cu = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 1, 1))              # 8 atoms
    ni = bulk("Ni", "fcc", a=3.52).repeat((3, 2, 2))                         # 12, skewed cell
    alloy = bulk("Cu", "fcc", a=3.58, cubic=True).repeat((2, 2, 1))          # 16
    alloy.numbers[::3] = 28
    for seed, atoms in enumerate((cu, ni, alloy)):
        atoms.rattle(0.05, seed=seed)
    return [cu, ni, alloy]


def _clusters():
    """Two clusters without a cell (torch-sim keeps one pbc flag per state)."""
    cu = Atoms("Cu4", positions=[[0, 0, 0], [2.5, 0, 0], [0, 2.5, 0], [0.1, 0.2, 2.5]])
    cuni = Atoms("Cu2Ni3", positions=[[0, 0, 0], [2.4, 0, 0], [0, 2.4, 0], [2.4, 2.4, 0.2],
                                      [1.2, 1.1, 1.9]])
    return [cu, cuni]


def _reference(atoms_list, calculator):
    """Per system: the ASE calculator's energy, forces and (periodic) 3x3 stress."""
    refs = []
    for atoms in atoms_list:
        atoms = atoms.copy()
        atoms.calc = calculator
        stress = (voigt_6_to_full_3x3_stress(atoms.get_stress()) if atoms.pbc.any()
                  else np.zeros((3, 3)))
        refs.append((atoms.get_potential_energy(), atoms.get_forces(), stress))
    return refs


def _assert_per_system(energy, forces, stress, atoms_list, calculator):
    """torch-sim outputs (``[S]``, ``[N, 3]``, ``[S, 3, 3]`` or None) equal the calculator's."""
    assert energy.shape == (len(atoms_list),)
    assert forces.shape == (sum(len(a) for a in atoms_list), 3)
    start = 0
    for k, (atoms, (e, f, s)) in enumerate(zip(atoms_list, _reference(atoms_list, calculator))):
        stop = start + len(atoms)
        assert float(energy[k]) == pytest.approx(e, abs=TOL), f"system {k}"
        np.testing.assert_allclose(forces[start:stop].numpy(), f, rtol=0, atol=TOL,
                                   err_msg=f"system {k}")
        if stress is not None:
            np.testing.assert_allclose(stress[k].numpy(), s, rtol=0, atol=TOL,
                                       err_msg=f"system {k}")
        start = stop


def test_torch_sims_validation_passes(tiny_model):
    """torch-sim's ``validate_model_outputs`` (Si and Fe systems: a tiny model of those)."""
    from torch_sim.models.interface import validate_model_outputs

    module = tiny_model(elements=(14, 26))
    model = AcceleratedMaceModel(module, **REFERENCE, default_dtype="float64",
                                 compute_stress=False)
    validate_model_outputs(model, CPU, torch.float64)
    assert model.compute_stress and model.n_calls == 4  # it switched stress on; 4 calls
    assert model.device == CPU and model.dtype == torch.float64


@pytest.mark.parametrize("as_dict", [False, True])
def test_batched_state_equals_calculator_per_system(model, calculator, as_dict):
    crystals = _crystals()
    state = ts.io.atoms_to_state(crystals, CPU, torch.float64)
    positions = state.positions.clone()
    out = model(vars(state) if as_dict else state)
    assert out["stress"].shape == (3, 3, 3)
    assert out["energy"].dtype == torch.float64 and not out["forces"].requires_grad
    _assert_per_system(out["energy"], out["forces"], out["stress"], crystals, calculator)
    assert torch.equal(state.positions, positions) and not state.positions.requires_grad


def test_clusters_without_cell(model, calculator):
    clusters = _clusters()
    state = ts.io.atoms_to_state(clusters, CPU, torch.float64)
    assert state.pbc is False
    out = model(state)
    _assert_per_system(out["energy"], out["forces"], out["stress"], clusters, calculator)


def test_new_atomic_numbers_are_picked_up(model, calculator):
    """Same atom count and systems, other elements: the cached one-hot must not be reused."""
    crystals = _crystals()
    model(ts.io.atoms_to_state(crystals, CPU, torch.float64))
    for atoms in crystals:
        atoms.numbers = np.where(atoms.numbers == 29, 28, 29)
    out = model(ts.io.atoms_to_state(crystals, CPU, torch.float64))
    _assert_per_system(out["energy"], out["forces"], out["stress"], crystals, calculator)


def test_forces_and_stress_can_be_left_out():
    model = AcceleratedMaceModel(None, **REFERENCE, default_dtype="float64", verify=False,
                                 compute_forces=False, compute_stress=False)
    state = ts.io.atoms_to_state(_crystals(), CPU, torch.float64)
    assert set(model(state)) == {"energy"}
    model.compute_forces = True
    assert set(model(state)) == {"energy", "forces"}


def _moved(atoms_list, seed=0, step=0.1):
    """Copies with every atom moved by up to ``step`` along each axis."""
    rng = np.random.default_rng(seed)
    out = [a.copy() for a in atoms_list]
    for atoms in out:
        atoms.positions += rng.uniform(-step, step, atoms.positions.shape)
    return out


def test_lists_are_kept_through_small_moves_and_wraps(calculator):
    """skin 0.4: moves below 0.2 Å and whole-cell wraps (torch-sim wraps every MD step) keep
    the lists; a larger move rebuilds that system's list only; the results stay exact."""
    model = AcceleratedMaceModel(None, **REFERENCE, default_dtype="float64", verify=False,
                                 skin=0.4)
    crystals = _crystals()
    model(ts.io.atoms_to_state(crystals, CPU, torch.float64))
    assert model.neighbours.n_builds == 3
    moved = _moved(crystals, step=0.1)  # at most 0.1 sqrt(3) = 0.17 Å
    moved[1].positions[:4] += moved[1].cell[0] - 2 * moved[1].cell[2]
    moved[2].wrap()
    out = model(ts.io.atoms_to_state(moved, CPU, torch.float64))
    assert model.neighbours.n_builds == 3
    _assert_per_system(out["energy"], out["forces"], out["stress"], moved, calculator)
    moved[1].positions[5] += [0.25, 0.0, 0.0]
    out = model(ts.io.atoms_to_state(moved, CPU, torch.float64))
    assert model.neighbours.n_builds == 4
    _assert_per_system(out["energy"], out["forces"], out["stress"], moved, calculator)
    # clusters (no cell, nothing to wrap): kept as well
    clusters = _clusters()
    model(ts.io.atoms_to_state(clusters, CPU, torch.float64))
    moved = _moved(clusters, step=0.1)
    out = model(ts.io.atoms_to_state(moved, CPU, torch.float64))
    assert model.neighbours.n_builds == 4 + 2
    _assert_per_system(out["energy"], out["forces"], None, moved, calculator)


def test_a_new_cell_or_skin_zero_rebuilds(calculator):
    crystals = _crystals()
    state = ts.io.atoms_to_state(crystals, CPU, torch.float64)
    model = AcceleratedMaceModel(None, **REFERENCE, default_dtype="float64", verify=False)
    model(state)
    strained = [a.copy() for a in crystals]
    strained[0].set_cell(strained[0].cell * 1.01, scale_atoms=True)
    out = model(ts.io.atoms_to_state(strained, CPU, torch.float64))
    assert model.neighbours.n_builds == 3 + 1
    _assert_per_system(out["energy"], out["forces"], out["stress"], strained, calculator)
    never = AcceleratedMaceModel(None, **REFERENCE, default_dtype="float64", verify=False,
                                 skin=0.0)
    for _ in range(2):
        out = never(state)
    assert never.neighbours.n_builds == 2 * 3
    _assert_per_system(out["energy"], out["forces"], out["stress"], crystals, calculator)


def test_pairs_beyond_the_cutoff_are_dropped_where_they_matter(tiny_model):
    """A block whose radial MLP sees node features: pairs between the cutoff and cutoff + skin
    are not exactly zero there, so a kept list must be cut back to the cutoff."""
    block = "RealAgnosticResidualNonLinearInteractionBlock"
    model = AcceleratedMaceModel(tiny_model(interaction=block, elements=(28, 29)),
                                 device="cpu", default_dtype="float64", skin=0.5)
    assert not model.neighbours.exact
    calculator = MACEAccelCalculator(tiny_model(interaction=block, elements=(28, 29)),
                                     device="cpu", default_dtype="float64")
    crystals = _crystals()
    model(ts.io.atoms_to_state(crystals, CPU, torch.float64))
    moved = _moved(crystals, step=0.1)
    out = model(ts.io.atoms_to_state(moved, CPU, torch.float64))
    assert model.neighbours.n_builds == 3
    _assert_per_system(out["energy"], out["forces"], out["stress"], moved, calculator)


@pytest.mark.parametrize("skin", [-0.1, float("nan"), True])
def test_bad_skin(skin):
    with pytest.raises(ConfigError, match="skin"):
        AcceleratedMaceModel(None, **REFERENCE, verify=False, skin=skin)


@pytest.mark.parametrize("integrator", ["nve", "nvt_langevin"])
def test_batched_md_ends_at_the_calculators_results(model, calculator, integrator):
    crystals = _crystals()
    state = ts.io.atoms_to_state(crystals, CPU, torch.float64)
    calls = model.n_calls
    final = ts.integrate(state, model, integrator=getattr(ts, integrator), n_steps=4,
                         temperature=600.0, timestep=0.002, seed=7)
    assert model.n_calls - calls == 5  # the initial forces and one call per step
    assert not torch.allclose(final.positions, state.positions)
    _assert_per_system(final.energy, final.forces, None, final.to_atoms(), calculator)


def _never_converged(state, last_energy=None):
    return torch.zeros(state.n_systems, dtype=torch.bool)


@pytest.mark.parametrize("optimizer", ["fire", "frechet_cell_fire"])
def test_batched_relaxation_ends_at_the_calculators_results(model, calculator, optimizer):
    crystals = _crystals()
    state = ts.io.atoms_to_state(crystals, CPU, torch.float64)
    start = model(state)["energy"]
    with pytest.warns(UserWarning, match="max steps"):  # stopped after a few steps on purpose
        final = ts.optimize(state, model, optimizer=getattr(ts.optimizers, optimizer),
                            convergence_fn=_never_converged, max_steps=6,
                            steps_between_swaps=3)
    assert [len(a) for a in final.to_atoms()] == [len(a) for a in crystals]  # input order
    assert torch.all(final.energy < start)  # FIRE went downhill in every system
    stress = final.stress if optimizer == "frechet_cell_fire" else None
    if stress is not None:
        assert not torch.allclose(final.cell, state.cell)  # the cells moved too
    _assert_per_system(final.energy, final.forces, stress, final.to_atoms(), calculator)


def _state_with(change):
    atoms_list = _crystals()
    change(atoms_list[1])
    return ts.io.atoms_to_state(atoms_list, CPU, torch.float64)


def _overlap(atoms):
    atoms.positions[3] = atoms.positions[2] + [0.1, 0.0, 0.0]


def _nan(atoms):
    atoms.positions[5, 1] = np.nan


@pytest.mark.parametrize("change, match", [
    (lambda atoms: atoms.numbers.__setitem__(4, 14),
     r"system 1: .*Si \(Z=14\).*atom indices \[4\].*elements are Ni, Cu"),
    (_overlap, r"system 1: atoms [23] and [23] are 0\.1000 Å apart"),
    (_nan, r"system 1: .*NaN"),
])
def test_bad_input_names_the_system(model, change, match):
    with pytest.raises(InputError, match=match):
        model(_state_with(change))


def test_unsorted_systems_are_refused(model):
    fields = vars(ts.io.atoms_to_state(_crystals()[:2], CPU, torch.float64))
    fields["system_idx"] = fields["system_idx"].flip(0)
    with pytest.raises(InputError, match="ascending"):
        model(fields)


def test_missing_torch_sim_says_how_to_install(monkeypatch):
    """Without torch-sim the module still imports (the package imports every module), and
    the model says how to install it."""
    monkeypatch.setitem(sys.modules, "torch_sim.models.interface", None)  # import fails
    monkeypatch.delitem(sys.modules, "mace_accel.torchsim")  # both restored afterwards
    monkeypatch.delattr(importlib.import_module("mace_accel"), "torchsim")
    module = importlib.import_module("mace_accel.torchsim")
    with pytest.raises(ImportError, match=r"pip install 'mace-accel\[torchsim\]'"):
        module.AcceleratedMaceModel(None, **REFERENCE)
