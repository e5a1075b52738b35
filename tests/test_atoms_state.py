"""``changed_properties`` answers as ASE's ``compare_atoms`` on every kind of change."""

from __future__ import annotations

import numpy as np
import pytest
from ase.build import bulk, molecule
from ase.calculators.calculator import compare_atoms

from mace_accel.models.atoms_state import changed_properties


def _variants():
    base = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 2))
    base.rattle(0.01, seed=1)
    out = {"same object": (base, base), "copy": (base, base.copy())}

    def edit(name, change):
        other = base.copy()
        change(other)
        out[name] = (base, other)

    edit("moved far", lambda a: a.positions.__setitem__((3, 1), a.positions[3, 1] + 1e-3))
    edit("moved within tol", lambda a: a.positions.__setitem__((3, 1), np.nextafter(
        a.positions[3, 1], np.inf)))
    edit("nan position", lambda a: a.positions.__setitem__((0, 0), np.nan))
    edit("numbers", lambda a: a.numbers.__setitem__(2, 28))
    edit("cell", lambda a: a.set_cell(a.cell.array * 1.01, scale_atoms=False))
    edit("pbc", lambda a: a.set_pbc((True, False, True)))
    edit("charges added", lambda a: a.set_initial_charges(np.ones(len(a))))
    edit("magmoms added", lambda a: a.set_initial_magnetic_moments(np.ones(len(a))))
    edit("momenta only", lambda a: a.set_momenta(np.ones((len(a), 3))))
    nanned = base.copy()
    nanned.positions[1, 2] = np.nan
    out["nan in both"] = (nanned, nanned.copy())
    mol = molecule("H2O")
    out["other structure"] = (base, mol)
    out["no previous"] = (None, base)
    return out


@pytest.mark.parametrize("name", list(_variants()))
@pytest.mark.parametrize("excluded", [None, {"positions"}, {"cell", "numbers"}])
def test_changed_properties_is_ases_compare_atoms(name, excluded):
    before, after = _variants()[name]
    ours = changed_properties(before, after, 1e-15, excluded)
    ase = compare_atoms(before, after, tol=1e-15, excluded_properties=excluded)
    assert sorted(ours) == sorted(ase)
    assert len(ours) == len(set(ours))


def test_the_calculator_uses_it():
    from mace_accel.calculator import MACEAccelCalculator

    calc = MACEAccelCalculator.__new__(MACEAccelCalculator)
    calc.atoms = None
    atoms = bulk("Cu", "fcc", a=3.6)
    assert sorted(calc.check_state(atoms)) == sorted(compare_atoms(None, atoms))
    calc.atoms = atoms.copy()
    assert calc.check_state(atoms) == []
    atoms.positions[0, 0] += 0.1
    assert calc.check_state(atoms) == ["positions"]
