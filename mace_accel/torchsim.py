"""An accelerated MACE model as a torch-sim ``ModelInterface`` (batched MD and relaxation).

torch-sim (https://github.com/Radical-AI/torch-sim) integrates and relaxes many systems at once;
its models take a ``SimState`` (all systems' atoms concatenated) and return energies, forces and
stresses of every system from one call. :class:`AcceleratedMaceModel` loads and accelerates a
MACE model as :class:`~mace_accel.calculator.MACEAccelCalculator` does and evaluates every
system of a state in one model call::

    import torch_sim as ts
    from mace_accel.torchsim import AcceleratedMaceModel

    model = AcceleratedMaceModel("my.model", device="cuda", default_dtype="float32")
    final = ts.integrate([atoms_1, atoms_2], model, integrator=ts.nvt_langevin, n_steps=1000,
                         temperature=300, timestep=0.002)

Each call builds mace's batch dict on the model's device: the neighbour lists of the systems
(vesin on that device, no copy of the positions to the host; a Verlet list per system, rebuilt
only when that system's atoms have moved more than half the skin, :class:`BatchNeighbours`),
the shifts from each system's cell, and the structure-independent fields (charges, spin,
head, ...) as batched evaluation does (:mod:`mace_accel.models.frames`). What depends only on
the atomic numbers (element one-hot, system bounds) is kept while they do not change.

torch-sim is an optional dependency (``pip install 'mace-accel[torchsim]'``) that only this module
imports; without it the module still imports and :class:`AcceleratedMaceModel` raises an
``ImportError`` saying how to install it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from mace_accel.calculator import _check_skin
from mace_accel.errors import InputError
from mace_accel.models.frames import BatchDefaults, assemble_batch, species_table
from mace_accel.models.neighbours import neighbour_list
from mace_accel.models.outputs import evaluate as evaluate_model
from mace_accel.prepared import PreparedModel, prepare_model
from mace_accel.models.resident import skin_is_exact
from mace_accel.models.validation import _check_elements
from mace_accel.options import AccelOptions, make_options

try:
    from torch_sim.models.interface import ModelInterface
except ImportError as exc:  # an optional extra: the module imports, the model says what to do
    ModelInterface = torch.nn.Module  # type: ignore[misc,assignment]
    # without its traceback: that would hold the frames of whatever imported this module
    _TORCH_SIM_MISSING: Optional[ImportError] = exc.with_traceback(None)
else:
    _TORCH_SIM_MISSING = None

Tensor = torch.Tensor


@dataclasses.dataclass
class _Systems:
    """What a state's atomic numbers and system indices fix (kept while they do not change).

    Attributes:
        numbers: ``[N]`` int64 atomic numbers, on the model's device (the cache key).
        system_idx: ``[N]`` int64 system of each atom, on the model's device (the cache key).
        species: ``[N]`` int64 index of each atom's element in the model's table (device).
        counts: ``[S]`` int64 atoms per system (device).
        bounds: ``(start, stop)`` atom range of each system.
    """

    numbers: Tensor
    system_idx: Tensor
    species: Tensor
    counts: Tensor
    bounds: List[Tuple[int, int]]

    def matches(self, numbers: Tensor, system_idx: Tensor) -> bool:
        return torch.equal(numbers, self.numbers) and torch.equal(system_idx, self.system_idx)


def _settable_flag(attribute: str, doc: str) -> property:
    """A bool property stored in ``attribute``."""
    def get(self) -> bool:
        return getattr(self, attribute)

    def set_(self, value: bool) -> None:
        setattr(self, attribute, bool(value))

    return property(get, set_, doc=doc)


class AcceleratedMaceModel(ModelInterface):
    """A MACE model with fused interaction blocks, for torch-sim's integrators and optimisers.

    Args:
        model: path to a MACE ``.model`` file, a loaded MACE module (modified in place: cast,
            moved, accelerated), or None for the small Cu/Ni model bundled with mace-accel.
        device: ``"auto"`` (a GPU if torch sees one, else the CPU), ``"cuda"``, ``"cuda:N"`` or
            ``"cpu"``.
        default_dtype: ``"float32"`` or ``"float64"``; the model is cast to it and torch-sim's
            runners make their states in it (torch's global default dtype is never changed).
        head: head of a multi-head model (default: the only head, or the one named "default").
        compute_forces: return forces (torch-sim's dynamics and relaxations need them).
        compute_stress: return stresses (cell relaxation, NPT); settable later, as torch-sim's
            ``validate_model_outputs`` does.
        backend, verify, fallback, deterministic, options: as
            :class:`~mace_accel.calculator.MACEAccelCalculator`.
        min_distance: smallest interatomic distance accepted in Å (None disables the check);
            closer atoms (a diverged run, wrong units) raise an :class:`InputError`.
        skin: Verlet skin of the neighbour lists in Å: a system's list is rebuilt only when one
            of its atoms has moved more than ``skin / 2`` (periodic wrapping, which torch-sim
            applies every MD step, does not count) or its cell has changed; 0 rebuilds every
            list on every call.

    Attributes:
        prepared: the :class:`~mace_accel.prepared.PreparedModel` (model, info, head,
            report, device, dtype).
        model: the accelerated MACE module.
        backend: ``"cuda"`` (fused kernels), ``"reference"`` (plain torch) or ``"mace"``
            (the model as mace built it).
        neighbours: the :class:`BatchNeighbours` (``n_builds``: lists of single systems built).
        n_calls: number of model calls so far.
    """

    def __init__(self, model: Union[str, Path, torch.nn.Module, None] = None, *,
                 device: Union[str, torch.device] = "auto", default_dtype: str = "float32",
                 head: Optional[str] = None, compute_forces: bool = True,
                 compute_stress: bool = True, backend: str = "auto", verify: bool = True,
                 fallback: str = "warn", deterministic: bool = True,
                 min_distance: Optional[float] = 0.5, skin: float = 0.3,
                 options: Optional[AccelOptions] = None) -> None:
        if _TORCH_SIM_MISSING is not None:
            raise ImportError(
                "AcceleratedMaceModel needs torch-sim (the 'torch-sim-atomistic' package, Python "
                ">= 3.11), which is not installed: pip install 'mace-accel[torchsim]'"
            ) from _TORCH_SIM_MISSING
        super().__init__()
        skin = _check_skin(skin)
        requested = make_options(options, backend=backend, verify=verify, fallback=fallback,
                                 deterministic=deterministic)
        self.prepared: PreparedModel = prepare_model(model, device, default_dtype, head,
                                                     requested)
        self.model = self.prepared.model
        self._device = self.prepared.device
        self._dtype = self.prepared.dtype
        self._compute_forces = bool(compute_forces)
        self._compute_stress = bool(compute_stress)
        self._memory_scales_with = "n_atoms_x_density"  # a radial cutoff
        self.min_distance = min_distance
        self._defaults = BatchDefaults.for_model(self.prepared.info, self.prepared.head,
                                                 self._dtype)
        self._table = species_table(self.prepared.info)
        self._systems: Optional[_Systems] = None
        self.neighbours = BatchNeighbours(self.prepared.info.r_max, skin,
                                          exact=skin_is_exact(self.model))
        self.n_calls = 0

    @property
    def backend(self) -> str:
        return self.prepared.backend

    # settable, unlike ModelInterface's (whose setters raise): both are flags of the model call
    compute_forces = _settable_flag("_compute_forces", "Whether forward returns forces.")
    compute_stress = _settable_flag("_compute_stress", "Whether forward returns stresses.")

    def forward(self, state, **kwargs) -> Dict[str, Tensor]:
        """Energies, forces and stresses of every system of ``state``, from one model call.

        Args:
            state: a torch-sim ``SimState`` (or a dict of its fields): ``positions [N, 3]`` Å,
                ``cell [S, 3, 3]`` (torch-sim's column convention: ``cell[s][:, k]`` is vector
                k), ``pbc`` (a bool, three bools, or ``[S, 3]``), ``atomic_numbers [N]``,
                ``system_idx [N]`` (ascending: the atoms of each system together).

        Returns:
            ``energy [S]`` (eV), ``forces [N, 3]`` (eV/Å) if ``compute_forces``, ``stress
            [S, 3, 3]`` (eV/Å^3; mace's and ASE's sign, positive = tensile; zero for a system
            without a periodic 3D cell) if ``compute_stress``; in the model's dtype, on its
            device, detached.

        Raises:
            InputError: an element the model does not know, NaN positions, atoms closer than
                ``min_distance``, a singular periodic cell, ...; the message starts with
                ``system <s>:``.
        """
        positions, cells, pbc, numbers, system_idx = _read_state(state, self._device,
                                                                 self._dtype)
        systems = self._systems_of(numbers, system_idx)
        if cells.shape[0] != len(systems.bounds):
            raise InputError(f"the state has {len(systems.bounds)} systems (system_idx) but "
                             f"{cells.shape[0]} cells")
        edge_index, unit_shifts, shifts = self.neighbours.update(positions, cells,
                                                                 pbc.tolist(), systems)
        if self.min_distance:
            self._check_distances(positions, edge_index, shifts, systems)
        batch = assemble_batch(positions, systems.species, cells, pbc.to(self._device),
                               systems.counts, edge_index, unit_shifts, shifts,
                               self._defaults, self.prepared.info, self._dtype)
        with torch.enable_grad():  # forces and stress are gradients, even under no_grad
            if self._compute_forces and self._compute_stress:  # edges come grouped by system
                out = evaluate_model(self.model, batch, compute_stress=True)
            else:
                out = self.model(batch, training=False, compute_force=self._compute_forces,
                                 compute_stress=self._compute_stress)
        self.n_calls += 1
        results = {"energy": out["energy"].detach()}
        if self._compute_forces:
            results["forces"] = out["forces"].detach()
        if self._compute_stress:
            results["stress"] = out["stress"].detach()
        return results

    # -- internals ------------------------------------------------------------------------------
    def _systems_of(self, numbers: Tensor, system_idx: Tensor) -> _Systems:
        """The cached :class:`_Systems`, rebuilt (and the elements checked) when the atomic
        numbers or system indices change."""
        if self._systems is not None and self._systems.matches(numbers, system_idx):
            return self._systems
        numbers_np = numbers.cpu().numpy()
        idx_np = system_idx.cpu().numpy()
        if len(idx_np) == 0:
            raise InputError("the state has no atoms")
        counts = np.bincount(idx_np)
        if idx_np[0] != 0 or np.any(np.diff(idx_np) < 0) or np.any(counts == 0):
            raise InputError("system_idx must number the systems 0, 1, 2, ... in ascending "
                             "order, the atoms of each system together (as torch-sim's "
                             "states do)")
        stops = np.cumsum(counts)
        bounds = [(int(stop - n), int(stop)) for n, stop in zip(counts, stops)]
        for k, (start, stop) in enumerate(bounds):
            try:
                _check_elements(numbers_np[start:stop], self.prepared.info)
            except InputError as exc:
                raise InputError(f"system {k}: {exc}") from None
        species = torch.from_numpy(self._table[numbers_np]).to(self._device)
        self._systems = _Systems(numbers.clone(), system_idx.clone(), species,
                                 torch.from_numpy(counts).to(self._device), bounds)
        return self._systems

    def _check_distances(self, positions: Tensor, edge_index: Tensor, shifts: Tensor,
                         systems: _Systems) -> None:
        """Raise if two atoms (or images) are closer than ``min_distance``: one number from the
        device; every such pair is an edge, since ``min_distance`` < the cutoff."""
        if edge_index.shape[1] == 0:
            return
        pos = positions.detach().to(torch.float64)
        vectors = pos[edge_index[1]] - pos[edge_index[0]] + shifts
        squared = (vectors * vectors).sum(dim=1)
        shortest = squared.argmin()
        d2 = float(squared[shortest])
        if d2 >= float(self.min_distance) ** 2:
            return
        i, j = edge_index[:, shortest].tolist()
        k = next(s for s, (start, stop) in enumerate(systems.bounds) if start <= i < stop)
        start = systems.bounds[k][0]
        raise InputError(
            f"system {k}: atoms {i - start} and {j - start} are {d2 ** 0.5:.4f} Å apart, closer "
            f"than min_distance={self.min_distance} Å; the structure has overlapping atoms "
            "(check units and the cell, or a run that diverged), or lower min_distance")


class BatchNeighbours:
    """The neighbour lists of every system of a batch, each rebuilt only when it may be wrong.

    A system's list is built with vesin at ``cutoff + skin`` (:func:`neighbour_list`) and kept
    while none of its atoms has moved more than ``skin / 2`` since and its cell is unchanged:
    it then still holds every pair closer than ``cutoff``. Displacements are measured modulo
    the lattice of a fully periodic system, because torch-sim wraps positions into the cell
    every MD step: an atom wrapped by a lattice vector ``n @ cell`` keeps its edges, whose
    unit shifts are corrected by ``n`` (``+ n[sender] - n[receiver]``). One number per system
    comes from the device per call (which lists are stale); only those are rebuilt. The extra
    pairs between ``cutoff`` and ``cutoff + skin`` are dropped for models where they are not
    exactly zero (``exact=False``, see :func:`~mace_accel.models.resident.skin_is_exact`).

    Args:
        cutoff: the model's cutoff in Å.
        skin: in Å (>= 0); 0 rebuilds every list on every call.
        exact: the model may be given pairs beyond the cutoff.
    """

    def __init__(self, cutoff: float, skin: float, exact: bool) -> None:
        self.cutoff, self.skin, self.exact = float(cutoff), float(skin), bool(exact)
        self.n_builds = 0
        self._systems: Optional[_Systems] = None  # the systems the lists are of
        self._pbc: Optional[List[List[bool]]] = None
        self._parts: List[Tuple[Tensor, Tensor]] = []  # per system: edge_index, unit_shifts
        self._ref = self._cells = self._inverse = self._periodic = None
        self._edge_index = self._unit_shifts = self._edge_system = None

    def update(self, positions: Tensor, cells: Tensor, pbc: List[List[bool]],
               systems: _Systems) -> Tuple[Tensor, Tensor, Tensor]:
        """The edges of every system for the current geometry.

        Args:
            positions: ``[N, 3]`` Å, on the model's device.
            cells: ``[S, 3, 3]`` float64, rows are the cell vectors.
            pbc: per system, three bools.
            systems: the atoms' systems.

        Returns:
            ``edge_index [2, E]`` int64 (batch indices), ``unit_shifts [E, 3]`` and ``shifts
            [E, 3]`` float64 (``unit_shifts @ cell`` of each edge's system).

        Raises:
            InputError: as :func:`neighbour_list`, the message starting with ``system <s>:``.
        """
        positions = positions.detach().to(torch.float64)
        if systems is not self._systems or pbc != self._pbc or self.skin == 0.0:
            self._start(positions, cells, pbc, systems)
            stale, wraps = list(range(len(systems.bounds))), None
        else:
            stale, wraps = self._stale(positions, cells, systems)
        if stale:
            self._rebuild(stale, positions, cells, pbc, systems)
            if wraps is not None:
                for k in stale:  # measured from the new reference: no wrap
                    wraps[slice(*systems.bounds[k])] = 0.0
        unit_shifts = self._unit_shifts
        if wraps is not None:
            senders, receivers = self._edge_index
            unit_shifts = unit_shifts + wraps[senders] - wraps[receivers]
        shifts = torch.bmm(unit_shifts.unsqueeze(1), cells[self._edge_system]).squeeze(1)
        edge_index = self._edge_index
        if not self.exact and self.skin > 0.0:  # drop the pairs beyond the cutoff
            vectors = positions[edge_index[1]] - positions[edge_index[0]] + shifts
            keep = (vectors * vectors).sum(dim=1) < self.cutoff ** 2
            edge_index, unit_shifts, shifts = edge_index[:, keep], unit_shifts[keep], shifts[keep]
        return edge_index, unit_shifts, shifts

    def _start(self, positions: Tensor, cells: Tensor, pbc: List[List[bool]],
               systems: _Systems) -> None:
        """Forget every list (new systems or periodicity)."""
        self._systems, self._pbc = systems, [list(p) for p in pbc]
        self._parts = [None] * len(systems.bounds)  # type: ignore[list-item]
        self._ref = positions.clone()
        self._cells = cells.clone()
        self._inverse = torch.zeros_like(cells)
        self._periodic = torch.tensor([all(p) for p in pbc], device=cells.device)

    def _stale(self, positions: Tensor, cells: Tensor,
               systems: _Systems) -> Tuple[List[int], Tensor]:
        """The systems whose lists may be wrong, and ``[N, 3]`` each atom's wrap ``n`` (whole
        cell vectors, 0 outside fully periodic systems) since its system's list was built."""
        index = systems.system_idx
        delta = positions - self._ref
        fractional = torch.einsum("ni,nij->nj", delta, self._inverse[index])
        wraps = torch.round(fractional) * self._periodic[index, None]
        moved = delta - torch.einsum("ni,nij->nj", wraps, self._cells[index])
        farthest = torch.zeros(len(systems.bounds), dtype=torch.float64,
                               device=positions.device).scatter_reduce(
            0, index, (moved * moved).sum(dim=1), "amax")
        # NaN positions fail <=: their system is rebuilt, and the list rejects them
        stale = ~(farthest <= (0.5 * self.skin) ** 2) \
            | (cells != self._cells).flatten(1).any(dim=1)
        return torch.nonzero(stale).flatten().tolist(), wraps

    def _rebuild(self, stale: List[int], positions: Tensor, cells: Tensor,
                 pbc: List[List[bool]], systems: _Systems) -> None:
        """New lists for the systems ``stale``, then the concatenated edges."""
        host_cells = cells[stale].cpu()  # the list checks the cell on the host: one copy
        for row, k in enumerate(stale):
            start, stop = systems.bounds[k]
            try:
                edge_index, unit_shifts = neighbour_list(
                    positions[start:stop], host_cells[row], tuple(pbc[k]),
                    self.cutoff + self.skin)
            except InputError as exc:
                raise InputError(f"system {k}: {exc}") from None
            self._parts[k] = (edge_index + start, unit_shifts)
            self._ref[start:stop] = positions[start:stop]
        self.n_builds += len(stale)
        self._cells[stale] = cells[stale]
        # inverses for measuring wraps; only fully periodic cells have one (checked by the list),
        # zeros elsewhere (no wraps there; where() drops the inverse of a singular cell)
        inverse, _ = torch.linalg.inv_ex(cells[stale])
        self._inverse[stale] = torch.where(self._periodic[stale, None, None], inverse,
                                           torch.zeros_like(inverse))
        self._edge_index = torch.cat([part[0] for part in self._parts], dim=1)
        self._unit_shifts = torch.cat([part[1] for part in self._parts])
        counts = torch.tensor([part[0].shape[1] for part in self._parts],
                              device=positions.device)
        self._edge_system = torch.repeat_interleave(
            torch.arange(len(self._parts), device=positions.device), counts,
            output_size=int(self._edge_index.shape[1]))


def _read_state(state, device: torch.device, dtype: torch.dtype
                ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The fields of a ``SimState`` (or a dict of them) on ``device``.

    Returns:
        ``positions [N, 3]`` in ``dtype`` (detached: mace sets requires_grad on what it gets),
        ``cells [S, 3, 3]`` float64 with rows the cell vectors (torch-sim keeps columns),
        ``pbc [S, 3]`` bool on the host (the neighbour list wants Python bools),
        ``atomic_numbers [N]`` and ``system_idx [N]`` int64.
    """
    def field(name: str, *aliases: str):
        for key in (name, *aliases):
            value = state.get(key) if isinstance(state, dict) else getattr(state, key, None)
            if value is not None:
                return value
        return None

    positions, cell = field("positions"), field("cell")
    numbers, pbc = field("atomic_numbers"), field("pbc")
    if positions is None or cell is None or numbers is None or pbc is None:
        raise InputError("the state needs positions, cell, pbc and atomic_numbers (a torch-sim "
                         "SimState or a dict of its fields)")
    positions = positions.detach().to(device=device, dtype=dtype)
    numbers = torch.as_tensor(numbers).to(device=device, dtype=torch.int64)
    system_idx = field("system_idx", "batch")
    system_idx = (torch.zeros_like(numbers) if system_idx is None
                  else torch.as_tensor(system_idx).to(device=device, dtype=torch.int64))
    cell = torch.as_tensor(cell).detach().to(device=device, dtype=torch.float64)
    cells = (cell.unsqueeze(0) if cell.dim() == 2 else cell).transpose(1, 2)
    n_systems = cells.shape[0]
    pbc = torch.as_tensor(pbc).to(device="cpu", dtype=torch.bool)
    if pbc.dim() == 0:
        pbc = pbc.expand(3)
    if pbc.shape == (3,):
        pbc = pbc.expand(n_systems, 3)
    if pbc.shape != (n_systems, 3):
        raise InputError(f"pbc must be a bool, three bools or [n_systems, 3] bools, got shape "
                         f"{list(pbc.shape)}")
    return positions, cells, pbc.contiguous(), numbers, system_idx
