"""Benchmark structures with a realistic number of neighbours at each model's cutoff.

Two kinds:

* ``fcc``: a rattled fcc alloy of five elements (Cu, Ni, Fe, Co, Cr: several covalent radii,
  so models whose radial weights depend on the pair of elements see 15 pairs) on the lattice
  of Cu (a = 3.61 Å), n×n×n conventional cells, 4n³ atoms, ~78 neighbours per atom within 6 Å
  (256 = 4·4³, 2048 = 4·8³, 6912 = 4·12³). For MACE-MP-type models.
* ``molecular``: a periodic box of water, methanol and methylamine (H, C, N, O) at liquid
  density, ~55 neighbours per atom within 5 Å. For MACE-OFF-type models.

Elements the model does not have are replaced by elements it has (reported in
:attr:`BenchSystem.substitutions`); the geometry, and so the neighbour count, stays the same.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from mace_accel.bench.choices import SYSTEM_KINDS
from mace_accel.errors import InputError
from mace_accel.models.batch import ModelInfo, atoms_to_batch

FCC_A = 3.61  # Å, fcc Cu
FCC_ELEMENTS = (29, 28, 26, 27, 24)  # Cu, Ni, Fe, Co, Cr
FCC_RATTLE = 0.02  # Å, standard deviation of the random displacements

# (ase g2 name, fraction of molecules); liquid-like mixture of H, C, N, O
MOLECULES = (("H2O", 0.6), ("CH3OH", 0.2), ("H3CNH2", 0.2))
MOLECULAR_DENSITY = 0.95  # g/cm^3
MIN_INTERMOLECULAR = 1.5  # Å, closest allowed approach of atoms of different molecules
_AMU_PER_A3_TO_G_PER_CM3 = 1.66053907


@dataclasses.dataclass
class BenchSystem:
    """One benchmark structure.

    Attributes:
        atoms: the periodic ``ase.Atoms``.
        kind: ``"fcc"`` or ``"molecular"``.
        n_cells: supercell repeats n (fcc only: 4n³ atoms).
        substitutions: ``{wanted Z: used Z}`` for elements the model lacks.
        description: one line for reports.
    """

    atoms: object
    kind: str
    n_cells: Optional[int]
    substitutions: Dict[int, int]
    description: str

    @property
    def n_atoms(self) -> int:
        return len(self.atoms)


def cells_for_atoms(target_atoms: int) -> int:
    """The n (>= 1) whose fcc supercell size 4n³ is nearest to ``target_atoms``."""
    if target_atoms < 1:
        raise InputError(f"a benchmark size must be a positive atom count, got {target_atoms}")
    n = max(1, round((target_atoms / 4.0) ** (1.0 / 3.0)))
    return min((c for c in (n - 1, n, n + 1) if c >= 1), key=lambda c: abs(4 * c**3 - target_atoms))


def substitute(wanted: Sequence[int], available: Sequence[int]) -> Dict[int, int]:
    """Map each wanted atomic number to itself if available, else to an unused available one.

    Replacements are the available elements nearest in atomic number that are not already in
    use, so distinct wanted elements stay distinct while the model has enough elements.
    """
    available = sorted(set(int(z) for z in available))
    if not available:
        raise InputError("the model lists no atomic numbers; cannot build a structure for it")
    mapping = {z: z for z in wanted if z in available}
    used = set(mapping.values())
    for z in wanted:
        if z in mapping:
            continue
        free = [a for a in available if a not in used] or available
        mapping[z] = min(free, key=lambda a: (abs(a - z), a))
        used.add(mapping[z])
    return mapping


def choose_kind(info: ModelInfo) -> str:
    """``fcc`` for models with Cu and Ni (or neither H nor O), ``molecular`` for H/O models."""
    zs = set(info.atomic_numbers)
    if set(FCC_ELEMENTS) <= zs:
        return "fcc"
    return "molecular" if {1, 8} <= zs else "fcc"


def fcc_supercell(n: int, numbers: Tuple[int, ...] = FCC_ELEMENTS, a: float = FCC_A,
                  rattle: float = FCC_RATTLE, seed: int = 0):
    """Rattled random fcc alloy of ``numbers`` in equal shares, n×n×n conventional cells (4n³
    atoms)."""
    from ase.build import bulk

    if n < 1:
        raise InputError(f"the supercell needs n >= 1 cells per side, got {n}")
    rng = np.random.default_rng(seed)
    atoms = bulk("Cu", "fcc", a=a, cubic=True).repeat((n, n, n))
    species = np.resize(np.asarray(numbers), len(atoms))
    atoms.set_atomic_numbers(rng.permutation(species))
    atoms.positions = atoms.positions + rng.normal(0.0, rattle, size=atoms.positions.shape)
    atoms.wrap()
    return atoms


def _random_rotation(rng: np.random.Generator) -> np.ndarray:
    q = rng.normal(size=4)
    a, b, c, d = q / np.linalg.norm(q)
    return np.array([
        [a * a + b * b - c * c - d * d, 2 * (b * c - a * d), 2 * (b * d + a * c)],
        [2 * (b * c + a * d), a * a - b * b + c * c - d * d, 2 * (c * d - a * b)],
        [2 * (b * d - a * c), 2 * (c * d + a * b), a * a - b * b - c * c + d * d],
    ])


def _min_image_distance(points: np.ndarray, others: np.ndarray, box: float) -> float:
    if len(others) == 0:
        return math.inf
    d = points[:, None, :] - others[None, :, :]
    d -= box * np.round(d / box)
    return float(np.sqrt((d**2).sum(-1)).min())


def molecular_box(target_atoms: int, mapping: Mapping[int, int], seed: int = 0,
                  density: float = MOLECULAR_DENSITY, tries: int = 50):
    """A cubic periodic box of small molecules on a jittered grid at liquid density.

    Molecules (``MOLECULES``) are drawn until the atom count reaches ``target_atoms``, put on
    random sites of a k×k×k grid with random orientations; an orientation is redrawn (up to
    ``tries`` times, keeping the best) while an atom comes closer than ``MIN_INTERMOLECULAR`` to
    an atom of a neighbouring site.

    Args:
        mapping: ``{Z in the molecules: Z to use}`` (see :func:`substitute`).
    """
    import ase
    from ase.build import molecule

    if target_atoms < 1:
        raise InputError(f"a benchmark size must be a positive atom count, got {target_atoms}")
    rng = np.random.default_rng(seed)
    templates = []
    for name, _ in MOLECULES:
        mol = molecule(name)
        templates.append((mol.numbers.copy(), mol.positions - mol.get_center_of_mass(),
                          float(mol.get_masses().sum())))
    weights = np.array([w for _, w in MOLECULES]) / sum(w for _, w in MOLECULES)
    kinds: List[int] = []
    n_atoms = 0
    while n_atoms < target_atoms:
        kinds.append(int(rng.choice(len(templates), p=weights)))
        n_atoms += len(templates[kinds[-1]][0])
    mass = sum(templates[k][2] for k in kinds)
    box = (mass / (density / _AMU_PER_A3_TO_G_PER_CM3)) ** (1.0 / 3.0)
    k = math.ceil(len(kinds) ** (1.0 / 3.0))
    spacing = box / k
    sites = rng.choice(k**3, size=len(kinds), replace=False)
    placed: Dict[Tuple[int, int, int], np.ndarray] = {}
    numbers: List[np.ndarray] = []
    positions: List[np.ndarray] = []
    for kind, site in zip(kinds, sites):
        ijk = np.unravel_index(int(site), (k, k, k))
        near = [placed[key] for key in _neighbour_sites(ijk, k) if key in placed]
        others = np.concatenate(near) if near else np.zeros((0, 3))
        z, local, _ = templates[kind]
        best, best_d = None, -1.0
        for _ in range(tries):
            centre = (np.asarray(ijk) + 0.5) * spacing + rng.uniform(-0.1, 0.1, 3) * spacing
            xyz = local @ _random_rotation(rng).T + centre
            d = _min_image_distance(xyz, others, box)
            if d > best_d:
                best, best_d = xyz, d
            if d >= MIN_INTERMOLECULAR:
                break
        placed[tuple(int(v) for v in ijk)] = best
        numbers.append(np.array([mapping[int(v)] for v in z]))
        positions.append(best)
    atoms = ase.Atoms(numbers=np.concatenate(numbers), positions=np.concatenate(positions),
                      cell=np.eye(3) * box, pbc=True)
    atoms.wrap()
    return atoms


def _neighbour_sites(ijk, k: int):
    i, j, l = (int(v) for v in ijk)
    for di in (-1, 0, 1):
        for dj in (-1, 0, 1):
            for dl in (-1, 0, 1):
                yield ((i + di) % k, (j + dj) % k, (l + dl) % k)


def build_system(info: ModelInfo, target_atoms: int, kind: str = "auto",
                 seed: int = 0) -> BenchSystem:
    """The benchmark structure for a model at (about) ``target_atoms`` atoms.

    Args:
        info: the model's elements and cutoff (:func:`mace_accel.batch.model_info`).
        target_atoms: wanted size; fcc rounds to the nearest 4n³, molecular overshoots by at
            most one molecule.
        kind: ``"auto"`` (see :func:`choose_kind`), ``"fcc"`` or ``"molecular"``.
    """
    if kind not in SYSTEM_KINDS:
        raise InputError(f"system kind must be one of {SYSTEM_KINDS}, got {kind!r}")
    kind = choose_kind(info) if kind == "auto" else kind
    if kind == "fcc":
        mapping = substitute(FCC_ELEMENTS, info.atomic_numbers)
        n = cells_for_atoms(target_atoms)
        atoms = fcc_supercell(n, numbers=tuple(mapping[z] for z in FCC_ELEMENTS), seed=seed)
        text = f"rattled fcc {_formula(mapping, FCC_ELEMENTS)} {n}x{n}x{n} cells, a={FCC_A} Å"
        return BenchSystem(atoms, "fcc", n, _changed(mapping), text)
    mapping = substitute((1, 6, 7, 8), info.atomic_numbers)
    atoms = molecular_box(target_atoms, mapping, seed=seed)
    text = (f"box of H2O/CH3OH/CH3NH2 at {MOLECULAR_DENSITY} g/cm3 "
            f"({_formula(mapping, (1, 6, 7, 8))})")
    return BenchSystem(atoms, "molecular", None, _changed(mapping), text)


def _changed(mapping: Mapping[int, int]) -> Dict[int, int]:
    return {z: u for z, u in mapping.items() if z != u}


def _formula(mapping: Mapping[int, int], wanted: Sequence[int]) -> str:
    from ase.data import chemical_symbols

    return "/".join(chemical_symbols[mapping[z]] for z in wanted)


def make_batch(system: BenchSystem, info: ModelInfo, dtype: torch.dtype,
               device: torch.device | str) -> Tuple[Dict[str, torch.Tensor], int]:
    """The model batch of ``system`` on ``device`` and its edge count ``E``.

    Returns:
        (batch dict as :func:`mace_accel.batch.atoms_to_batch` builds it, ``E`` = edge_index
        columns).
    """
    batch = atoms_to_batch(system.atoms, info, dtype=dtype, device=device)
    return batch, int(batch["edge_index"].shape[1])
