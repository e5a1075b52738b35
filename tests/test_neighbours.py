"""The vesin neighbour list against mace's own (matscipy) on the cells that break neighbour
lists, the Verlet skin, and bad input. CPU only except the one ``gpu`` test."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk, fcc111, molecule

from mace_accel.errors import InputError
from mace_accel.models.neighbours import VerletNeighbourList, neighbour_list, within_cutoff

PERIODIC = (True, True, True)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _triples(edge_index, unit_shifts):
    """The edges as a set of ``(sender, receiver, (sa, sb, sc))``; fails on duplicates."""
    edge_index = np.asarray(torch.as_tensor(edge_index).cpu())
    unit_shifts = np.asarray(torch.as_tensor(unit_shifts).cpu())
    shifts = np.rint(unit_shifts).astype(int)
    assert np.array_equal(shifts, unit_shifts), "unit shifts must be whole numbers"
    triples = list(zip(edge_index[0].tolist(), edge_index[1].tolist(),
                       map(tuple, shifts.tolist())))
    assert len(set(triples)) == len(triples), "duplicate edges"
    return set(triples)


def _mace_triples(atoms, cutoff):
    from mace_accel._e3nn_compat import import_mace

    import_mace()
    from mace.data.neighborhood import get_neighborhood

    # get_neighborhood writes into the cell it is given: hand it a copy
    edge_index, _, unit_shifts, *_ = get_neighborhood(
        np.array(atoms.positions), cutoff, tuple(bool(p) for p in atoms.pbc),
        np.array(atoms.cell.array))
    return _triples(edge_index, unit_shifts)


def _ours(atoms, cutoff, device="cpu", dtype=torch.float64):
    edge_index, unit_shifts = neighbour_list(
        torch.tensor(atoms.positions, dtype=dtype, device=device),
        torch.tensor(atoms.cell.array, device=device), tuple(atoms.pbc), cutoff)
    assert edge_index.device.type == unit_shifts.device.type == torch.device(device).type
    assert edge_index.dtype == torch.int64 and unit_shifts.dtype == dtype
    assert edge_index.shape[0] == 2 and unit_shifts.shape == (edge_index.shape[1], 3)
    return _triples(edge_index, unit_shifts)


def _geometry(atoms, dtype=torch.float64):
    return (torch.tensor(atoms.positions, dtype=dtype), torch.tensor(atoms.cell.array),
            tuple(bool(p) for p in atoms.pbc))


# ---------------------------------------------------------------------------------------------
# structures
# ---------------------------------------------------------------------------------------------


def _fcc():
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(2)  # 32 atoms, 7.22 Å cube
    atoms.rattle(0.05, seed=0)
    return atoms


def _slab(vacuum=6.0):
    atoms = fcc111("Cu", size=(2, 2, 3), a=3.61, vacuum=vacuum, periodic=False)
    atoms.pbc = (True, True, False)
    atoms.rattle(0.03, seed=4)
    return atoms


def _cases():
    primitive = bulk("Cu", "fcc", a=3.61)  # 1 atom, triclinic (60 degree) cell
    primitive.rattle(0.02, seed=1)
    primitive = primitive.repeat((2, 1, 1))
    primitive.rattle(0.02, seed=2)
    skewed = Atoms("Cu3", positions=[[0, 0, 0], [1.2, 1.1, 0.9], [3.0, 0.4, 1.7]],
                   cell=[[3.0, 0.0, 0.0], [8.7, 2.5, 0.0], [-5.9, 0.8, 2.6]], pbc=True)
    many_images = bulk("Cu", "fcc", a=3.61, orthorhombic=True)  # 2 atoms, 2.55 x 2.55 x 3.61
    many_images.rattle(0.02, seed=3)
    ethanol = molecule("CH3CH2OH")
    ethanol.rattle(0.01, seed=5)
    ethanol.cell = np.zeros((3, 3))
    ethanol.pbc = False
    wire = Atoms("Cu4", positions=[[0, 0, 0], [1.3, 0.2, 1.8], [0.1, 1.4, 3.6], [1.2, 1.1, 5.4]],
                 cell=[[0, 0, 0], [0, 0, 0], [0.3, 0.2, 7.2]], pbc=(False, False, True))
    return {
        "fcc-supercell": (_fcc(), 5.0),
        "triclinic": (primitive, 5.0),
        "skewed": (skewed, 5.5),
        "many-images": (many_images, 6.0),
        "molecule": (ethanol, 3.0),
        "slab": (_slab(), 5.0),
        "slab-zero-c": (_slab(vacuum=None), 5.0),  # pbc (T, T, F) and a zero third vector
        "wire": (wire, 4.0),
    }


CASES = _cases()


# ---------------------------------------------------------------------------------------------
# the pairs are mace's
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_pairs_as_mace(name):
    atoms, cutoff = CASES[name]
    ours = _ours(atoms, cutoff)
    assert len(ours) > len(atoms)
    assert ours == _mace_triples(atoms, cutoff)
    assert not any(i == j and s == (0, 0, 0) for i, j, s in ours)


def test_many_images_include_an_atoms_own_images():
    atoms, cutoff = CASES["many-images"]
    ours = _ours(atoms, cutoff)
    assert any(i == j for i, j, _ in ours)
    assert max(max(abs(x) for x in s) for _, _, s in ours) >= 2  # cutoff > twice the cell


@pytest.mark.parametrize("name", ["skewed", "slab", "molecule"])
def test_edge_vectors_follow_mace_convention(name):
    atoms, cutoff = CASES[name]
    pos, cell, pbc = _geometry(atoms)
    edge_index, unit_shifts = neighbour_list(pos, cell, pbc, cutoff)
    vectors = pos[edge_index[1]] - pos[edge_index[0]] + unit_shifts @ cell
    assert float(vectors.norm(dim=1).max()) < cutoff
    for axis in range(3):
        if not pbc[axis]:
            assert not unit_shifts[:, axis].any()


def test_float32_positions_and_grad_are_accepted():
    atoms, cutoff = CASES["fcc-supercell"]
    pos = torch.tensor(atoms.positions, dtype=torch.float32, requires_grad=True)
    edge_index, unit_shifts = neighbour_list(pos, torch.tensor(atoms.cell.array), PERIODIC,
                                             cutoff)
    assert unit_shifts.dtype == torch.float32 and not unit_shifts.requires_grad
    assert _triples(edge_index, unit_shifts) == _ours(atoms, cutoff)


def test_empty_and_lonely_structures():
    cell = torch.zeros(3, 3, dtype=torch.float64)
    for n in (0, 1):
        edge_index, unit_shifts = neighbour_list(torch.zeros(n, 3), cell, (False,) * 3, 4.0)
        assert edge_index.shape == (2, 0) and unit_shifts.shape == (0, 3)
        assert edge_index.dtype == torch.int64 and unit_shifts.dtype == torch.float32


def test_importing_the_module_does_not_import_vesin():
    code = ("import sys, mace_accel.models.neighbours; "
            "assert 'vesin' not in sys.modules, 'vesin imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------------------------------------
# Verlet list
# ---------------------------------------------------------------------------------------------


def _inside(positions, cell, edges, cutoff):
    return _triples(*within_cutoff(positions, cell, edges[0], edges[1], cutoff))


def test_verlet_list_reuses_while_atoms_move_less_than_half_the_skin():
    atoms, cutoff = CASES["fcc-supercell"]
    pos, cell, pbc = _geometry(atoms)
    nl = VerletNeighbourList(cutoff, skin=0.4)
    e0, s0, rebuilt = nl.update(pos, cell, pbc)
    assert rebuilt and nl.n_builds == 1
    assert _triples(e0, s0) == _ours(atoms, cutoff + 0.4)

    gen = torch.Generator().manual_seed(0)
    moved = pos + 0.19 * torch.nn.functional.normalize(
        torch.randn(pos.shape, generator=gen, dtype=pos.dtype), dim=1)  # every atom 0.19 Å
    e1, s1, rebuilt = nl.update(moved, cell.clone(), pbc)
    assert not rebuilt and nl.n_builds == 1
    assert e1 is e0 and s1 is s0  # the very same tensors
    fresh = _triples(*neighbour_list(moved, cell, pbc, cutoff))
    assert fresh <= _triples(e1, s1)
    assert _inside(moved, cell, (e1, s1), cutoff) == fresh

    jumped = moved.clone()
    jumped[5] = pos[5] + torch.tensor([0.0, 0.0, 0.25], dtype=pos.dtype)  # > skin / 2
    e2, s2, rebuilt = nl.update(jumped, cell, pbc)
    assert rebuilt and nl.n_builds == 2
    assert _triples(e2, s2) == _triples(*neighbour_list(jumped, cell, pbc, cutoff + 0.4))


def test_verlet_list_rebuilds_when_the_system_changes():
    atoms, cutoff = CASES["fcc-supercell"]
    pos, cell, pbc = _geometry(atoms)
    nl = VerletNeighbourList(cutoff, skin=0.5)
    nl.update(pos, cell, pbc)

    strained = cell.clone()
    strained[0, 1] += 1e-9  # exact comparison: any change rebuilds
    assert nl.update(pos, strained, pbc)[2] and nl.n_builds == 2
    assert not nl.update(pos, strained, pbc)[2] and nl.n_builds == 2
    assert nl.update(pos[:-1], strained, pbc)[2] and nl.n_builds == 3      # one atom fewer
    assert nl.update(pos, strained, (True, True, False))[2]                # periodicity
    assert nl.update(pos.float(), strained, (True, True, False))[2]        # dtype
    assert nl.n_builds == 5
    edge_index, unit_shifts, _ = nl.update(pos.float(), strained, (True, True, False))
    assert unit_shifts.dtype == torch.float32 and nl.n_builds == 5

    every_call = VerletNeighbourList(cutoff, skin=0.0)
    for _ in range(3):
        assert every_call.update(pos, cell, pbc)[2]
    assert every_call.n_builds == 3


def test_verlet_list_notices_a_cell_changed_in_place():
    """The list keeps its own copy of the geometry: the caller's cell tensor changed in place
    rebuilds; a caller's host copies are what the reuse is decided from, and changing them in
    place afterwards rebuilds too."""
    atoms, cutoff = CASES["fcc-supercell"]
    pos, cell, pbc = _geometry(atoms)
    nl = VerletNeighbourList(cutoff, skin=0.5)
    nl.update(pos, cell, pbc)
    assert not nl.update(pos, cell, pbc)[2]
    cell[0, 1] += 1e-9
    assert nl.update(pos, cell, pbc)[2] and nl.n_builds == 2
    host_pos, host_cell = pos.numpy().copy(), cell.numpy().copy()
    assert not nl.update(pos + 1.0, cell, pbc, host=(host_pos, host_cell))[2]
    assert nl.n_builds == 2
    host_pos[0] += 1.0
    assert nl.update(pos, cell, pbc, host=(host_pos, host_cell))[2] and nl.n_builds == 3


def test_verlet_list_on_a_molecule_and_a_slab():
    for name in ("molecule", "slab-zero-c"):
        atoms, cutoff = CASES[name]
        pos, cell, pbc = _geometry(atoms)
        nl = VerletNeighbourList(cutoff, skin=0.6)
        edges = nl.update(pos, cell, pbc)[:2]
        moved = pos + 0.1
        assert not nl.update(moved, cell, pbc)[2]
        assert _inside(moved, cell, edges, cutoff) == _triples(
            *neighbour_list(moved, cell, pbc, cutoff))


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


def test_nan_positions_are_an_input_error():
    atoms, cutoff = CASES["fcc-supercell"]
    pos, cell, pbc = _geometry(atoms)
    bad = pos.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(InputError, match="NaN"):
        neighbour_list(bad, cell, pbc, cutoff)
    nl = VerletNeighbourList(cutoff, skin=0.5)
    nl.update(pos, cell, pbc)
    with pytest.raises(InputError, match="NaN"):
        nl.update(bad, cell, pbc)
    bad[2, 1] = float("inf")
    with pytest.raises(InputError, match="infinite"):
        nl.update(bad, cell, pbc)


@pytest.mark.parametrize("pbc", [(True, True, True), (True, True, False)])
def test_singular_periodic_cell_is_an_input_error(pbc):
    atoms, cutoff = CASES["fcc-supercell"]
    pos, cell, _ = _geometry(atoms)
    flat = cell.clone()
    flat[1] = 2.0 * flat[0]  # b parallel to a
    with pytest.raises(InputError, match="periodic cell is singular"):
        neighbour_list(pos, flat, pbc, cutoff)
    with pytest.raises(InputError, match="periodic cell is singular"):
        VerletNeighbourList(cutoff).update(pos, torch.zeros(3, 3, dtype=pos.dtype), pbc)


@pytest.mark.parametrize("positions, cell, pbc, cutoff, match", [
    (torch.zeros(4, 2), torch.eye(3), PERIODIC, 3.0, r"shape \[n_atoms, 3\]"),
    (torch.zeros(4), torch.eye(3), PERIODIC, 3.0, r"shape \[n_atoms, 3\]"),
    (torch.zeros(4, 3, dtype=torch.int64), torch.eye(3), PERIODIC, 3.0, "floating"),
    (np.zeros((4, 3)), torch.eye(3), PERIODIC, 3.0, "torch.Tensor"),
    (torch.zeros(4, 3), torch.eye(2), PERIODIC, 3.0, "3x3"),
    (torch.zeros(4, 3), torch.eye(3), (True, True), 3.0, "three booleans"),
    (torch.zeros(4, 3), torch.eye(3), PERIODIC, 0.0, "cutoff"),
    (torch.zeros(4, 3), torch.eye(3), PERIODIC, float("nan"), "cutoff"),
])
def test_malformed_input_is_an_input_error(positions, cell, pbc, cutoff, match):
    with pytest.raises(InputError, match=match):
        neighbour_list(positions, cell, pbc, cutoff)


def test_bad_skin_is_an_input_error():
    with pytest.raises(InputError, match="skin"):
        VerletNeighbourList(5.0, skin=-0.1)


# ---------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_gives_the_cpu_pairs(name):
    atoms, cutoff = CASES[name]
    assert _ours(atoms, cutoff, device="cuda") == _ours(atoms, cutoff)
    pos, cell, pbc = _geometry(atoms)
    nl = VerletNeighbourList(cutoff, skin=0.5)
    edge_index, unit_shifts, _ = nl.update(pos.cuda(), cell.cuda(), pbc)
    assert edge_index.is_cuda and unit_shifts.is_cuda
    assert not nl.update(pos.cuda() + 0.1, cell.cuda(), pbc)[2]
    assert nl.update(pos, cell, pbc)[2]  # back on the CPU: rebuilt
    assert _triples(*nl.update(pos, cell, pbc)[:2]) == _ours(atoms, cutoff + 0.5)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_list_on_a_gpu_other_than_the_current_one():
    """vesin launches on the current device: a list of positions on another GPU (a LAMMPS rank's,
    a calculator's on ``cuda:1``) must still be right, not an illegal memory access."""
    atoms, cutoff = CASES["molecule"]
    big = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((12, 12, 12))  # a cell list, not brute
    big.pbc = False
    with torch.cuda.device(0):
        for system, cut in ((atoms, cutoff), (big, 5.0)):
            assert _ours(system, cut, device="cuda:1") == _ours(system, cut)


@pytest.mark.parametrize("limit", [None, 10])
def test_a_list_longer_than_the_limit_gives_only_the_pairs_within_the_cutoff(limit):
    """An exact model is given the Verlet list's pairs beyond the cutoff up to
    ``skin_edges_up_to`` edges (a graph replay keeps its edge tensors); a longer list gives only
    the pairs within the cutoff (an eager call: less work and memory)."""
    from mace_accel.models.batch import model_info
    from mace_accel.models.checkpoint import default_model_path, load_model
    from mace_accel.models.resident import ResidentBatch

    info = model_info(load_model(default_model_path(), device="cpu", dtype=torch.float64))
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((3, 3, 3))
    atoms.rattle(stdev=0.05, seed=1)
    resident = ResidentBatch(info, info.heads[-1], torch.float64, torch.device("cpu"), skin=0.5,
                             exact_skin=True, skin_edges_up_to=limit)
    batch = resident.batch(atoms)
    pos, cell = batch["positions"], batch["cell"].reshape(3, 3)
    inside = _inside(pos, cell, (batch["edge_index"], batch["unit_shifts"]), info.r_max)
    listed = _triples(batch["edge_index"], batch["unit_shifts"])
    assert inside == _ours(atoms, info.r_max)
    assert (listed == inside) == (limit is not None)  # else the skin's pairs too
