"""Many structures in one mace batch dict, built from arrays (no mace ``AtomicData`` per frame).

mace's own data path costs ~4 ms of Python per structure (``config_from_atoms``,
``AtomicData.from_config``, ``Batch.from_data_list``): more than the GPU needs to evaluate a
small structure. Here each frame is reduced once to a few numpy arrays (:class:`HostFrame`: element
indices, float64 positions and cell, the vesin neighbour list on the CPU) and a list of frames is
concatenated into the batch dict with one copy per field to the device.

The fields that do not depend on the structure (charges, spin, electronic temperature, ... which
mace fills with defaults when the ``ase.Atoms`` carries none) are copied from a template built
once through mace's own data path, so the batch has exactly the fields and defaults mace's would
(tested field by field against ``atoms_to_batch``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from mace_accel.errors import InputError
from mace_accel.models.batch import ModelInfo, atoms_to_batch
from mace_accel.models.neighbours import neighbour_list
from mace_accel.models.validation import validate_atoms

Tensor = torch.Tensor

# fields the model reads from the structure itself; all other per-node / per-graph fields of the
# template are structure-independent defaults (labels and their weights are not passed at all)
GEOMETRY = ("positions", "node_attrs", "edge_index", "shifts", "unit_shifts", "cell", "rcell",
            "volume", "pbc", "batch", "ptr", "head")
LABELS = ("energy", "forces", "stress", "virials", "dipole", "polarizability")


@dataclasses.dataclass
class HostFrame:
    """One validated structure as host arrays.

    Attributes:
        species: ``[N]`` int64 index of each atom's element in the model's table.
        positions: ``[N, 3]`` float64, Å.
        cell: ``[3, 3]`` float64 (rows a, b, c; zeros for a molecule).
        pbc: ``[3]`` bool.
        edge_index: ``[2, E]`` int64 (sender, receiver), mace's convention.
        unit_shifts: ``[E, 3]`` float64 whole numbers.
    """

    species: np.ndarray
    positions: np.ndarray
    cell: np.ndarray
    pbc: np.ndarray
    edge_index: np.ndarray
    unit_shifts: np.ndarray

    @property
    def n_atoms(self) -> int:
        return int(self.positions.shape[0])

    @property
    def n_edges(self) -> int:
        return int(self.edge_index.shape[1])


def species_table(info: ModelInfo) -> np.ndarray:
    """``[119]`` int64: atomic number -> index in the model's element table (-1: unknown)."""
    table = np.full(119, -1, dtype=np.int64)
    for index, z in enumerate(info.atomic_numbers):
        table[int(z)] = index
    return table


def host_frame(atoms, info: ModelInfo, table: np.ndarray,
               min_distance: Optional[float] = 0.5) -> HostFrame:
    """Validate ``atoms`` and reduce it to a :class:`HostFrame` (neighbour list: vesin, CPU).

    The overlap check uses the neighbour list's own distances; only a structure that fails it
    goes through :func:`validate_atoms`'s full distance check, for the message naming the atoms.

    Raises:
        InputError: as :func:`validate_atoms`.
    """
    validate_atoms(atoms, info, min_distance=None)
    positions = np.ascontiguousarray(atoms.positions, dtype=np.float64)
    cell = np.ascontiguousarray(atoms.cell.array, dtype=np.float64)
    pbc = np.asarray(atoms.pbc, dtype=bool).copy()
    edge_index, unit_shifts = neighbour_list(torch.from_numpy(positions), torch.from_numpy(cell),
                                             tuple(pbc.tolist()), info.r_max)
    edge_index, unit_shifts = edge_index.numpy(), unit_shifts.numpy()
    if min_distance and edge_index.shape[1]:
        vectors = positions[edge_index[1]] - positions[edge_index[0]] + unit_shifts @ cell
        if float(np.einsum("ij,ij->i", vectors, vectors).min()) < float(min_distance) ** 2:
            validate_atoms(atoms, info, min_distance=min_distance)  # raises, naming the atoms
    return HostFrame(table[np.asarray(atoms.numbers)], positions, cell, pbc, edge_index,
                     unit_shifts)


class FrameBatcher:
    """Concatenates :class:`HostFrame` s into one mace batch dict on ``device``.

    Args:
        template_atoms: any structure the model can evaluate; mace's data path builds a batch of
            it once to learn the fields and their default values.
        info: the model's elements, cutoff, heads.
        head: the head to evaluate.
        dtype: the model's floating dtype.
        device: where the batch goes.
    """

    def __init__(self, template_atoms, info: ModelInfo, head: str, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.info, self.head, self.dtype = info, head, dtype
        self.device = torch.device(device)
        template = atoms_to_batch(template_atoms, info, head=head, dtype=dtype, device="cpu")
        n = int(template["positions"].shape[0])
        self.head_index = int(template["head"].reshape(-1)[0])
        # structure-independent defaults: one row per node, or one per graph
        self.per_node: Dict[str, Tensor] = {}
        self.per_graph: Dict[str, Tensor] = {}
        for name, value in template.items():
            if name in GEOMETRY or name in LABELS or name.endswith("weight") \
                    or not torch.is_tensor(value) or value.dim() == 0:
                continue
            if value.shape[0] == n and n != 1:
                self.per_node[name] = value[:1]
            elif value.shape[0] == 1:
                self.per_graph[name] = value
        self.fields = tuple(template)
        self.table = species_table(info)

    def collate(self, frames: Sequence[HostFrame]) -> Dict[str, Tensor]:
        """The batch dict of ``frames`` (graph ``k`` = ``frames[k]``), on the device.

        Returns:
            mace's fields: ``positions [N, 3]``, ``node_attrs [N, n_elements]``,
            ``edge_index [2, E]`` (offset per graph), ``shifts``/``unit_shifts [E, 3]``,
            ``cell``/``rcell [3 S, 3]``, ``volume [S]``, ``pbc [S, 3]``, ``batch [N]``,
            ``ptr [S + 1]``, ``head [S]``, and the defaults of the template, S = len(frames).
        """
        if not frames:
            raise InputError("no structures to batch")
        counts = np.array([f.n_atoms for f in frames], dtype=np.int64)
        ptr = np.concatenate([[0], np.cumsum(counts)])
        n_graphs, n_nodes = len(frames), int(ptr[-1])
        edge_index = np.concatenate([f.edge_index + ptr[k] for k, f in enumerate(frames)], axis=1)
        unit_shifts = np.concatenate([f.unit_shifts for f in frames], axis=0)
        cells = np.stack([f.cell for f in frames])
        shifts = np.concatenate([f.unit_shifts @ f.cell for f in frames], axis=0)
        species = np.concatenate([f.species for f in frames])
        node_attrs = np.zeros((n_nodes, len(self.info.atomic_numbers)))
        node_attrs[np.arange(n_nodes), species] = 1.0
        boxes = [mace_box(f.cell, f.pbc, f.positions, self.info.r_max) for f in frames]
        volumes = np.array([np.linalg.det(b) for b in boxes])
        rcells = np.stack([2 * math.pi * np.linalg.inv(b.T) if abs(np.linalg.det(b)) > 0
                           else np.zeros((3, 3)) for b in boxes])
        floats = {"positions": np.concatenate([f.positions for f in frames]),
                  "node_attrs": node_attrs, "shifts": shifts, "unit_shifts": unit_shifts,
                  "cell": cells.reshape(-1, 3), "rcell": rcells.reshape(-1, 3),
                  "volume": volumes}
        ints = {"edge_index": edge_index, "batch": np.repeat(np.arange(n_graphs), counts),
                "ptr": ptr, "head": np.full(n_graphs, self.head_index, dtype=np.int64)}
        out: Dict[str, Tensor] = {}
        for name, value in floats.items():
            if name in self.fields:
                out[name] = torch.from_numpy(value).to(self.device, self.dtype)
        for name, value in ints.items():
            out[name] = torch.from_numpy(np.ascontiguousarray(value)).to(self.device)
        if "pbc" in self.fields:
            out["pbc"] = torch.from_numpy(np.stack([f.pbc for f in frames])).to(self.device)
        for name, row in self.per_node.items():
            out[name] = row.to(self.device).expand(n_nodes, *row.shape[1:]).contiguous()
        for name, row in self.per_graph.items():
            out[name] = row.to(self.device).expand(n_graphs, *row.shape[1:]).contiguous()
        return out


def mace_box(cell: np.ndarray, pbc: np.ndarray, positions: np.ndarray,
             r_max: float) -> np.ndarray:
    """The cell mace derives ``volume`` and ``rcell`` from: its neighbour list's box, in which a
    zero cell becomes the identity and each non-periodic vector is replaced by a long one
    (``5 r_max (max |x| + 1)`` along its axis)."""
    box = np.identity(3) if not cell.any() else cell.copy()
    length = (np.max(np.abs(positions)) + 1) * 5 * r_max
    for axis in range(3):
        if not pbc[axis]:
            box[axis] = length * np.identity(3)[axis]
    return box


def split_results(out: Dict[str, Tensor], frames: Sequence[HostFrame],
                  with_stress: Sequence[bool]) -> List[Dict[str, np.ndarray]]:
    """Per-frame float64 results from one batched model output, with one copy to the host.

    Returns:
        one dict per frame: ``energy`` (float), ``free_energy``, ``energies [N]``,
        ``forces [N, 3]``, and ``stress [6]`` (ASE Voigt order) where ``with_stress``.
    """
    from ase.stress import full_3x3_to_voigt_6_stress

    n_graphs = len(frames)
    parts = [out["energy"].detach().reshape(-1), out["node_energy"].detach().reshape(-1),
             out["forces"].detach().reshape(-1)]
    any_stress = any(with_stress)
    if any_stress:
        parts.append(out["stress"].detach().reshape(-1))
    flat = torch.cat([p.to(torch.float64) for p in parts]).cpu().numpy()
    n_nodes = sum(f.n_atoms for f in frames)
    energy = flat[:n_graphs]
    node_energy = flat[n_graphs:n_graphs + n_nodes]
    forces = flat[n_graphs + n_nodes:n_graphs + 4 * n_nodes].reshape(-1, 3)
    stress = flat[n_graphs + 4 * n_nodes:].reshape(-1, 3, 3) if any_stress else None
    results, start = [], 0
    for k, frame in enumerate(frames):
        stop = start + frame.n_atoms
        item = {"energy": float(energy[k]), "free_energy": float(energy[k]),
                "energies": node_energy[start:stop].copy(), "forces": forces[start:stop].copy()}
        if with_stress[k]:
            item["stress"] = full_3x3_to_voigt_6_stress(stress[k])
        results.append(item)
        start = stop
    return results
