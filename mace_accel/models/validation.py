"""Checks on a structure before it reaches a model: each failure names what is wrong and where.

A MACE model given NaN positions, an unknown element, overlapping atoms or a periodic cell of
zero volume returns garbage (or an opaque indexing error deep in the neighbour list); these
checks turn each case into an :class:`~mace_accel.errors.InputError` that says how to fix it.
All checks are O(N): the overlap check uses a neighbour list with the threshold as cutoff.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from mace_accel.errors import InputError
from mace_accel.models.batch import ModelInfo

_AXES = "abc"
# relative volume |det(cell)| / (|a||b||c|) below which a periodic cell counts as degenerate
_DEGENERATE_CELL = 1e-8


def validate_atoms(atoms, info: ModelInfo, min_distance: Optional[float] = 0.5) -> None:
    """Raise :class:`InputError` if ``atoms`` cannot be evaluated by the model ``info`` describes.

    Args:
        atoms: an ``ase.Atoms``.
        info: the model's :class:`~mace_accel.batch.ModelInfo` (elements, cutoff, heads).
        min_distance: smallest allowed interatomic distance in Å, periodic images included
            (None or 0 disables the check).

    Raises:
        InputError: ``min_distance`` negative; empty structure; element not in the model; NaN/inf
            positions or cell; a periodic direction with a zero-length or linearly dependent
            cell vector; two atoms (or an atom and a periodic image) closer than
            ``min_distance``.
    """
    if min_distance is not None and not (np.isfinite(min_distance) and min_distance >= 0):
        raise InputError(f"min_distance must be a distance >= 0 Å (0 or None: no overlap check), "
                         f"got {min_distance}")
    n_atoms = len(atoms)
    if n_atoms == 0:
        raise InputError("the structure is empty (0 atoms); there is nothing to evaluate")
    _check_elements(np.asarray(atoms.numbers), info)
    _check_positions(np.asarray(atoms.positions, dtype=np.float64))
    _check_cell(np.asarray(atoms.cell.array, dtype=np.float64), np.asarray(atoms.pbc, dtype=bool))
    if min_distance:
        _check_distances(atoms, float(min_distance))


def validate_positions(atoms) -> None:
    """Finite positions (the per-step check while the cell is unchanged)."""
    _check_positions(np.asarray(atoms.positions, dtype=np.float64))


def validate_geometry(atoms) -> None:
    """The per-step part of :func:`validate_atoms` for a structure already validated once:
    finite positions and a usable cell (O(N), no distances; the calculator checks those from
    the neighbour list on the device)."""
    _check_positions(np.asarray(atoms.positions, dtype=np.float64))
    _check_cell(np.asarray(atoms.cell.array, dtype=np.float64), np.asarray(atoms.pbc, dtype=bool))


def validate_head(head: Optional[str], info: ModelInfo) -> str:
    """The head to evaluate: ``head`` if the model has it, else a clear error.

    With ``head=None``: the model's only head, or the one called ``default`` (any case), as
    mace's calculator picks it; a multi-head model without one needs an explicit ``head``.
    """
    heads = list(info.heads)
    if head is None:
        if len(heads) == 1:
            return heads[0]
        default = [h for h in heads if h.lower() == "default"]
        if default:
            return default[0]
        raise InputError(f"the model has several heads {heads} and none is called 'default'; "
                         "choose one with head=...")
    if head not in heads:
        raise InputError(f"unknown head {head!r}; the model's heads are {heads}: choose one "
                         "with head=...")
    return head


def _check_elements(numbers: np.ndarray, info: ModelInfo) -> None:
    from ase.data import chemical_symbols

    known = set(info.atomic_numbers)
    unknown = sorted(set(np.unique(numbers).tolist()) - known)  # unique first: O(N) in numpy
    if not unknown:
        return
    names = ", ".join(f"{_symbol(z, chemical_symbols)} (Z={z})" for z in unknown)
    first = np.nonzero(~np.isin(numbers, list(known)))[0]
    raise InputError(
        f"the structure contains element(s) {names} that the model does not know (atom "
        f"indices {_few(first)}); the model's elements are {', '.join(info.symbols)}. Remove those "
        "atoms or use a model trained on them")


def _symbol(z: int, table: Sequence[str]) -> str:
    return table[z] if 0 <= z < len(table) else f"Z{z}"


def _check_positions(positions: np.ndarray) -> None:
    finite = np.isfinite(positions)
    if finite.all():
        return
    bad = np.nonzero(~finite.all(axis=1))[0]
    raise InputError(f"positions of atom(s) {_few(bad)} are NaN or inf ({len(bad)} atom(s) in "
                     "all); the structure is broken (e.g. an MD run or optimiser diverged)")


def _check_cell(cell: np.ndarray, pbc: np.ndarray) -> None:
    if not np.isfinite(cell).all():
        raise InputError(f"the cell contains NaN or inf: {cell.tolist()}")
    if not pbc.any():
        return
    lengths = np.linalg.norm(cell, axis=1)
    zero = [i for i in range(3) if pbc[i] and lengths[i] == 0.0]
    if zero:
        axes = ", ".join(_AXES[i] for i in zero)
        raise InputError(
            f"pbc is True along {axes} but cell vector(s) {axes} have zero length (pbc="
            f"{pbc.tolist()}, cell={cell.tolist()}); set a cell with atoms.set_cell(...) or turn "
            "periodicity off in those directions with atoms.pbc = ...")
    vectors = cell[pbc]
    # volume (area, length) spanned by the periodic vectors, relative to the product of lengths
    gram = np.linalg.det(vectors @ vectors.T)
    relative = np.sqrt(max(gram, 0.0)) / float(np.prod(lengths[pbc]))
    if relative < _DEGENERATE_CELL:
        axes = ", ".join(_AXES[i] for i in range(3) if pbc[i])
        raise InputError(
            f"the periodic cell vectors {axes} are linearly dependent (zero volume; cell="
            f"{cell.tolist()}, pbc={pbc.tolist()}); give the structure a proper cell")


def _check_distances(atoms, min_distance: float) -> None:
    """Closest pair below ``min_distance``, periodic images included, from a neighbour list
    with ``min_distance`` as its cutoff (:func:`~mace_accel.models.neighbours.neighbour_list`)."""
    import torch

    from mace_accel.models.neighbours import neighbour_list

    positions = torch.from_numpy(np.asarray(atoms.positions, dtype=np.float64))
    cell = torch.from_numpy(np.asarray(atoms.cell.array, dtype=np.float64))
    edge_index, unit_shifts = neighbour_list(positions, cell, tuple(bool(p) for p in atoms.pbc),
                                             min_distance)
    if edge_index.shape[1] == 0:
        return
    sender, receiver = edge_index
    distances = (positions[receiver] - positions[sender] + unit_shifts @ cell).norm(dim=1)
    # the list holds each pair in both directions, (a, b, shift) and (b, a, -shift): name a <= b
    distances[sender > receiver] = np.inf
    k = int(torch.argmin(distances))
    a, b, dist = int(sender[k]), int(receiver[k]), float(distances[k])
    where = ("an atom and its own periodic image" if a == b else
             "across a periodic boundary" if bool(unit_shifts[k].any()) else "in the same cell")
    symbols = atoms.get_chemical_symbols()
    raise InputError(
        f"atoms {a} ({symbols[a]}) and {b} ({symbols[b]}) are {dist:.4f} Å apart ({where}), "
        f"closer than min_distance={min_distance} Å ({edge_index.shape[1] // 2} such pair(s)); "
        "the structure has overlapping atoms (check units and the cell), or lower min_distance")


def _few(indices: np.ndarray, limit: int = 10) -> str:
    shown = ", ".join(str(int(v)) for v in indices[:limit])
    return f"[{shown}{', ...' if len(indices) > limit else ''}]"
