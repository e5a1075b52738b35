"""A structure's batch kept on the model's device between calls (MD, optimisation).

The first call, and every call after the atoms' numbers, count or periodicity changed, builds
mace's full batch dict through mace's own data path
(:func:`~mace_accel.models.batch.atoms_to_batch`).
Later calls copy only the geometry in (positions and cell, float64 on the host -> the device)
and take the edges from a Verlet neighbour list on the device (vesin, rebuilt only when an atom
has moved more than half the skin): no mace ``AtomicData``, no Python per atom or edge.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from mace_accel.models.batch import ModelInfo, atoms_to_batch
from mace_accel.models.neighbours import VerletNeighbourList, within_cutoff

Tensor = torch.Tensor

# interaction blocks through which edges beyond the cutoff contribute exactly zero (the cutoff
# envelope multiplies the radial features of a bias-free radial MLP); see neighbours.py
SKIN_EXACT_BLOCKS = frozenset({
    "RealAgnosticInteractionBlock", "RealAgnosticResidualInteractionBlock",
    "RealAgnosticDensityInteractionBlock", "RealAgnosticDensityResidualInteractionBlock"})


def skin_is_exact(model: torch.nn.Module) -> bool:
    """True if the model may be given the Verlet list's extra pairs (beyond the cutoff) as they
    are: every interaction block is one of :data:`SKIN_EXACT_BLOCKS`, or the model applies the
    cutoff to the final weights (``apply_cutoff=False``), and any ZBL pair repulsion ends
    within the cutoff for every pair of the model's elements (:func:`repulsion_within_cutoff`).
    Otherwise the calculator keeps only the edges within the cutoff every step."""
    if getattr(model, "pair_repulsion", False) and not repulsion_within_cutoff(model):
        return False
    if not getattr(getattr(model, "radial_embedding", None), "apply_cutoff", True):
        return True
    return all(type(block).__name__ in SKIN_EXACT_BLOCKS
               for block in getattr(model, "interactions", ()))


def repulsion_within_cutoff(model: torch.nn.Module) -> bool:
    """Whether the model's ZBL pair repulsion is zero beyond its cutoff for every pair of its
    elements: mace's ZBL ends at the sum of the pair's covalent radii (its envelope times
    ``r < r_u + r_v``), at most twice the largest radius of the model's elements (4.88 Å for
    the 89 elements of MACE-MP, under its 6 Å cutoff)."""
    zbl = getattr(model, "pair_repulsion_fn", None)
    radii = getattr(zbl, "covalent_radii", None)
    numbers = getattr(model, "atomic_numbers", None)
    r_max = getattr(model, "r_max", None)
    if not isinstance(radii, torch.Tensor) or numbers is None or r_max is None:
        return False
    numbers = numbers.tolist() if isinstance(numbers, torch.Tensor) else list(numbers)
    largest = max(float(radii[int(z)]) for z in numbers)
    return 2.0 * largest <= float(r_max)


class ResidentBatch:
    """mace's batch dict of one structure, on ``device``, updated in place of being rebuilt.

    Args:
        info: the model's elements, cutoff, heads.
        head: the head to evaluate.
        dtype: the model's floating dtype.
        device: the model's device.
        skin: Verlet skin in Å (0: a new neighbour list every call).
        exact_skin: the model may see the list's pairs beyond the cutoff (:func:`skin_is_exact`);
            if False, only the pairs within the cutoff are passed, every call.
        skin_edges_up_to: the most edges a call is given with the list's pairs beyond the
            cutoff (an exact model); a longer list gives only its pairs within the cutoff (a call
            that large runs eagerly: the pairs beyond would cost work and memory, up to a sixth
            more edges at 6 Å and a 0.3 Å skin, and save nothing). None: no limit.
    """

    def __init__(self, info: ModelInfo, head: str, dtype: torch.dtype, device: torch.device,
                 skin: float = 0.5, exact_skin: bool = True,
                 skin_edges_up_to: Optional[int] = None) -> None:
        self.exact_skin = bool(exact_skin)
        self.skin_edges_up_to = skin_edges_up_to
        self.info, self.head, self.dtype, self.device = info, head, dtype, torch.device(device)
        self.skin = float(skin)
        self._template: Optional[Dict[str, Tensor]] = None
        self._topology: Optional[Tuple] = None
        self.neighbours = VerletNeighbourList(info.r_max, self.skin)
        self.n_templates = 0
        self._cell: Optional[Tuple[np.ndarray, Dict[str, Tensor]]] = None
        self._edges: Optional[Tuple] = None
        # positions on the host (pinned on a GPU: an asynchronous copy) and on the device
        self._staging: Optional[Tuple[Tensor, Tensor]] = None

    @staticmethod
    def topology(atoms) -> Tuple:
        """What forces a new template: atomic numbers and periodicity (and so the atom count)."""
        return (np.asarray(atoms.numbers).tobytes(), tuple(bool(p) for p in atoms.pbc))

    def batch(self, atoms) -> Dict[str, Tensor]:
        """The batch dict for ``atoms`` (validated by the caller).

        Whether the neighbour list may be reused is decided on the host, from the same float64
        positions and cell the device gets (an O(N) numpy pass in the list, no synchronisation);
        a list that may not is rebuilt on the device before the batch is returned."""
        topology = self.topology(atoms)
        if self._template is None or topology != self._topology:
            self._template = atoms_to_batch(atoms, self.info, head=self.head, dtype=self.dtype,
                                            device=self.device)
            self._topology = topology
            self._cell = self._edges = None
            self._staging = None
            self.n_templates += 1
        out = dict(self._template)
        positions = np.ascontiguousarray(atoms.positions, dtype=np.float64)
        positions64 = self._positions_to_device(positions)
        cell_np = np.ascontiguousarray(atoms.cell.array, dtype=np.float64)
        if self._cell is None or not np.array_equal(cell_np, self._cell[0]):
            self._cell = (cell_np.copy(), self._cell_fields(cell_np))
        cell64 = self._cell[1]["cell64"]
        edge_index, unit_shifts, _ = self.neighbours.update(
            positions64, cell64, tuple(bool(p) for p in atoms.pbc), host=(positions, cell_np))
        too_many = (self.skin_edges_up_to is not None
                    and edge_index.shape[1] > self.skin_edges_up_to)
        if (not self.exact_skin or too_many) and self.skin > 0:
            edge_index, unit_shifts = within_cutoff(positions64, cell64, edge_index,
                                                    unit_shifts, self.info.r_max)
        if self._edges is None or self._edges[0] is not edge_index \
                or self._edges[1] is not self._cell[1]:
            # shifts = unit_shifts @ cell in float64, as mace: new only with new edges or cell
            unit64 = unit_shifts.to(torch.float64)
            self._edges = (edge_index, self._cell[1], {
                "edge_index": edge_index,
                "unit_shifts": unit64.to(self._template["unit_shifts"].dtype),
                "shifts": (unit64 @ cell64).to(self.dtype)})
        out.update(self._edges[2])
        out.update({k: v for k, v in self._cell[1].items() if k in out})
        out["positions"] = positions64.to(self.dtype)
        return out

    def _positions_to_device(self, positions: np.ndarray) -> Tensor:
        """``[N, 3]`` float64 positions on the device, copied through a pinned host buffer (the
        caller's results copy, later in the step, orders it before the next overwrite)."""
        if self.device.type != "cuda":
            return torch.from_numpy(positions).to(self.device)
        if self._staging is None or self._staging[0].shape != positions.shape:
            host = torch.empty(positions.shape, dtype=torch.float64, pin_memory=True)
            self._staging = (host, torch.empty_like(host, device=self.device))
        host, device = self._staging
        host.numpy()[...] = positions
        device.copy_(host, non_blocking=True)
        return device

    def _cell_fields(self, cell_np: np.ndarray) -> Dict[str, Tensor]:
        """The cell and what mace derives from it (volume, rcell) on the device."""
        cell64 = torch.from_numpy(cell_np.copy()).to(self.device)
        t = self._template
        fields = {"cell64": cell64,
                  "cell": cell64.to(self.dtype).reshape(t["cell"].shape)}
        det = float(np.linalg.det(cell_np))
        if "volume" in t:
            fields["volume"] = torch.full_like(t["volume"], det)
        if "rcell" in t:  # mace: 2 pi inv(cell^T), zeros for a singular cell
            rcell = 2 * math.pi * np.linalg.inv(cell_np.T) if abs(det) > 0 \
                else np.zeros((3, 3))
            fields["rcell"] = torch.from_numpy(rcell).to(self.device, self.dtype).reshape(
                t["rcell"].shape)
        return fields
