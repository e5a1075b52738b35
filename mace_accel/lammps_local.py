"""LAMMPS on one rank: the model's call on the local atoms, as the ASE calculator makes it.

Where LAMMPS gives the positions and the box (``scripts/lammps/mliap-positions.patch``),
:class:`PositionsCall` hands them to the ASE calculator itself: its neighbour list on the
device (a Verlet list, rebuilt only when an atom has moved more than half its skin), its CUDA
graphs, its forces per atom and its stress, which becomes LAMMPS's virial. LAMMPS then makes no
pair arrays (``pairs_wanted = False``) and copies no pair vectors: a step costs what the
calculator's call costs plus LAMMPS's integration, communication and neighbour lists. Steps
that need forces per pair (the per-atom virial of ``compute stress/atom``; a virial that a
``hybrid`` pair style takes from all forces) still get ML-IAP's pairs and take
:class:`LocalCall`.

Otherwise (a LAMMPS without that patch) :class:`LocalCall` makes the calculator's batch from
ML-IAP's pairs. On a run of one rank every ghost atom is a periodic image of a local atom, so LAMMPS's pairs
``i -> j`` (``rij = r_j - r_i``) are the periodic structure's edges once each ghost ``j`` is
replaced by its owner: mace's ordinary batch of the local atoms, every atom at the origin and
each edge's whole vector in its shift (``shifts = r_i - r_j``: mace's edge vector is
``positions[receiver] - positions[sender] + shift``, receiver ``i``, sender ``j``). The forces
are then the gradient with respect to the positions, summed onto each atom inside the fused
kernels (deterministic), and LAMMPS gets them per atom: ``[nlocal, 3]`` back from the device
instead of ``[npairs, 3]``, and no per-pair loop in LAMMPS. On a GPU the call is a CUDA graph
replay per shape bucket (:class:`~mace_accel.capture.GraphedCall`, as the calculator's) up to
:data:`~mace_accel.capture.GRAPH_MAX_EDGES` pairs, eager beyond.

LAMMPS computes the virial from forces where they act (``sum x (x) f`` over local and ghost
atoms, or per pair), so a step that asks for it (pressure output, a barostat) takes the forces
per pair instead: the same call also gives each edge's ``dE/dv``, and the pair force
``f_ij = -dE/dv`` goes to ``update_pair_forces``.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from mace_accel.capture import GRAPH_MAX_EDGES, CaptureError, GraphedCall, PinnedResults, unpack
from mace_accel.models.outputs import evaluate as evaluate_model

Tensor = torch.Tensor


class LocalCall:
    """Energies and forces of the local atoms of a one-rank LAMMPS run.

    Args:
        model: the accelerated model on ``device``, in ``dtype``.
        r_max: its cutoff (Å).
        head_index: the head's index among the model's heads.
        n_elements: the model's element count (LAMMPS's ``elems`` index them).
        graphs: replay CUDA graphs (a CUDA device) up to GRAPH_MAX_EDGES pairs; else the
            eager call.
    """

    def __init__(self, model: torch.nn.Module, r_max: float, head_index: int, n_elements: int,
                 device: torch.device, dtype: torch.dtype, graphs: bool) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.head_index, self.n_elements = int(head_index), int(n_elements)
        self.graphed: Optional[GraphedCall] = GraphedCall(model, r_max) if graphs else None
        self._results = PinnedResults()  # where the graph's packed results land
        # the inputs that change only when LAMMPS rebuilds its lists, kept with what they were
        # made from (the same tensor again lets the graph skip their copy and its edge sorts)
        self._edges: Tuple[Optional[Tuple[np.ndarray, ...]], Optional[Tensor]] = (None, None)
        self._species: Tuple[Optional[np.ndarray], Optional[Tensor]] = (None, None)
        self._ptr: Tuple[int, Optional[Tensor]] = (-1, None)  # (atoms, [0, atoms])
        self._zeros: Dict[str, Tensor] = {}
        # the same for every call
        self._constant = {
            "cell": torch.eye(3, dtype=dtype, device=device),
            "head": torch.tensor([self.head_index], dtype=torch.int64, device=device),
            # read by models with charge and spin embeddings (mace's defaults), else unused
            "total_charge": torch.zeros(1, dtype=dtype, device=device),
            "total_spin": torch.ones(1, dtype=dtype, device=device),
        }

    def __call__(self, data: Any, owners: np.ndarray, per_pair: bool = False
                 ) -> Tuple[np.ndarray, np.ndarray, float]:
        """``(node energies [nlocal], forces, energy)``, float64 host arrays, of the local
        atoms of ``data`` (LAMMPS's ML-IAP data) whose ghosts' owners are ``owners [ntotal]``
        (:func:`mace_accel.lammps.ghost_owners`); the forces per atom ``[nlocal, 3]``, or with
        ``per_pair`` LAMMPS's pair forces ``[npairs, 3]`` (the force on ``pair_i``; its
        opposite acts on ``pair_j``)."""
        n_local, n_pairs = int(data.nlocal), int(data.npairs)
        batch = self.batch(data, owners)
        if self.graphed is not None and n_pairs <= GRAPH_MAX_EDGES:
            try:
                out = self.graphed(batch, compute_stress=False, edge_gradients=per_pair)
            except CaptureError as exc:
                warnings.warn(f"mace-accel: this model's call cannot be captured in a CUDA graph "
                              f"({exc}); LAMMPS's calls run without graphs (slower for small "
                              "systems)", RuntimeWarning, stacklevel=2)
                self.graphed = None
                torch.cuda.synchronize(self.device)
            else:
                results, _ = unpack(self._results.fetch(out["packed"]), n_local,
                                    out["n_pad"], False, n_pairs if per_pair else None)
                forces = -results["edge_gradients"] if per_pair else results["forces"]
                return results["node_energy"], forces, float(results["energy"])
        out = evaluate_model(self.model, batch, False, edge_gradients=per_pair)
        forces = -out["edge_gradients"] if per_pair else out["forces"]
        flat = torch.cat([out["node_energy"].detach().reshape(-1)[:n_local],
                          forces.detach().reshape(-1)]).to(torch.float64).cpu().numpy()
        node_energy = flat[:n_local]
        return node_energy, flat[n_local:].reshape(-1, 3), float(node_energy.sum())

    def batch(self, data: Any, owners: np.ndarray) -> Dict[str, Tensor]:
        """mace's one-structure batch of the local atoms (module docstring): ``positions
        [nlocal, 3]`` zeros, ``shifts [npairs, 3] = -rij``, ``edge_index [2, npairs]`` (sender:
        the owner of ``pair_j``; receiver: ``pair_i``), ``node_attrs [nlocal, n_elements]``,
        one structure."""
        n_local = int(data.nlocal)
        rij = torch.as_tensor(np.asarray(data.rij)).to(self.device)
        return {
            "positions": self._kept("positions", (n_local, 3), self.dtype),
            "shifts": rij.neg().to(self.dtype),
            "edge_index": self._edge_index(data, owners),
            "node_attrs": self._node_attrs(data, n_local),
            "batch": self._kept("batch", (n_local,), torch.int64),
            "ptr": self._structure_ptr(n_local),
            **self._constant,
        }

    # -- inputs kept between calls ------------------------------------------------------------
    def _kept(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """Zeros of ``shape``, the same tensor while the shape holds."""
        kept = self._zeros.get(name)
        if kept is None or tuple(kept.shape) != shape:
            kept = self._zeros[name] = torch.zeros(shape, dtype=dtype, device=self.device)
        return kept

    def _structure_ptr(self, n_local: int) -> Tensor:
        """``[0, nlocal]``, the same tensor while the atom count holds (kept with the count on
        the host: reading it back from the device would wait for the GPU)."""
        if self._ptr[0] != n_local:
            self._ptr = (n_local, torch.tensor([0, n_local], device=self.device))
        return self._ptr[1]

    def _edge_index(self, data: Any, owners: np.ndarray) -> Tensor:
        """``[2, npairs]`` int64, the same tensor until LAMMPS's pairs or owners change (a
        neighbour-list rebuild)."""
        source = (np.asarray(data.pair_i), np.asarray(data.pair_j), owners)
        seen, kept = self._edges
        if kept is None or not all(np.array_equal(a, b) for a, b in zip(seen, source)):
            pair_i = torch.as_tensor(source[0]).to(self.device).long()
            pair_j = torch.as_tensor(source[1]).to(self.device).long()
            senders = torch.as_tensor(owners).to(self.device)[pair_j]
            kept = torch.stack([senders, pair_i])
            self._edges = (tuple(np.array(a, copy=True) for a in source), kept)
        return kept

    def _node_attrs(self, data: Any, n_local: int) -> Tensor:
        """``[nlocal, n_elements]`` one-hot, the same tensor until the local atoms' elements
        change."""
        elems = np.asarray(data.elems)[:n_local]
        seen, kept = self._species
        if kept is None or not np.array_equal(seen, elems):
            species = torch.as_tensor(elems).to(self.device).long()
            kept = torch.nn.functional.one_hot(species, self.n_elements).to(self.dtype)
            self._species = (elems.copy(), kept)
        return kept


def lammps_cell(box: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``(cell [3, 3], pbc [3] bool)`` of LAMMPS's box as ``data.box()`` gives it (boxlo;
    xprd, yprd, zprd, yz, xz, xy; periodic flags): the rows are the vectors ``(xprd, 0, 0)``,
    ``(xy, yprd, 0)``, ``(xz, yz, zprd)``."""
    xprd, yprd, zprd, yz, xz, xy = (float(v) for v in box[3:9])
    cell = np.array([[xprd, 0.0, 0.0], [xy, yprd, 0.0], [xz, yz, zprd]])
    return cell, np.asarray(box[9:12]) > 0


def lammps_order(virial: np.ndarray) -> np.ndarray:
    """LAMMPS's order ``[6]`` (xx, yy, zz, xy, xz, yz) of a symmetric ``[3, 3]`` tensor."""
    v = np.asarray(virial, dtype=np.float64)
    return np.array([v[0, 0], v[1, 1], v[2, 2], v[0, 1], v[0, 2], v[1, 2]])


def lammps_virial(stress: np.ndarray, volume: float) -> np.ndarray:
    """LAMMPS's virial ``[6]`` (xx, yy, zz, xy, xz, yz; eV: the sum of ``r (x) f``) of ASE's
    stress ``[6]`` (Voigt xx, yy, zz, yz, xz, xy; eV/Å^3, positive = tensile)."""
    from ase.stress import voigt_6_to_full_3x3_stress

    return -volume * lammps_order(voigt_6_to_full_3x3_stress(np.asarray(stress, np.float64)))


class PositionsCall:
    """Energies, forces and virial of a one-rank LAMMPS run from its positions and box, through
    the ASE calculator (module docstring).

    Args:
        calculator: the :class:`~mace_accel.calculator.MACEAccelCalculator` whose model the
            LAMMPS model runs.
        numbers: the atomic number of each of LAMMPS's elements (``elems`` index it).
    """

    def __init__(self, calculator: Any, numbers: np.ndarray) -> None:
        self.calculator = calculator
        self.numbers = np.asarray(numbers, dtype=np.int64)
        self._atoms: Any = None  # the ase.Atoms the calculator sees, kept while elements hold

    @staticmethod
    def usable(data: Any) -> bool:
        """Whether this step can take the positions path: LAMMPS gives positions and box, and
        the step needs no forces per pair: those of the per-atom virial or of a virial that
        another pair style takes from all forces (``pair_forces_needed``), and those of a
        virial in a box that is not periodic in all three dimensions (the calculator's stress
        needs one); LAMMPS made the pairs for these."""
        if not hasattr(data, "pairs_made"):
            return False
        if not data.pairs_made:
            return True
        if data.pair_forces_needed:
            return False
        return not (int(data.vflag) and not lammps_cell(data.box())[1].all())

    def __call__(self, data: Any) -> Tuple[np.ndarray, np.ndarray, float, Optional[np.ndarray]]:
        """``(node energies [nlocal], forces [nlocal, 3], energy, virial [6] or None)``,
        float64 host arrays; the virial where LAMMPS asks for it (``vflag``). Asks LAMMPS for
        no pair arrays from the next step on where the box is periodic in all three
        dimensions (the calculator's stress then gives the virial)."""
        n_local = int(data.nlocal)
        cell, pbc = lammps_cell(data.box())
        data.pairs_wanted = not bool(pbc.all())
        want_virial = bool(int(data.vflag))
        if want_virial and not pbc.all():
            raise RuntimeError(
                "mace-accel: LAMMPS asks for the virial of a box that is not periodic in all "
                f"three dimensions (periodic: {pbc.tolist()}) on a step without pair arrays; "
                "keep the box's periodicity fixed during a run")
        elems = np.asarray(data.elems)[:n_local]
        atoms = self._structure(elems, pbc)
        atoms.arrays["positions"][...] = np.asarray(data.x)[:n_local]
        atoms.set_cell(cell)
        calc = self.calculator
        properties = ["energy", "forces", "energies"] + (["stress"] if want_virial else [])
        calc.calculate(atoms, properties, calc.check_state(atoms))
        results = calc.results
        virial = (lammps_virial(results["stress"], abs(float(np.linalg.det(cell))))
                  if want_virial else None)
        return results["energies"], results["forces"], float(results["energy"]), virial

    def _structure(self, elems: np.ndarray, pbc: np.ndarray) -> Any:
        """The ase.Atoms of the local atoms' elements, the same object while they and the
        periodicity hold (LAMMPS reorders its atoms now and then: a new one then)."""
        import ase

        numbers = self.numbers[elems]
        atoms = self._atoms
        if atoms is None or len(atoms) != len(numbers) \
                or not np.array_equal(atoms.numbers, numbers) \
                or not np.array_equal(atoms.pbc, pbc):
            atoms = self._atoms = ase.Atoms(numbers=numbers, positions=np.zeros((len(numbers), 3)),
                                            pbc=pbc)
        return atoms
