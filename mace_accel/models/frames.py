"""Many structures in one mace batch dict, built from arrays (no mace ``AtomicData`` per frame).

mace's own data path costs milliseconds of Python per structure (``config_from_atoms``,
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
    """One validated structure: host arrays, and its neighbour list where it was computed.

    Attributes:
        species: ``[N]`` int64 index of each atom's element in the model's table.
        positions: ``[N, 3]`` float64, Å.
        cell: ``[3, 3]`` float64 (rows a, b, c; zeros for a molecule).
        pbc: ``[3]`` bool.
        edge_index: ``[2, E]`` int64 tensor (sender, receiver), mace's convention, on the CPU
            or the model's device.
        unit_shifts: ``[E, 3]`` float64 tensor of whole numbers, beside ``edge_index``.
    """

    species: np.ndarray
    positions: np.ndarray
    cell: np.ndarray
    pbc: np.ndarray
    edge_index: Tensor
    unit_shifts: Tensor

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


def host_frame(atoms, info: ModelInfo, table: np.ndarray, min_distance: Optional[float] = 0.5,
               device: torch.device | str = "cpu") -> HostFrame:
    """Validate ``atoms`` and reduce it to a :class:`HostFrame`, its neighbour list computed by
    vesin on ``device`` (on a GPU a small structure's list costs a launch, not a millisecond of
    host time).

    The overlap check uses the neighbour list's own distances; only a structure that fails it
    goes through :func:`validate_atoms`'s full distance check, for the message naming the atoms.

    Raises:
        InputError: as :func:`validate_atoms`.
    """
    validate_atoms(atoms, info, min_distance=None)
    positions = np.ascontiguousarray(atoms.positions, dtype=np.float64)
    cell = np.ascontiguousarray(atoms.cell.array, dtype=np.float64)
    pbc = np.asarray(atoms.pbc, dtype=bool).copy()
    points = torch.from_numpy(positions).to(device)
    box = torch.from_numpy(cell).to(device)
    edge_index, unit_shifts = neighbour_list(points, box, tuple(pbc.tolist()), info.r_max)
    if min_distance and edge_index.shape[1]:
        vectors = points[edge_index[1]] - points[edge_index[0]] + unit_shifts @ box
        if float(vectors.square().sum(dim=1).min()) < float(min_distance) ** 2:
            validate_atoms(atoms, info, min_distance=min_distance)  # raises, naming the atoms
    return HostFrame(table[np.asarray(atoms.numbers)], positions, cell, pbc, edge_index,
                     unit_shifts)


class BatchDefaults:
    """The fields of mace's batch that do not depend on the structure, learnt once from a
    template built through mace's own data path (charges, spin, electronic temperature, ...:
    the defaults mace fills in when the structure carries none).

    Args:
        template_atoms: any structure of at least two atoms the model can evaluate (with one
            atom, a per-atom field cannot be told from a per-structure one).
        info: the model's elements, cutoff, heads.
        head: the head to evaluate.
        dtype: the model's floating dtype.

    Attributes:
        fields: the name of every field mace's batch has (labels included).
        head_index: the index of ``head`` in the model's heads.
        per_node: name -> ``[1, ...]`` row, repeated for every atom.
        per_graph: name -> ``[1, ...]`` row, repeated for every structure.
    """

    def __init__(self, template_atoms, info: ModelInfo, head: str, dtype: torch.dtype) -> None:
        template = atoms_to_batch(template_atoms, info, head=head, dtype=dtype, device="cpu")
        n = int(template["positions"].shape[0])
        self.head_index = int(template["head"].reshape(-1)[0])
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

    @classmethod
    def for_model(cls, info: ModelInfo, head: str, dtype: torch.dtype) -> "BatchDefaults":
        """The defaults learnt from a dimer of the model's first element (no cell)."""
        from ase import Atoms

        dimer = Atoms(numbers=[info.atomic_numbers[0]] * 2,
                      positions=[[0.0, 0.0, 0.0], [0.0, 0.0, 0.5 * info.r_max]])
        return cls(dimer, info, head, dtype)

    def expand(self, n_nodes: int, n_graphs: int, device: torch.device) -> Dict[str, Tensor]:
        """The default fields for ``n_nodes`` atoms in ``n_graphs`` structures on ``device``,
        and ``head [n_graphs]``."""
        out = {"head": torch.full((n_graphs,), self.head_index, dtype=torch.int64,
                                  device=device)}
        for name, row in self.per_node.items():
            out[name] = row.to(device).expand(n_nodes, *row.shape[1:]).contiguous()
        for name, row in self.per_graph.items():
            out[name] = row.to(device).expand(n_graphs, *row.shape[1:]).contiguous()
        return out


def assemble_batch(positions: Tensor, species: Tensor, cells: Tensor, pbc: Tensor,
                   counts: Tensor, edge_index: Tensor, unit_shifts: Tensor, shifts: Tensor,
                   defaults: BatchDefaults, info: ModelInfo, dtype: torch.dtype
                   ) -> Dict[str, Tensor]:
    """mace's batch dict of S structures from their concatenated arrays, all on one device.

    Args:
        positions: ``[N, 3]`` Å (atoms of structure 0 first, then 1, ...).
        species: ``[N]`` int64 index of each atom's element in the model's table.
        cells: ``[S, 3, 3]`` rows are the cell vectors (zeros for a molecule); float64 keeps
            ``volume`` and ``rcell`` exact.
        pbc: ``[S, 3]`` bool.
        counts: ``[S]`` int64 atoms per structure.
        edge_index: ``[2, E]`` int64 (sender, receiver), already offset to batch indices.
        unit_shifts: ``[E, 3]`` whole numbers.
        shifts: ``[E, 3]`` float64, ``unit_shifts @ cell`` of each edge's structure.
        defaults: the structure-independent fields.
        info: the model's elements and cutoff.
        dtype: the model's floating dtype (every floating field is cast to it).

    Returns:
        ``positions [N, 3]``, ``node_attrs [N, n_elements]``, ``edge_index [2, E]``,
        ``shifts``/``unit_shifts [E, 3]``, ``cell``/``rcell [3 S, 3]``, ``volume [S]``,
        ``pbc [S, 3]``, ``batch [N]``, ``ptr [S + 1]``, ``head [S]`` and the defaults; only the
        geometry fields mace's own batch has.
    """
    device = positions.device
    n_graphs, n_nodes = int(counts.shape[0]), int(positions.shape[0])
    batch = torch.repeat_interleave(torch.arange(n_graphs, device=device), counts,
                                    output_size=n_nodes)  # no device sync
    ptr = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    node_attrs = torch.nn.functional.one_hot(species, len(info.atomic_numbers))
    boxes = mace_boxes(cells, pbc, positions.detach().to(torch.float64), batch, info.r_max)
    volumes = torch.linalg.det(boxes)
    # mace: 2 pi inv(box^T), zeros for a singular box (inv_ex: no error, no device sync)
    inverse, _ = torch.linalg.inv_ex(boxes.transpose(1, 2))
    rcells = torch.where((volumes.abs() > 0)[:, None, None], 2 * math.pi * inverse,
                         torch.zeros_like(inverse))
    floats = {"positions": positions, "node_attrs": node_attrs, "shifts": shifts,
              "unit_shifts": unit_shifts, "cell": cells.reshape(-1, 3),
              "rcell": rcells.reshape(-1, 3), "volume": volumes}
    out = {name: value.to(dtype) for name, value in floats.items() if name in defaults.fields}
    out.update(edge_index=edge_index, batch=batch, ptr=ptr)
    if "pbc" in defaults.fields:
        out["pbc"] = pbc
    out.update(defaults.expand(n_nodes, n_graphs, device))
    return out


class FrameBatcher:
    """Concatenates :class:`HostFrame` s into one mace batch dict on ``device``.

    Args:
        template_atoms: any structure the model can evaluate; mace's data path builds a batch of
            it once to learn the fields and their default values (:class:`BatchDefaults`).
        info: the model's elements, cutoff, heads.
        head: the head to evaluate.
        dtype: the model's floating dtype.
        device: where the batch goes.
    """

    def __init__(self, template_atoms, info: ModelInfo, head: str, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.info, self.dtype = info, dtype
        self.device = torch.device(device)
        self.defaults = BatchDefaults(template_atoms, info, head, dtype)

    def collate(self, frames: Sequence[HostFrame]) -> Dict[str, Tensor]:
        """The batch dict of ``frames`` (graph ``k`` = ``frames[k]``), on the device: the
        fields of :func:`assemble_batch`, S = len(frames). One copy per field to the device."""
        if not frames:
            raise InputError("no structures to batch")
        dev = self.device
        counts = np.array([f.n_atoms for f in frames], dtype=np.int64)
        edge_counts = torch.tensor([f.n_edges for f in frames], device=dev)
        arrays = {"positions": np.concatenate([f.positions for f in frames]),
                  "species": np.concatenate([f.species for f in frames]),
                  "cells": np.stack([f.cell for f in frames]),
                  "pbc": np.stack([f.pbc for f in frames]), "counts": counts}
        on_device = {name: torch.from_numpy(np.ascontiguousarray(value)).to(dev)
                     for name, value in arrays.items()}
        # edges: concatenated where they were computed, offset to batch indices on the device
        graph_of_edge = torch.repeat_interleave(torch.arange(len(frames), device=dev),
                                                edge_counts)
        first_atom = torch.cumsum(on_device["counts"], 0) - on_device["counts"]
        edge_index = torch.cat([f.edge_index.to(dev) for f in frames], dim=1) \
            + first_atom[graph_of_edge]
        unit_shifts = torch.cat([f.unit_shifts.to(dev, torch.float64) for f in frames])
        shifts = torch.einsum("ei,eij->ej", unit_shifts, on_device["cells"][graph_of_edge])
        return assemble_batch(**on_device, edge_index=edge_index, unit_shifts=unit_shifts,
                              shifts=shifts, defaults=self.defaults, info=self.info,
                              dtype=self.dtype)


def mace_boxes(cells: Tensor, pbc: Tensor, positions: Tensor, batch: Tensor,
               r_max: float) -> Tensor:
    """``[S, 3, 3]`` float64: the cells mace derives ``volume`` and ``rcell`` from, its
    neighbour list's boxes, in which a zero cell becomes the identity and each non-periodic
    vector is replaced by a long one (``5 r_max (max |x| + 1)`` along its axis, the maximum
    over the structure's atoms).

    Args:
        cells: ``[S, 3, 3]`` rows are the cell vectors.
        pbc: ``[S, 3]`` bool.
        positions: ``[N, 3]`` float64.
        batch: ``[N]`` the structure of each atom.
        r_max: the model's cutoff in Å.
    """
    cells = cells.to(torch.float64)
    eye = torch.eye(3, dtype=torch.float64, device=cells.device)
    largest = torch.zeros(cells.shape[0], dtype=torch.float64, device=cells.device)
    if positions.shape[0]:
        largest = largest.scatter_reduce(0, batch, positions.abs().amax(dim=1), "amax")
    zero = ~cells.reshape(-1, 9).any(dim=1)
    box = torch.where(zero[:, None, None], eye.expand_as(cells), cells)
    long = ((largest + 1) * 5 * r_max)[:, None, None] * eye
    return torch.where(pbc[:, :, None], box, long)


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
